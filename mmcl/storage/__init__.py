"""What mmcl keeps on disk: training checkpoints (`checkpoints`), model directories and weights (`weights`), exports
(`export`, `hf_clip`, `clip_tokenizer_file`), and the file-system helpers every writer shares (`fsutil`: atomic
files and directories; `manifest`: the folders a command owns)."""
