"""Typed configuration: a dataclass tree loaded from YAML and overridden by ``dotted.key=value``.

The schema is the dataclasses of `mmcl.config.schema`, each leaf key with its description; OmegaConf does the YAML
parsing, merging and type conversion (it parses override values by the field's declared type). Unknown keys and
bad values become a `ConfigError` that names the key and the closest valid keys, and every problem is reported at
once.

A config returned by `load_config` or `from_dict` is read-only: assigning to any of its fields raises
`dataclasses.FrozenInstanceError`, so nothing changes it during a run. A changed copy is made with
`dataclasses.replace` (or, better, with an override).

Its modules, whose public names are all importable from here:

- `schema`: the dataclasses, `described` (a field with its help), `freeze`, the values of train.precision and
  train.log_with;
- `keys`: the dotted keys, their types, defaults and help (`describe_keys`, `keys_help`), `get`, `term_keys`;
- `checks`: every check of a value (`validate`) and the rules the data stream and evaluation share;
- `load`: `load_config`, `parse_overrides`, `to_yaml`, `to_dict`, `from_dict`, the moved keys;
- `process`: the process world (`world`, `is_main_process`, `data_workers`), the one reader of the launcher's
  variables.
"""

from .checks import (
    EVAL_SET_KEYS,
    EvalSet,
    aug_problems,
    data_weight_problems,
    duplicate_set_names,
    eval_sets,
    phase_lengths,
    validate,
)
from .keys import KeyInfo, describe_keys, get, keys_help, term_keys, valid_keys
from .load import MOVED_KEYS, from_dict, load_config, moved_keys_carried, parse_overrides, to_dict, to_yaml
from .process import World, data_workers, is_main_process, say, world
from .schema import (
    PRECISION_OF,
    PRECISIONS,
    TRACKERS,
    AugConfig,
    DataConfig,
    DdpConfig,
    DistillConfig,
    EvalConfig,
    GlobalContrastiveConfig,
    LossConfig,
    MochiConfig,
    ModelConfig,
    NaflexConfig,
    OptimConfig,
    PhaseConfig,
    ShortCaptionConfig,
    TextTowerConfig,
    TrackConfig,
    TrainConfig,
    TrainSection,
    described,
    freeze,
)

__all__ = [
    "AugConfig", "DataConfig", "DdpConfig", "DistillConfig", "EVAL_SET_KEYS", "EvalConfig", "EvalSet",
    "GlobalContrastiveConfig", "KeyInfo", "LossConfig", "MOVED_KEYS", "MochiConfig", "ModelConfig", "NaflexConfig",
    "OptimConfig",
    "PRECISIONS", "PRECISION_OF", "PhaseConfig", "ShortCaptionConfig", "TRACKERS", "TextTowerConfig", "TrackConfig",
    "TrainConfig",
    "TrainSection", "World", "aug_problems", "data_weight_problems", "data_workers", "describe_keys", "described",
    "duplicate_set_names", "eval_sets", "freeze", "from_dict", "get", "is_main_process", "keys_help", "load_config",
    "moved_keys_carried", "parse_overrides", "phase_lengths", "say", "term_keys", "to_dict", "to_yaml", "valid_keys",
    "validate", "world",
]
