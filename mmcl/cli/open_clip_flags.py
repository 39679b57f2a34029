"""open_clip_train's command-line flags (3.3 and open_clip main) and what each is in mmcl: the one table
(mmcl/cli/open_clip_flag_table.py, `FLAGS`) that ``mmcl train`` (which answers such flags with their mmcl keys),
``mmcl from-open-clip`` (which writes them as a config file) and docs/migration.md read, and the reading of it here.

A flag's mapping can depend on the others given (`in_context`): AdamW's --beta1/--beta2/--eps go to
``optim.kwargs`` under another optimiser, --momentum only under a timm one, --epochs-cooldown becomes a share of
--epochs, --json-text-key-probs is padded to its keys, and a flag whose `Flag.unless` is given sets nothing.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
from typing import Dict, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from ..config import OptimConfig, load_config, parse_overrides
from ..data.sources import TABLE_EXTS
from ..errors import ConfigError, MmclError
from ..training.plan import run_length
from .open_clip_flag_table import DEFAULTS, FLAGS, NAFLEX_DEFAULTS, Flag

__all__ = ["DEFAULTS", "FLAGS", "Flag", "explain", "in_context", "is_command", "is_table", "overrides_for", "parse",
           "translate", "with_defaults", "write_config"]

_COMMANDS = ("mmcl ", "accelerate ")
_PREFIXED = re.compile(r"\{;([^}]*)\}")  # {;} and {;PREFIX}: the value split at ';', each item prefixed


def is_command(text: str) -> bool:
    """Whether a mapping is a command to run (``mmcl ...``, ``accelerate launch ...``) rather than overrides."""
    return text.startswith(_COMMANDS)


def globs_regex(patterns: List[str]) -> str:
    """One regular expression that `re.search` finds in a name exactly when one of the glob `patterns` matches the
    whole name (``fnmatch.fnmatchcase``, as open_clip_train matches its --wd-exclude patterns)."""
    return "^(?:" + "|".join(_glob_regex(p) for p in patterns) + ")"


def _glob_regex(pattern: str) -> str:
    """`fnmatch.translate` without the atomic groups Python 3.11's writes (a config written there loads on 3.10
    too): '*' and '?' as in fnmatch, every other character literal; a pattern with a [set] is fnmatch's own."""
    if "[" in pattern:
        return fnmatch.translate(pattern)
    return "(?s:" + "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r")\Z"


def _choose(to: Dict[str, Optional[str]], value: str) -> Tuple[Optional[str], str]:
    """The entry of a value-keyed mapping for `value` (exact keys first, then glob keys in order) and what the
    key's '*' matched."""
    if value in to:
        return to[value], value
    for key, entry in to.items():
        if "*" in key and fnmatch.fnmatchcase(value, key):
            head, _, tail = key.partition("*")
            return entry, value[len(head):len(value) - len(tail)]
    return None, value


def _yaml_list(items: List[str]) -> str:
    return "[" + ", ".join(items) + "]"


def overrides_for(flag: str, value) -> Optional[List[str]]:
    """What `flag` given `value` (a string, a list for several values, True for a switch) is in mmcl on its own:
    overrides, or one command; [] for nothing to set; None for no mapping (the flag's note says why)."""
    to, star = FLAGS[flag].to, ""
    if isinstance(to, dict):
        to, star = _choose(to, str(value))
    if to is None:
        return None
    if "{k}" in to:
        if not all("=" in v for v in value):
            raise ConfigError(f"open_clip_train's {flag} takes KEY=VALUE items (got {' '.join(value)})")
        return [to.format(k=k, v=json.dumps(_literal(v))) for k, v in (v.split("=", 1) for v in value)]
    if "{re}" in to:
        return [to.replace("{re}", json.dumps(globs_regex(value)))] if value else []
    listed = _yaml_list(value) if isinstance(value, list) else f"[{value}]"
    if isinstance(value, list):
        value = value[0] if len(value) == 1 else _yaml_list(value)
    value = str(value)
    parts = [to] if is_command(to) else to.split()
    return [_PREFIXED.sub(lambda m: _yaml_list([m.group(1) + v for v in value.split(";") if v]), t)
            .replace("{,}", _yaml_list([v for v in value.split(",") if v]))
            .replace("{::}", _yaml_list(value.split("::"))).replace("{*}", star).replace("{[]}", listed)
            .replace("{}", value) for t in parts]


def _optimizer(names: Dict[str, object]) -> str:
    """The ``optim.name`` that the --opt given (adamw without one) maps to."""
    mapped = overrides_for("--opt", names["--opt"]) if "--opt" in names else None
    for item in mapped or []:
        if item.startswith("optim.name="):
            return item.split("=", 1)[1]
    return "adamw"


def _number(flag: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"open_clip_train's {flag} takes a number (got {value})") from None


def in_context(flag: str, value, names: Dict[str, object]) -> Optional[List[str]]:
    """`overrides_for` (`flag`, `value`) as the other flags given (`names`: flag -> value) change it."""
    if FLAGS[flag].unless in names:
        return []
    to = overrides_for(flag, value)
    if to is None:
        return None
    optimizer = _optimizer(names)
    if flag == "--momentum" and not str(names.get("--opt", "")).startswith("timm/"):
        return []  # open_clip_train passes it to timm's optimisers only
    if flag in ("--beta1", "--beta2") and optimizer != "adamw":
        if "--beta1" not in names or "--beta2" not in names:
            raise ConfigError(f"open_clip_train's --opt {names['--opt']} takes --beta1 and --beta2 together "
                              f"(got {flag} alone)")
        return [f"optim.kwargs.betas=[{names['--beta1']}, {names['--beta2']}]"]
    if flag == "--eps" and optimizer != "adamw":
        return [f"optim.kwargs.eps={value}"]
    if flag == "--json-text-key-probs" and "--json-text-key" in names:
        keys = [k for k in str(names["--json-text-key"]).split(";") if k]
        return [f"data.caption_key_weights={_yaml_list(list(value) + ['0'] * (len(keys) - len(value)))}"]
    if flag == "--epochs-cooldown":
        epochs = _number("--epochs", names.get("--epochs", DEFAULTS["--epochs"]))
        return [f"optim.cooldown_fraction={_number(flag, value) / epochs!r}"]
    if flag == "--lr-cooldown-end" and names.get("--lr-scheduler", "cosine") != "const-cooldown":
        return []  # open_clip_train's cosine and const schedules end where they end, whatever it says
    if flag == "--model" and str(value).startswith("coca") and "--coca-caption-loss-weight" not in names:
        return to + ["loss.caption=2.0"]  # open_clip_train's CoCaLoss weighs the caption term 2.0 by default
    if flag == "--epochs" and "--use-naflex" in names:
        return None  # NaFlex batches hold varying numbers of pairs: mmcl counts such runs in steps
    return to


def _literal(text: str):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # as open_clip's --aug-cfg: a string
    return list(value) if isinstance(value, tuple) else value


def parse(argv: List[str]) -> Tuple[List[Tuple[str, object]], List[str]]:
    """(open_clip flags given, each with its value) and the other arguments, from a command line. ``--flag=value``
    and ``--flag value`` are both read, as argparse reads them."""
    given, rest, i = [], [], 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        flag = FLAGS.get(name) if name.startswith("--") else None
        i += 1
        if flag is None:
            rest.append(argv[i - 1])
            continue
        if flag.nargs == 0:
            given.append((name, True))
            continue
        values = [inline] if eq else []
        while i < len(argv) and (flag.nargs != 1 or not values) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if not values and flag.nargs != "*":
            raise ConfigError(f"open_clip_train's {name} needs a value")
        given.append((name, values if flag.nargs in ("+", "*") else values[0]))
    return given, rest


def _shown(flag: str, value) -> str:
    return flag if value is True else f"{flag} {' '.join(value) if isinstance(value, list) else value}"


def translate(given: List[Tuple[str, object]]) -> Tuple[List[str], List[str]]:
    """(mmcl overrides, one line per flag that maps to none: a command to run, or a note) for flags `parse` read."""
    names = dict(given)
    logs = str(names.get("--logs", "./logs")).rstrip("/")
    overrides, left = [], []
    for flag, value in given:
        to = in_context(flag, value, names)
        if flag == "--logs" and "--name" in names:
            continue  # --name's run folder holds it
        if to is None or to[:1] and is_command(to[0]):
            left.append(f"{_shown(flag, value)}: {to[0] if to else FLAGS[flag].note}")
        else:
            overrides += [t.replace("{logs}", logs) for t in to if t.replace("{logs}", logs) not in overrides]
    return overrides, left


def explain(argv: List[str]) -> Optional[str]:
    """One line naming the mmcl key each open_clip_train flag of `argv` maps to; None when `argv` has none."""
    given, _ = parse(argv)
    if not given:
        return None
    names, parts = dict(given), []
    for flag, value in given:
        to = in_context(flag, value, names)
        hint = (f" (a table: make shards first with mmcl shards --input {value} --out DIR, then data.train=DIR)"
                if flag == "--train-data" and is_table(str(value)) else "")
        what = FLAGS[flag].note if to is None else " ".join(to).replace("{logs}", "LOGS") or "nothing to set"
        if FLAGS[flag].unless in names:
            what += f" ({FLAGS[flag].unless} sets it)"
        parts.append(f"{_shown(flag, value)} -> {what}{hint}")
    return ("open_clip_train flags: " + ", ".join(parts) + "; give mmcl keys as key=value, or write a config "
            "with mmcl from-open-clip --out config.yaml -- FLAGS")


def is_table(path: str) -> bool:
    """Whether `path` names a table that `mmcl shards` reads (CSV, TSV, JSONL, parquet), not shards."""

    return path.lower().endswith(TABLE_EXTS)


def with_defaults(given: List[Tuple[str, object]]) -> List[Tuple[str, object]]:
    """`given` with open_clip_train's defaults for the flags not given, first, so that the run trains as
    open_clip_train's would: `DEFAULTS` (with --use-naflex: `NAFLEX_DEFAULTS`, and no --epochs, as mmcl counts
    NaFlex runs in steps), and its Adam betas and epsilon for the model (`get_default_params`) where they differ
    from mmcl's AdamW defaults, or all three for nadamw (they go to its constructor)."""
    names = dict(given)
    defaults = dict(DEFAULTS)
    if "--use-naflex" in names:
        defaults.update(NAFLEX_DEFAULTS)
        del defaults["--epochs"]
    added = [(f, v) for f, v in defaults.items() if f not in names]
    model, opt = str(names.get("--model", DEFAULTS["--model"])).lower(), str(names.get("--opt", "adamw"))
    adam = ({"--beta1": "0.9", "--beta2": "0.98", "--eps": "1e-6"} if "vit" in model
            else {"--beta1": "0.9", "--beta2": "0.999", "--eps": "1e-8"})
    if opt == "adamw":

        mine = OptimConfig()  # mmcl's AdamW defaults: open_clip's for ViT models
        adam = {f: v for f, v in adam.items() if float(v) != getattr(mine, f[2:])}
    if "timm" not in opt:
        added += [(f, v) for f, v in adam.items() if f not in names]
    return added + list(given)


def _check_warmup(cfg, given: bool) -> None:
    """Refuse a warm-up longer than the whole run on one process (where the run's length is known: on more
    processes it is shorter still): open_clip_train would train it all in warm-up, its rate never at its peak."""
    if cfg.train.epochs is None:  # no --epochs (a NaFlex run counts steps): the length is the run's to give
        return
    try:
        steps, _ = run_length(cfg.data, cfg.train, 1)
    except MmclError:  # the data's size is not known here: the run's start line says it then
        return
    if cfg.optim.warmup_steps <= steps:
        return
    what = "--warmup" if given else "open_clip_train's default --warmup"
    raise ConfigError(f"{what} {cfg.optim.warmup_steps} is longer than the whole run ({steps} steps on one process, "
                      f"fewer on more): every step would be warm-up, the rate never at its peak --lr; give --warmup "
                      f"below {steps}")


def write_config(argv: List[str], out: str) -> Tuple[List[str], List[str], List[str]]:
    """Write the mmcl config file `out` (a new file) for an open_clip_train command line, checked as `load_config`
    checks a config first. Returns (overrides written, one line per flag that maps to no config key, open_clip_train's
    defaults written for flags not given)."""


    given, unknown = parse(argv)
    if unknown:
        raise ConfigError(f"not open_clip_train flags: {' '.join(unknown)} (open_clip_train's flags, 3.3's and "
                          f"main's, are listed in docs/migration.md)")
    full = with_defaults(given)
    overrides, left = translate(full)
    _check_warmup(load_config(None, overrides), "--warmup" in dict(given))
    tree = OmegaConf.create({})
    for key, value in parse_overrides(overrides):
        OmegaConf.update(tree, key, value, force_add=True)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(yaml.safe_dump(OmegaConf.to_container(tree), sort_keys=False))
    except FileExistsError:
        raise ConfigError(f"{out} already exists: choose another --out (it is not overwritten)") from None
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {err.strerror or err}") from None
    return overrides, left, [_shown(f, v) for f, v in full[:len(full) - len(given)]]
