"""WebDataset streaming for training and evaluation: sources, reading, decoding, transforms, the resumable stream.

Shards follow the img2dataset / WebDataset convention: consecutive tar members sharing a key form one sample
(``KEY.jpg|jpeg|png|webp`` image, ``KEY.txt`` caption, optional ``KEY.cls`` label, optional ``KEY.json``, optional
``KEY.neg.txt`` negative captions, one a line).
One concern per module, imported in this order (each uses only those above it)::

    sources.py     shard specs (braces, globs, directories, '::' sources, YAML lists) -> URLs (names found on
                   disk as absolute paths); `open_shard` opens local paths with ``open()`` and URLs (``pipe:``,
                   http) through webdataset's ``gopen``; `redact` hides credentials in commands and URLs
    reading.py     tar streams -> raw samples with their positions (`TarReader`, `read_raw_samples`)
    decode.py      raw sample -> image bytes, caption, label (`parse_sample`); bytes -> RGB (`decode_image`,
                   `to_rgb`); the skip reasons; a training sample through its seeded transform (`decode_sample`)
    transforms.py  decoded image -> tensor: the training transform built from a model's image numbers
                   (`ImageSpec`, `train_image_stages`), seeded per-sample transforms, the uint8 hand-off
                   (`ImageFinish`; `split_transform` for a caller's own transform), the cheaper random crop
    device_decode.py  ``data.decode=device``: a JPEG's header checked and its crop box drawn in the worker, the
                   encoded bytes batched, decoded and cropped where the model runs (`DeviceFinish`)
    naflex.py      native-resolution batches for NaFlex towers: the per-batch sequence length and pairs
                   (`NaflexPlan`), aspect-kept resizing, patches padded to the length, their normalisation
    pipeline.py    the resumable training stream's plan: its settings (`StreamSpec`, `InputSizes`), the shard
                   plan per slot, the block shuffle, positions and their carrying over to another layout
    batching.py    a data worker's side: samples decoded at their input sizes, batched (`role_batches`,
                   `collate`), each batch sent in a `WorkerOutput` with the worker's position
    stream.py      the training process's side (`build_train_stream`, `TrainStream`): workers, the positions
                   of the batches consumed, a saved state and resuming from one
    eval_data.py   evaluation datasets (`build_eval_dataset`): ImageFolder or shards, each sample once; the images
                   of a folder or of shards, unlabelled (`build_image_set`)
    shard_inputs.py  `mmcl shards`'s inputs (caption folders, ImageFolders, tables) -> the images they name

The names below are the package's public interface; import them from ``mmcl.data``.
"""

from .batching import WorkerOutput, collate, role_batches, short_caption
from .decode import (
    IMAGE_EXTS,
    SKIP_REASONS,
    SampleKeys,
    SkipSample,
    TransformOutputError,
    caption_draw,
    decode_image,
    decode_sample,
    image_bytes,
    parse_caption,
    parse_label,
    parse_sample,
    pil_to_uint8,
    sample_keys,
    to_rgb,
    zero_skips,
)
from .eval_data import (
    EvalFailure,
    EvalSkip,
    ImageFilesDataset,
    ImageFolderDataset,
    ShardEvalDataset,
    build_eval_dataset,
    build_image_set,
    eval_collate,
    is_image_folder,
    open_rgb,
)
from .naflex import NaflexPlan
from .pipeline import InputSizes, epoch_shard_plan, shuffle_block
from .reading import RawSample, TarFormatError, TarReader, read_raw_samples
from .sources import SHARD_SUFFIXES, expand_sources, expand_urls, has_scheme, missing_shards, open_shard, redact
from .stream import WORKER_STOP_GRACE_S, TrainStream, build_train_stream
from .transforms import (
    TRAIN_CROP_SCALE,
    ImageFinish,
    ImageSpec,
    PyRandomResizedCrop,
    aug_dict,
    draft_size_of,
    random_crop_box,
    split_transform,
    train_draft_size,
    train_image_input,
    train_image_stages,
    training_sample_transform,
)

__all__ = [
    "IMAGE_EXTS", "SKIP_REASONS", "SHARD_SUFFIXES", "WORKER_STOP_GRACE_S",
    "TRAIN_CROP_SCALE", "EvalFailure", "EvalSkip", "ImageFilesDataset", "ImageFinish", "ImageFolderDataset",
    "ImageSpec", "NaflexPlan", "PyRandomResizedCrop", "RawSample",
    "ShardEvalDataset", "SkipSample", "TarFormatError", "TarReader", "TrainStream",
    "TransformOutputError", "InputSizes", "WorkerOutput",
    "build_eval_dataset", "build_image_set", "build_train_stream", "collate", "short_caption", "decode_image",
    "decode_sample",
    "draft_size_of",
    "epoch_shard_plan", "eval_collate", "expand_sources", "expand_urls", "has_scheme", "image_bytes",
    "is_image_folder", "missing_shards", "open_rgb", "open_shard", "parse_caption", "parse_label", "parse_sample",
    "SampleKeys", "caption_draw", "sample_keys",
    "pil_to_uint8", "random_crop_box", "read_raw_samples", "redact", "role_batches", "shuffle_block",
    "split_transform", "to_rgb", "train_draft_size", "train_image_input", "train_image_stages",
    "aug_dict", "training_sample_transform",
    "zero_skips",
]
