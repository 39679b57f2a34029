"""mmcl: CLIP-style multimodal contrastive pretraining on WebDataset shards with Accelerate."""

from .errors import CheckpointError, ConfigError, DataError, MmclError
from .models import load

__version__ = "0.1.0"
__all__ = ["load", "MmclError", "ConfigError", "DataError", "CheckpointError", "__version__"]
