"""Write the reference pages from the code: docs/reference/config.md (the config schema that ``mmcl train --help``
lists), docs/reference/cli.md (the ``mmcl`` parser) and docs/migration.md (the open_clip_train flags' table).

    python docs/gen_reference.py

The output depends only on the code; tests/test_docs_reference.py and tests/cli/test_open_clip_flags.py check
that the committed pages are what this writes.
"""

import argparse
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

from mmcl.cli import build_parser  # noqa: E402
from mmcl.cli.open_clip_flag_table import NOT_SUPPORTED_FROM_MAIN, VERSIONS  # noqa: E402
from mmcl.cli.open_clip_flags import DEFAULTS, FLAGS  # noqa: E402
from mmcl.config import describe_keys  # noqa: E402

NOTICE = "<!-- Written by docs/gen_reference.py from the code: edit the code, then run the script. -->\n"


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def config_page() -> str:
    lines = [NOTICE, "# Config keys", "",
             "Every key of `mmcl train`'s config (`mmcl train --help` prints the same list): in the `--config` YAML "
             "file, or as `key=value` after it. `--print-config` shows the resolved values.", ""]
    section = None
    for info in describe_keys():
        top = info.key.split(".")[0]
        if top != section:
            section = top
            lines += ["", f"## {top}", "", "| key | type | default | description |", "|---|---|---|---|"]
        lines.append(f"| `{info.key}` | {_cell(info.type)} | `{_cell(info.default)}` | {_cell(info.description)} |")
    return "\n".join(lines) + "\n"


def _option_row(action: argparse.Action) -> str:
    name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.option_strings and action.nargs != 0:
        name += f" {action.metavar or action.dest.upper()}"
    if action.nargs in ("+", "*", argparse.REMAINDER):
        name += " ..."
    required = action.required and action.nargs not in ("*", "?", argparse.REMAINDER)
    default = "required" if required else "" if action.default in (None, False, argparse.SUPPRESS, []) \
        else f"`{action.default}`"
    return f"| {name} | {default} | {_cell(action.help or '')} |"


def cli_page() -> str:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in commands._choices_actions}
    lines = [NOTICE, "# Command line", "", "`mmcl COMMAND [options]` (also `python -m mmcl`). An error in what is "
             "given ends in one line, `mmcl: error: ...`, and exit code 2.", ""]
    for name, sub in commands.choices.items():
        lines += ["", f"## mmcl {name}", "", _cell(helps[name]), "", "| option | default | description |",
                  "|---|---|---|"]
        lines += [_option_row(a) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        if name == "train":
            lines += ["", "The config keys are listed in [Config keys](config.md)."]
    return "\n".join(lines) + "\n"


def _mapping(flag: str) -> str:
    to = FLAGS[flag].to
    if isinstance(to, dict):
        return "<br>".join(f"`{v}`: " + (f"`{t}`" if t else "nothing to set" if t == "" else "not supported")
                           for v, t in to.items())
    if to is None:
        return "not supported"
    return f"`{to}`" if to else "nothing to set"


def migration_page() -> str:
    mapped = sum(FLAGS[f].to is not None for f in FLAGS)
    main_only = sum(FLAGS[f].version == "main" for f in FLAGS)
    lines = [NOTICE, "# From open_clip_train", "",
             f"Each flag of open_clip_train's `python -m open_clip_train.main`, as of open_clip 3.3 and of open_clip's "
             f"main branch (4.2.0.dev0, June 2026; {main_only} flags are new there), and what it is in mmcl: "
             f"{mapped} of the {len(FLAGS)} flags map to a config key, a command or nothing to set; "
             f"{len(FLAGS) - mapped} have no automatic mapping (the note gives the reason and the way around). "
             "`{}` stands for the flag's value, `{[]}` for its values as a list; the *open_clip* column names the "
             "version a flag comes from where it is not both.", "",
             "A whole command line becomes a config file in one step, with every flag it could not map listed:", "",
             "```bash", "mmcl from-open-clip --out config.yaml -- --train-data 'shards/{00000..00099}.tar' \\",
             "    --train-num-samples 1000000 --batch-size 256 --epochs 32 --model ViT-B-32 --lr 5e-4 \\",
             "    --logs runs --name from-open-clip", "mmcl train --config config.yaml", "```", "",
             "`mmcl train` given open_clip_train flags answers with the keys they map to. "
             "`mmcl from-open-clip` also writes open_clip_train's defaults for the flags not given where mmcl's "
             "differ (" + ", ".join(f"`{f} {v}`" for f, v in DEFAULTS.items()) + ", and `--beta2 0.999 --eps 1e-8` "
             "for a model without `vit` in its name; with `--use-naflex`, `--naflex-max-tokens-per-batch 16384` "
             "and no `--epochs`). Two settings are not carried over unless given: the precision (open_clip_train's "
             "default is `amp`, fp16 autocast, `amp_bf16` on main; mmcl's `train.precision=auto` follows the launch "
             "file, fp32 without one: give `--precision`) and the run folder (open_clip_train writes under "
             "`--logs ./logs/` in a folder named from the date and settings; give `--logs` and `--name`, or "
             "`train.output_dir` is mmcl's default, `runs/tiny`). A warm-up longer than the whole run (open_clip's "
             "default `--warmup 10000` on a short run, where the run's length is known) is refused in one line.", "",
             "Some flags map according to the others given: under `--opt timm/NAME` or `--opt nadamw`, `--beta1`/"
             "`--beta2` become `optim.kwargs.betas` and `--eps` `optim.kwargs.eps` (mmcl's `optim.beta1`/`beta2`/`eps` "
             "are its AdamW's), and `--opt nadamw` gets open_clip's Adam defaults there; `--momentum` counts only "
             "under `--opt timm/NAME`; `--epochs-cooldown` is divided by `--epochs`; `--json-text-key-probs` is "
             "padded with 0 to its keys; `--text-key` yields to `--json-text-key`, `--use-naflex`'s lengths to "
             "`--naflex-seq-lens` and `--log-every-n-steps` to `--log-metric-every-n-steps`.", "",
             "## open_clip main's features that mmcl does not support", ""]
    lines += [f"- {what}: {why}." for what, why in NOT_SUPPORTED_FROM_MAIN]
    lines += ["", "## The flags", "", "| open_clip_train | open_clip | mmcl | note |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {VERSIONS[FLAGS[f].version] if FLAGS[f].version else ''} | {_mapping(f)} | "
              f"{_cell(FLAGS[f].note)} |" for f in FLAGS]
    return "\n".join(lines) + "\n"


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page, "migration.md": migration_page}


def main() -> None:
    for name, page in PAGES.items():
        (DOCS / name).parent.mkdir(parents=True, exist_ok=True)
        (DOCS / name).write_text(page(), encoding="utf-8")
        print(f"wrote docs/{name}")


if __name__ == "__main__":
    main()
