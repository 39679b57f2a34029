"""The schema's keys: the dotted key of every field, each leaf's type, default and description as ``mmcl train
--help`` and docs/reference/config.md list them (the description is the field's declared ``help``), the key a
misspelt one was meant to be, and the key of each loss term's weight."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
import re
import textwrap
from dataclasses import dataclass
from typing import Dict, List, get_type_hints

from .schema import LOSS_TERMS, LossConfig, TrainConfig


@functools.lru_cache(maxsize=None)
def _subsections(schema) -> Dict[str, type]:
    """Field name -> section class for the fields of `schema` that are sections. The annotations are text here
    (``from __future__ import annotations``); typing resolves them, so the tree is read from the dataclasses."""
    return {name: hint for name, hint in get_type_hints(schema).items() if dataclasses.is_dataclass(hint)}


def valid_keys(schema=TrainConfig, prefix: str = "") -> List[str]:
    """All dotted keys of the schema (leaves and sub-trees)."""
    keys = []
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        keys.append(key)
        if f.name in _subsections(schema):
            keys += valid_keys(_subsections(schema)[f.name], key + ".")
    return keys


@dataclass(frozen=True)
class KeyInfo:
    """One config key as ``mmcl train --help`` lists it."""

    key: str  # dotted, e.g. data.batch_size
    type: str  # as a user writes it: int, float, str, bool, 'int or null', 'list of float', mapping, any
    default: str  # as YAML would spell it
    description: str  # the field's declared help (`mmcl.config.schema.described`)


def _type_name(node: ast.expr) -> str:
    """A field's annotation as a user writes its type: ``Optional[int]`` is 'int or null'."""
    text = ast.unparse(node)
    if isinstance(node, ast.Subscript):
        outer, inner = ast.unparse(node.value), node.slice
        if outer == "Optional":
            return f"{_type_name(inner)} or null"
        if outer == "List":
            return f"list of {_type_name(inner)}"
        if outer == "Dict":
            return "mapping"
    return {"Any": "any"}.get(text, text)


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return value if isinstance(value, str) else json.dumps(value)


def describe_keys(schema=TrainConfig, prefix: str = "") -> List[KeyInfo]:
    """Every leaf key of the schema with its type, default and description, in the schema's order."""
    infos = []
    for f in dataclasses.fields(schema):
        sub = _subsections(schema).get(f.name)
        if sub is not None:
            infos += describe_keys(sub, prefix + f.name + ".")
            continue
        # The annotation is its source text (``from __future__ import annotations``), e.g. 'Optional[int]'.
        type_name = _type_name(ast.parse(f.type, mode="eval").body)
        infos.append(KeyInfo(prefix + f.name, type_name, _default_text(f), f.metadata.get("help", "")))
    return infos


@functools.lru_cache(maxsize=None)
def key_infos() -> Dict[str, KeyInfo]:
    return {info.key: info for info in describe_keys()}


def section_keys() -> List[str]:
    return [k for k in valid_keys() if k not in key_infos()]


def keys_help(width: int = 100) -> str:
    """The config keys as ``mmcl train --help`` prints them: key (type, default), then the description."""
    lines = ["config keys (in the --config file, or as key=value after it; --print-config shows the resolved "
             "values):"]
    section = None
    for info in describe_keys():
        top = info.key.split(".")[0]
        if top != section:
            section = top
            lines.append("")
        lines.append(f"  {info.key} ({info.type}, default: {info.default})")
        lines += textwrap.wrap(info.description, width=max(width, 40), initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def _leaf_match(typed: str, leaf: str) -> bool:
    """Whether `typed` names the key `leaf` in other words: the same words in another order or case, or one is the
    initials of the other's words (``learning_rate`` for ``lr``, ``ema`` for ``exponential_moving_average``)."""
    a, b = [w for w in re.split(r"[_\-\s]+", typed.lower()) if w], [w for w in re.split(r"[_\-\s]+", leaf) if w]
    initials = lambda words: "".join(w[0] for w in words) if len(words) > 1 else None  # noqa: E731
    return sorted(a) == sorted(b) or initials(a) == leaf or initials(b) == typed.lower()


def nearest_keys(key: str) -> str:
    keys = valid_keys()
    section, _, typed = key.rpartition(".")
    # the same section's key in other words first (optim.learning_rate -> optim.lr), then the closest spellings
    close = [k for k in keys if k.rpartition(".")[0] == section and _leaf_match(typed, k.rpartition(".")[2])][:3]
    close = close or difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:  # match on the last component, e.g. 'batchsize' -> data.batch_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.7)][:3]
    return ("; did you mean " + " or ".join(close) + "?") if close else ""


def term_keys() -> Dict[str, str]:
    """Each loss term (`LOSS_TERMS`, the objective's table's names) -> the key of its weight: ``loss.<term>``, or
    ``loss.<term>.weight``
    for a term with its own section of parameters (``loss.mochi``)."""

    sections = _subsections(LossConfig)
    return {name: f"loss.{name}.weight" if name in sections else f"loss.{name}" for name in LOSS_TERMS}


def get(cfg, key: str):
    """The value of dotted `key` in `cfg`, e.g. get(cfg, "data.batch_size")."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node

