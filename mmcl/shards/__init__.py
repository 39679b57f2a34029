"""Datasets written as WebDataset shards: `mmcl shards` (a folder or table of the user's -> shards),
`mmcl negatives` (shards copied with rule-made negative captions) and `mmcl demo-data` (the synthetic
coloured-shapes set). Above `mmcl.data`, whose readers they use, and
`mmcl.storage`, whose owned-folder manifest they write::

    writer.py   writing shards (`write_shards`, `ShardWriter`) and `mmcl shards` (`shards_from_input`)
    negatives.py  negative captions made by rule (`rule_negatives`) and `mmcl negatives` (`write_negative_shards`):
                copies of shards with each sample's neg.txt
    demo.py     the synthetic coloured-shapes set (`make_demo_data`)
"""
