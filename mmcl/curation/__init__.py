"""Data curation with a CLIP model: score, filter, deduplicate and decontaminate image-text shards
(`mmcl curate`). Sits above `evaluation` (it shares its embedding pass) and below the command line."""

from .curate import curate
from .rules import REASONS, Rules, decide

__all__ = ["curate", "Rules", "decide", "REASONS"]
