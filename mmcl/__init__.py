"""mmcl: CLIP-style multimodal contrastive pretraining on WebDataset shards with Accelerate."""

from .errors import CheckpointError, ConfigError, DataError, MmclError

__version__ = "0.1.0"
__all__ = ["load", "MmclError", "ConfigError", "DataError", "CheckpointError", "__version__"]


def load(path):
    """``model, preprocess, tokenizer = mmcl.load(path)`` for a run dir, its ``model/``, or an export.

    See `mmcl.storage.weights.load`. Imported lazily so that ``import mmcl.losses`` does not pull in open_clip.
    """
    from .storage.weights import load as _load

    return _load(path)
