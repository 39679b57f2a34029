"""Datasets written as WebDataset shards: `mmcl shards` (a folder or table of the user's -> shards) and
`mmcl demo-data` (the synthetic coloured-shapes set). Above `mmcl.data`, whose readers they use, and
`mmcl.storage`, whose owned-folder manifest they write::

    writer.py   writing shards (`write_shards`, `ShardWriter`) and `mmcl shards` (`shards_from_input`)
    demo.py     the synthetic coloured-shapes set (`make_demo_data`)
"""
