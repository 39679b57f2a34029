"""Loading a config: a YAML file and ``dotted.key=value`` overrides merged onto the schema by OmegaConf (which
parses and converts each value by its field's type), every bad key or value reported at once in the schema's words;
and a config written out (`to_yaml`, `to_dict`) and read back (`from_dict`), moved keys carried over."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..errors import ConfigError, file_problem, redact_values
from .checks import validate
from .keys import key_infos, nearest_keys, section_keys
from .schema import TrainConfig, freeze

# Keys that moved to where they act: the old key is an error naming the new one in what the user writes, and is
# carried to its new place in what mmcl wrote itself (a run's config.yaml, a model's config), by `moved_keys_carried`.
MOVED_KEYS = {"loss.max_logit_scale": "model.max_logit_scale"}


def moved_keys_carried(saved: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a saved config dict with each key of `MOVED_KEYS` at its new place (a value already at the new
    place wins). A run folder written before a key moved is then the same run as before."""
    out = json.loads(json.dumps(saved, default=str)) if isinstance(saved, dict) else saved
    if not isinstance(out, dict):
        return out
    for old, new in MOVED_KEYS.items():
        (osec, okey), (nsec, nkey) = old.split(".", 1), new.split(".", 1)
        section = out.get(osec)
        if isinstance(section, dict) and okey in section:
            value = section.pop(okey)
            target = out.setdefault(nsec, {})
            if isinstance(target, dict):
                target.setdefault(nkey, value)
    return out


def _describe(err: OmegaConfBaseException, key: str, value: Any) -> str:
    """One line for a failed merge of ``key=value``, in the schema's words (OmegaConf's own text names its
    internals, e.g. "Merge error: int is not a subclass of OptimConfig")."""
    if key in MOVED_KEYS:
        return f"'{key}' is now '{MOVED_KEYS[key]}': rename the key ({MOVED_KEYS[key]}={value})"
    fields = key_infos()
    if key in section_keys():
        leaves = [k for k in fields if k.startswith(key + ".")]
        return (f"'{key}' is a section, not a value: set its keys, e.g. {leaves[0]}=... "
                f"(`mmcl train --help` lists them)")
    if key in fields:
        return f"bad value for '{key}': expected {fields[key].type}, got {value!r}"
    full = getattr(err, "full_key", None) or key
    if isinstance(err, ConfigKeyError) or "not in" in str(err) or full not in fields:
        return f"unknown config key '{full}'{nearest_keys(full)}"
    return f"bad value for '{full}': expected {fields[full].type}, got {value!r}"


def _merge_checked(base, other, errors: List[str], source: str):
    """Merge `other` into `base` key by key so that every bad key is reported, not just the first."""
    flat = _flatten(OmegaConf.to_container(other, resolve=False))
    for key, value in flat:
        try:
            base.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"{source}: {_describe(err, key, value)}")
    return base


def _flatten(node, prefix: str = ""):
    """Yield (dotted key, value); dict-typed leaves of the schema (vision_cfg, text_cfg) stay whole."""
    out = []
    if isinstance(node, dict) and prefix.rstrip(".") not in ("model.vision_cfg", "model.text_cfg"):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and key not in ("model.vision_cfg", "model.text_cfg"):
                out += _flatten(v, key + ".")
            else:
                out.append((key, v))
    else:
        out.append((prefix.rstrip("."), node))
    return out


def _nested(key: str, value):
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def parse_overrides(overrides: List[str]) -> List[tuple]:
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. data.batch_size=32)")
        key, raw = item.split("=", 1)
        # YAML parsing gives ints, floats, bools, null and lists; the schema then converts by field type. A pipe:
        # command is a string as typed (its "Authorization: ..." is no mapping, its " #" no comment).
        try:
            value = raw.strip() if raw.lstrip().startswith("pipe:") else OmegaConf.to_container(
                OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]  # never resolved: see refuse_interpolation
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override '{item}': the value is not valid YAML ({problem})") from None
        pairs.append((key.strip(), value))
    return pairs


_MAX_CONFIG_NODES = 100_000  # far beyond any config; YAML aliases that expand past it are refused, not expanded


def _check_size(path: str) -> None:
    """Refuse a config file whose YAML aliases expand to more than `_MAX_CONFIG_NODES` values, or that nests deeper
    than the parser goes: counted on PyYAML's objects, where an alias is one shared object, before OmegaConf copies
    each alias out (a few lines of YAML can otherwise ask for 10^9 copies)."""
    sizes: Dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        if id(node) not in sizes:
            sizes[id(node)] = 1  # a node that holds itself counts once
            items = list(node.values()) if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(size(item) for item in items)
        return sizes[id(node)]

    try:
        with open(path, "rb") as f:
            count = size(yaml.safe_load(f))
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except (yaml.YAMLError, ValueError):  # not YAML: OmegaConf.load says where
        return
    if count > _MAX_CONFIG_NODES:
        raise ConfigError(f"{path}: its YAML aliases expand to {count:,} values (at most {_MAX_CONFIG_NODES:,} in a "
                          f"config); write the values out instead of repeating aliases")


def _interpolated(node, prefix: str = "") -> List[str]:
    """The dotted keys of `node` (a plain container) whose string value holds ``${``: OmegaConf would resolve it."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _interpolated(value, f"{prefix}{key}.")]
    if isinstance(node, (list, tuple)):
        return [k for i, value in enumerate(node) for k in _interpolated(value, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if isinstance(node, str) and "${" in node else []


def refuse_interpolation(node, source: str) -> None:
    """ConfigError (one line naming the keys) when a value of `node` holds ``${...}``. A config never interpolates:
    OmegaConf's resolvers read the environment (``${oc.env:HF_TOKEN}``) and would write what they read into
    config.yaml, ``--print-config`` and the trackers. In a ``pipe:`` command, ``$NAME`` (no braces) is left to the
    shell that runs it."""
    keys = _interpolated(node)
    if keys:
        raise ConfigError(f"{source}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}: '${{...}}' "
                          f"interpolation is not taken in mmcl configs (a resolver may read the environment); write "
                          f"the value itself (in a pipe: command, $NAME without braces is left to the shell)")


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> TrainConfig:
    """Load a YAML file (optional) and apply ``dotted.key=value`` overrides; validate; return the dataclass tree,
    read-only.

    Raises `ConfigError` listing every problem found.
    """
    errors: List[str] = []
    cfg = OmegaConf.structured(TrainConfig)
    if path is not None:
        problem = file_problem(path)  # "not found", "is not a regular file (a FIFO)"...
        if problem is not None:
            raise ConfigError(f"config file {problem}: {path}")
        _check_size(path)
        try:
            raw = OmegaConf.load(path)
        except yaml.MarkedYAMLError as err:  # file:line:column, as compilers and YAML linters print it
            mark = err.problem_mark or err.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise ConfigError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
        except Exception as err:  # other YAML errors (e.g. a bad encoding) carry no position
            raise ConfigError(f"cannot parse {path}: {str(err).splitlines()[0]}") from None
        if not isinstance(raw, type(OmegaConf.create({}))):
            raise ConfigError(f"{path} must hold a mapping of config sections, got a list")
        refuse_interpolation(OmegaConf.to_container(raw, resolve=False), path)
        _merge_checked(cfg, raw, errors, path)
    for item in overrides or []:
        try:
            [(key, value)] = parse_overrides([item])
        except ConfigError as err:
            errors.append(str(err))
            continue
        try:
            refuse_interpolation({key: value}, "override")
        except ConfigError as err:
            errors.append(str(err))
            continue
        try:
            cfg.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"override {key}: {_describe(err, key, value)}")
    # A failed merge leaves its key at the value before it, so the values that did merge are still checked: bad
    # values are reported together with unknown keys.
    try:
        obj: TrainConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        obj = None
        errors += [] if errors else [f"invalid config: {str(err).splitlines()[0]}"]
    if obj is not None:
        errors += validate(obj)
    if errors:
        raise ConfigError(f"{len(errors)} problems: " + "; ".join(errors) if len(errors) > 1 else errors[0])
    return freeze(obj)

def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML, every credential a data source carries hidden (`mmcl.errors.redact_values`)."""

    return OmegaConf.to_yaml(OmegaConf.create(redact_values(to_dict(cfg))))


def to_dict(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: Dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved by `to_yaml`/`to_dict` (e.g. a run's config.yaml), moved keys carried over; a value
    holding ``${...}`` is refused as in `load_config`."""
    refuse_interpolation(data, "saved config")
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(moved_keys_carried(data)))
    return freeze(OmegaConf.to_object(cfg))
