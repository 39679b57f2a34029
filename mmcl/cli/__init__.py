"""The ``mmcl`` command line (also ``python -m mmcl``). User errors end in one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from ..errors import MmclError, RunStopped, printable

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mmcl/
_SURROGATE = re.compile("[\ud800-\udfff]")  # the undecodable bytes of a name that is not UTF-8


class _WarningLines:
    """A `warnings.showwarning` that prints mmcl's own warnings (those raised in mmcl's modules) as one line
    ``mmcl: warning: ...``, once per message per run, and hands every other warning to the previous handler
    (Python's format), so third-party warnings still show.

    "Once per run" holds across processes too: in a distributed run the processes share torch.distributed's
    key-value store, and the first process to count a message there prints it. (Data workers send their warnings
    to their training process, see `mmcl.data.TrainStream`.)
    """

    def __init__(self, previous):
        self.previous = previous
        self.shown = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR):
            return self.previous(message, category, filename, lineno, file, line)
        text = printable(re.sub(r"\s*\n\s*", " ", str(message).strip()))  # one line; other controls escaped
        if text in self.shown:
            return
        self.shown.add(text)
        if _first_in_run(text):
            print(f"mmcl: warning: {text}", file=file or sys.stderr, flush=True)


def _first_in_run(text: str) -> bool:
    """False when another process of this distributed run has already shown `text`."""
    dist = sys.modules.get("torch.distributed")  # never imports torch for a warning
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return True
        key = "mmcl/warning/" + hashlib.sha1(text.encode()).hexdigest()
        return dist.distributed_c10d._get_default_store().add(key, 1) == 1
    except Exception:  # no shared store (another backend, a torch without it): each process shows its own
        return True


@contextlib.contextmanager
def warning_lines():
    """Show warnings as `_WarningLines` does while the block runs (the command line's format)."""
    previous = warnings.showwarning
    warnings.showwarning = _WarningLines(previous)
    try:
        yield
    finally:
        warnings.showwarning = previous


def _write_json(obj, path: Optional[str]) -> None:
    from ..errors import ConfigError
    from ..storage.fsutil import atomic_write_text, make_folder, os_error_text, output_dir

    text = json.dumps(obj, indent=2)
    if path:  # a new file renamed into place: never written through a link or another hard link of the file
        target = output_dir(path)
        try:
            make_folder(target.parent)
            atomic_write_text(target, text + "\n")
        except OSError as err:
            raise ConfigError(f"cannot write {path}: {os_error_text(err)}") from None
    print(text)


def _device(name: Optional[str]):
    from ..evaluation.evaluate import device_for

    return device_for(name)


def _config_file(arg: str) -> str:
    """`mmcl train`'s first argument without '=': the config when it names a YAML file, else a one-line error (a data
    file there would be read as the config)."""
    from ..errors import ConfigError
    from .open_clip_flags import is_table

    if arg.lower().endswith((".yaml", ".yml")):
        return arg
    data = (f"a table becomes shards with mmcl shards --input {arg} --out DIR, then data.train=DIR" if is_table(arg)
            else f"data as data.train={arg}")
    raise ConfigError(f"'{arg}' is not a config file (.yaml or .yml) nor key=value: give the config as --config "
                      f"FILE, and {data}")


def cmd_train(args) -> int:
    from ..config import load_config, to_yaml

    config, overrides = args.config, list(args.overrides)
    if config is None and overrides and "=" not in overrides[0]:
        config, overrides = _config_file(overrides[0]), overrides[1:]  # `mmcl train CONFIG key=value ...`
    cfg = load_config(config, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from ..training.loop import train

    train(cfg)
    return 0


def cmd_from_open_clip(args) -> int:
    from .open_clip_flags import write_config

    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    overrides, left, defaults = write_config(flags, args.out)
    print(f"mmcl: wrote {args.out} ({len(overrides)} keys); train with: mmcl train --config {args.out}")
    if defaults:
        print(f"mmcl: with open_clip_train's defaults for flags not given: {', '.join(defaults)}")
    if left:
        print("mmcl: not mapped (docs/migration.md gives the way around):")
        print("\n".join(f"  {line}" for line in left))
    return 0


def _open_clip_train_args(argv: List[str]) -> Optional[argparse.Namespace]:
    """For `mmcl train` given open_clip_train's flags: a command that answers, as an error, with the mmcl keys
    they map to (instead of argparse's "unrecognized arguments")."""
    from .open_clip_flags import FLAGS, explain

    if argv[:1] != ["train"] or not any(a.partition("=")[0] in FLAGS for a in argv[1:]):
        return None

    def answer(_args):
        from ..errors import ConfigError

        raise ConfigError(explain(argv[1:]))
    return argparse.Namespace(func=answer)


def cmd_launch(args) -> int:
    from ..run.signals import launch

    return launch(args.argv)


# The configs and launch files shipped in the package (links to the checkout's configs/ and launch/ in an editable
# install, copies in a wheel).
_STARTER = Path(_PACKAGE_DIR) / "training" / "starter"


def cmd_init(args) -> int:
    """Copy the shipped configs/ and launch/ into DIR. Only new folders are written: no file of the user's is
    overwritten."""

    from ..errors import StorageError

    out = Path(args.dir)
    targets = [(_STARTER / name, out / name) for name in ("configs", "launch")]
    taken = [str(dst) for _, dst in targets if os.path.lexists(dst)]
    if taken:
        raise StorageError(f"{' and '.join(taken)} already {'exist' if len(taken) > 1 else 'exists'}: mmcl init "
                           f"writes only new folders (choose another DIR, or move them away)")
    missing = [str(src) for src, _ in targets if not src.is_dir()]
    if missing:
        raise StorageError(f"this mmcl installation lacks its shipped files ({', '.join(missing)}); reinstall it")
    try:
        for src, dst in targets:
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            for script in dst.glob("*.sh"):
                script.chmod(script.stat().st_mode | 0o111)  # a wheel may not keep the executable bit
    except OSError as err:
        raise StorageError(f"cannot write {out}: {err.strerror or err}") from None
    print(f"mmcl: wrote {out / 'configs'} and {out / 'launch'}; next:\n"
          f"  mmcl demo-data --out runs/demo-data\n"
          f"  mmcl train --config {out / 'configs' / 'tiny.yaml'} 'data.train=runs/demo-data/train/shard-*.tar'")
    return 0


def cmd_demo_data(args) -> int:
    from ..shards.demo import make_demo_data

    kwargs = {"n_train": args.n_train} if args.n_train is not None else {}
    paths = make_demo_data(args.out, seed=args.seed, **kwargs)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def cmd_shards(args) -> int:
    from ..shards.writer import shards_from_input

    shards_from_input(args.input, args.out, shard_size=args.shard_size, caption_template=args.caption_template,
                      sep=args.sep, image_col=args.image_col, caption_col=args.caption_col,
                      negatives_col=args.negatives_col)
    return 0


def cmd_reinforce(args) -> int:
    from ..curation.reinforce import reinforce

    keys = _sample_keys(args) if (args.image_key or args.caption_key) else None
    summary = reinforce(args.teacher, args.data, args.out, batch_size=args.batch_size, device=args.device,
                        keys=keys, progress=not args.no_progress, captions_from=args.captions_from,
                        max_length=args.max_length, beams=args.beams)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_negatives(args) -> int:
    from ..shards.negatives import write_negative_shards

    keys = _sample_keys(args) if (args.image_key or args.caption_key) else None
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    summary = write_negative_shards(args.input, args.out, rules=rules, seed=args.seed, keys=keys,
                                    progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_curate(args) -> int:
    from ..config import is_main_process
    from ..curation import Rules, curate

    rules = Rules(clip_score_min=args.clip_score_min, clip_score_top=args.clip_score_top, dedup=args.dedup,
                  decontaminate=args.decontaminate, decontaminate_threshold=args.decontaminate_threshold,
                  min_caption_len=args.min_caption_len, max_caption_len=args.max_caption_len,
                  language=tuple(args.language) if args.language else None)
    keys = _sample_keys(args) if (args.image_key or args.caption_key) else None
    summary = curate(args.model, args.data, args.out, rules, batch_size=args.batch_size, device=args.device,
                     keys=keys, progress=not args.no_progress)
    if is_main_process():
        print(json.dumps(summary, indent=2))
    return 0


def _load(args):
    from ..storage.weights import load

    return load(args.model)


def _sample_keys(args):
    """--image-key / --caption-key as a `mmcl.data.SampleKeys` (None for the default members)."""
    from ..data import sample_keys

    return sample_keys(image_key=args.image_key, caption_key=args.caption_key or "txt")


def cmd_zeroshot(args) -> int:
    from ..evaluation.evaluate import zeroshot

    model, preprocess, tokenizer = _load(args)
    res = zeroshot(model, preprocess, tokenizer, args.data, classnames=args.classnames, templates=args.templates,
                   batch_size=args.batch_size, workers=args.workers, device=_device(args.device),
                   model_name=str(args.model), keys=_sample_keys(args))
    _write_json(res, args.out)
    return 0


def cmd_retrieval(args) -> int:
    from ..evaluation.evaluate import retrieval

    model, preprocess, tokenizer = _load(args)
    res = retrieval(model, preprocess, tokenizer, args.data, batch_size=args.batch_size, workers=args.workers,
                    device=_device(args.device), model_name=str(args.model), keys=_sample_keys(args))
    _write_json(res, args.out)
    return 0


def cmd_linear_probe(args) -> int:
    from ..evaluation.evaluate import linear_probe

    model, preprocess, tokenizer = _load(args)
    res = linear_probe(model, preprocess, args.train, args.test, batch_size=args.batch_size, workers=args.workers,
                       device=_device(args.device), model_name=str(args.model))
    _write_json(res, args.out)
    return 0


def cmd_caption(args) -> int:
    from ..evaluation.captioning import caption_images

    model, preprocess, tokenizer = _load(args)
    keys = _sample_keys(args) if args.image_key else None
    summary = caption_images(model, preprocess, tokenizer, args.images, args.out, max_length=args.max_length,
                             beams=args.beams, batch_size=args.batch_size, workers=args.workers,
                             device=_device(args.device), progress=not args.no_progress, keys=keys,
                             model_name=str(args.model))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_interpolate(args) -> int:
    from ..evaluation.wise_ft import RESULTS_FILE, wise_ft

    res = wise_ft(args.init, args.finetuned, args.alpha, args.out, data=args.data, classnames=args.classnames,
                  templates=args.templates, batch_size=args.batch_size, workers=args.workers,
                  device=_device(args.device))
    for entry in res["results"]:
        acc = f" zero-shot acc1 {entry['metrics']['acc1']:.4f}" if "metrics" in entry else ""
        print(printable(f"mmcl: alpha {entry['alpha']:g}: {entry['model']}{acc}"))
    print(f"mmcl: results in {Path(args.out) / RESULTS_FILE}")
    return 0


def cmd_export(args) -> int:
    from ..errors import ConfigError
    from ..storage.export import export, export_adapters

    if args.adapters_only == bool(args.format):
        raise ConfigError("mmcl export takes one of --format and --adapters-only (a LoRA run's adapters alone)")
    if args.adapters_only:
        print(f"mmcl: exported the LoRA adapters (peft's format) to {export_adapters(args.model, args.out)}")
        return 0
    out = export(args.model, args.format, args.out)
    print(f"mmcl: exported {args.format} to {out}")
    return 0


def cmd_index(args) -> int:
    from ..evaluation.index import build_index

    build_index(args.model, args.data, args.out, batch_size=args.batch_size, workers=args.workers,
                device=_device(args.device))
    return 0


def cmd_search(args) -> int:
    from ..evaluation.index import search

    hits = search(args.index, query=args.query, image=args.image, k=args.k)
    if args.json:
        print(_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(hits, indent=2, ensure_ascii=False)))
        return 0
    for hit in hits:  # keys, captions and URLs come from the indexed shards: escaped (`printable`)
        source = hit.get("url") or hit.get("__url__", "")
        print(printable(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['key']}  {hit.get('caption', '')!r}  {source}"))
    return 0


def cmd_plot(args) -> int:
    from ..evaluation.plot import plot_run

    for p in plot_run(args.run_dir):
        print(f"mmcl: wrote {p}")
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (unless the text already names it, or there is none to show);
    descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


MODEL_HELP = "run dir, its model/, an export, or a checkpoint (RUN/checkpoints/step-N)"  # every --model


class _Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose epilog may be made only when help is shown (`epilog_fn`): the config keys'
    table reads every field's declared help, which other commands never need."""

    def __init__(self, *args, epilog_fn=None, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.epilog_fn = epilog_fn

    def format_help(self) -> str:
        if self.epilog_fn is not None:
            self.epilog = self.epilog_fn()
        return super().format_help()


_DEVICE_HELP = "torch device, e.g. cuda:1 or cpu (default: cuda if available, else cpu)"


def _config_keys_help() -> str:

    from ..config import keys_help

    return keys_help(width=shutil.get_terminal_size().columns - 2)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="mmcl", description="CLIP-style multimodal contrastive pretraining")
    p.add_argument("--version", action="version", version=f"mmcl {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train_help = "train (single process, or several under `accelerate launch`)"
    t = sub.add_parser("train", help=train_help, description=train_help, epilog_fn=_config_keys_help)
    t.add_argument("--config", "-c", help="YAML config file (default: the built-in defaults listed below)")
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. data.batch_size=32 (a first argument ending in .yaml or .yml is "
                        "the config)")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config (file, then overrides) as YAML and exit without training")
    t.set_defaults(func=cmd_train)

    la = sub.add_parser("launch", help="`accelerate launch` with the same arguments, exiting with the code of its "
                        "training processes (75 preempted, 130 interrupted) instead of a launcher traceback",
                        add_help=False, prefix_chars="\0")
    la.add_argument("argv", nargs=argparse.REMAINDER, help="accelerate launch's arguments, e.g. --config_file "
                    "launch/cpu-2proc.yaml -m mmcl train --config configs/tiny.yaml")
    la.set_defaults(func=cmd_launch)

    n = sub.add_parser("init", help="copy the shipped configs/ and launch/ folders into DIR")
    n.add_argument("dir", metavar="DIR", nargs="?", default=".", help="where configs/ and launch/ are written")
    n.set_defaults(func=cmd_init)

    d = sub.add_parser("demo-data", help="write the embedded synthetic dataset as WebDataset shards")
    d.add_argument("--out", required=True, help="a new or empty output folder, or one this command wrote before")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated images and captions")
    d.add_argument("--n-train", type=int, default=None, help="training pairs (default: the demo's size)")
    d.set_defaults(func=cmd_demo_data)

    s = sub.add_parser("shards", help="write WebDataset shards from images with caption files (img2dataset's "
                                      "files layout), an ImageFolder, or a CSV, TSV, JSONL or parquet table")
    s.add_argument("--input", required=True,
                   help="folder of KEY.jpg + KEY.txt [+ KEY.json], ImageFolder, or table with image|url|filepath and "
                        "caption|title columns (open_clip's CSV layout: tab-separated filepath, title)")
    s.add_argument("--out", required=True, help="a new or empty output folder, or one this command wrote before")
    s.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    s.add_argument("--caption-template", default="a photo of a {}.", help="ImageFolder captions")
    s.add_argument("--sep", default=None,
                   help="a table's field separator, \\t for a tab (open_clip's --csv-separator; default: a tab for "
                        ".tsv, and for a .csv whose header holds one, else a comma)")
    s.add_argument("--image-col", default=None,
                   help="a table's image column (open_clip's --csv-img-key; default: image, url or filepath)")
    s.add_argument("--caption-col", default=None,
                   help="a table's caption column (open_clip's --csv-caption-key; default: caption or title)")
    s.add_argument("--negatives-col", default=None,
                   help="a table's column of negative captions (a list, a JSON list, or one a line), written as each "
                        "sample's JSON negatives for data.negatives")
    s.set_defaults(func=cmd_shards)

    rf = sub.add_parser("reinforce", help="copy shards with a teacher's image and caption embeddings stored in "
                                          "each sample, for distill.from_shards, or with a generated caption "
                                          "(KEY.gen.txt) in each")
    rf.add_argument("--teacher", default=None, help="run dir, its model/, an export, or a Hugging Face CLIP dir")
    rf.add_argument("--captions-from", default=None, metavar="MODEL",
                    help="instead of --teacher: a model with a captioning decoder (a CoCa run or export) whose "
                         "caption of each image is stored as KEY.gen.txt (train on it with "
                         "data.caption_key=[txt, gen.txt])")
    rf.add_argument("--max-length", type=int, default=30, help="with --captions-from: most tokens per caption")
    rf.add_argument("--beams", type=int, default=1, help="with --captions-from: 1 greedy, K > 1 beam search")
    rf.add_argument("--data", required=True, help="input shards (brace-expanded spec, a directory or a list)")
    rf.add_argument("--out", required=True, help="output directory (one shard per input shard, same names)")
    rf.add_argument("--batch-size", type=int, default=64, help="samples per teacher batch")
    rf.add_argument("--device", default=None, help=_DEVICE_HELP)
    rf.add_argument("--image-key", default=None, help="image member (default: first of jpg, jpeg, png, webp)")
    rf.add_argument("--caption-key", nargs="+", default=None,
                    help="caption member(s), as data.caption_key: every caption is embedded")
    rf.add_argument("--no-progress", action="store_true", help="no progress bar")
    rf.set_defaults(func=cmd_reinforce)

    ng = sub.add_parser("negatives", help="copy shards with negative captions made by rule (attributes or objects "
                                          "swapped, or words shuffled) in each sample's neg.txt, for data.negatives")
    ng.add_argument("--input", required=True, help="input shards (brace-expanded spec, a directory or a list); "
                                                   "never changed")
    ng.add_argument("--out", required=True, help="output directory (one shard per input shard, same names)")
    ng.add_argument("--rules", default="attributes,objects",
                    help="comma-separated rules, each making at most one negative per caption: attributes (swap two "
                         "attribute words between objects), objects (swap two objects), order (shuffle the words; "
                         "only when named: on short captions it cost zero-shot, BENCHMARKS.md)")
    ng.add_argument("--seed", type=int, default=0, help="seed of the rules' random choices")
    ng.add_argument("--image-key", default=None, help="image member (default: first of jpg, jpeg, png, webp)")
    ng.add_argument("--caption-key", nargs="+", default=None,
                    help="caption member(s), as data.caption_key: every caption gets its negatives")
    ng.add_argument("--no-progress", action="store_true", help="no progress bar")
    ng.set_defaults(func=cmd_negatives)

    cu = sub.add_parser("curate", help="filter, deduplicate and decontaminate shards with a CLIP model "
                                       "(filtered shards, report.json/.png, dropped.jsonl)")
    cu.add_argument("--model", required=True, help="run dir, its model/, an export, or a Hugging Face CLIP dir")
    cu.add_argument("--data", required=True, help="input shards (brace-expanded spec, a directory or a list); "
                                                  "never changed")
    cu.add_argument("--out", required=True, help="output directory (one shard per input shard, same names)")
    cu.add_argument("--clip-score-min", type=float, default=None, metavar="VALUE",
                    help="keep image-caption cosine >= VALUE")
    cu.add_argument("--clip-score-top", type=float, default=None, metavar="FRACTION",
                    help="keep exactly this fraction of the samples, those of highest cosine")
    cu.add_argument("--dedup", type=float, default=None, metavar="THRESHOLD",
                    help="drop a sample whose image cosine with an earlier kept one is >= THRESHOLD")
    cu.add_argument("--decontaminate", default=None, metavar="DATA",
                    help="evaluation set (ImageFolder or shards): drop samples whose image matches one of its images")
    cu.add_argument("--decontaminate-threshold", type=float, default=0.95, metavar="T",
                    help="image cosine with an evaluation image at which a sample is dropped")
    cu.add_argument("--min-caption-len", type=int, default=None, metavar="N", help="fewest caption characters kept")
    cu.add_argument("--max-caption-len", type=int, default=None, metavar="N", help="most caption characters kept")
    cu.add_argument("--language", nargs="+", default=None, metavar="CODE",
                    help="keep captions in these languages (ISO 639-1, e.g. en de; needs py3langid)")
    cu.add_argument("--batch-size", type=int, default=64, help="samples per model batch")
    cu.add_argument("--device", default=None, help=_DEVICE_HELP)
    cu.add_argument("--image-key", default=None, help="image member (default: first of jpg, jpeg, png, webp)")
    cu.add_argument("--caption-key", nargs="+", default=None,
                    help="caption member(s), as data.caption_key: the first caption is scored")
    cu.add_argument("--no-progress", action="store_true", help="no progress bar")
    cu.set_defaults(func=cmd_curate)

    def eval_args(x, data_help):
        x.add_argument("--model", required=True, help=MODEL_HELP)
        x.add_argument("--data", required=True, help=data_help)
        x.add_argument("--out", help="results JSON (default: printed only)")
        x.add_argument("--batch-size", type=int, default=128, help="images per batch")
        x.add_argument("--workers", type=int, default=0, help="data-loading worker processes (0: in this process)")
        x.add_argument("--device", default=None, help=_DEVICE_HELP)
        x.add_argument("--image-key", default=None, help="image member of shards (default: first of jpg, jpeg, png, "
                                                          "webp), as data.image_key")
        x.add_argument("--caption-key", nargs="+", default=None,
                       help="caption member(s) of shards, e.g. txt, json:caption, json:captions (a list); all "
                            "captions are scored (as data.caption_key)")

    z = sub.add_parser("zeroshot", help="zero-shot classification")
    eval_args(z, "ImageFolder or labelled shards (.cls)")
    z.add_argument("--classnames", default=None, help="file, one class name per line in label order")
    z.add_argument("--templates", default="auto",
                   help="file with '{}' templates, one template such as 'a photo of a {}.', or "
                        "openai_imagenet_template | simple_imagenet_template "
                        "(default: auto, templates.txt next to the data, else openai_imagenet_template)")
    z.set_defaults(func=cmd_zeroshot)

    r = sub.add_parser("retrieval", help="image<->text retrieval recall@1/5/10")
    eval_args(r, "shards with captions")
    r.set_defaults(func=cmd_retrieval)

    lp = sub.add_parser("linear-probe", help="logistic regression on frozen image features")
    lp.add_argument("--model", required=True, help=MODEL_HELP)
    lp.add_argument("--train", required=True, help="labelled training set: ImageFolder or shards with .cls")
    lp.add_argument("--test", required=True, help="labelled test set: ImageFolder or shards with .cls")
    lp.add_argument("--out", help="results JSON (default: printed only)")
    lp.add_argument("--batch-size", type=int, default=128, help="images per feature batch")
    lp.add_argument("--workers", type=int, default=0, help="data-loading worker processes (0: in this process)")
    lp.add_argument("--device", default=None, help=_DEVICE_HELP)
    lp.set_defaults(func=cmd_linear_probe)

    c = sub.add_parser("caption", help="one generated caption per image (a model with a captioning decoder: "
                                       "model.name coca_*, or an open_clip CoCa export), as JSONL or CSV")
    c.add_argument("--model", required=True, help=MODEL_HELP)
    c.add_argument("--images", required=True, help="a folder of image files (any depth) or shards (brace-expanded "
                                                    "spec, a folder of .tar or a list)")
    c.add_argument("--out", required=True, help="a new .jsonl or .csv file: one row per image, its key and caption")
    c.add_argument("--max-length", type=int, default=30, help="most tokens per caption, the end token included "
                                                              "(at most the model's text context)")
    c.add_argument("--beams", type=int, default=1, help="1: greedy decoding; K > 1: beam search over K prefixes")
    c.add_argument("--batch-size", type=int, default=32, help="images per batch")
    c.add_argument("--workers", type=int, default=0, help="data-loading worker processes (0: in this process)")
    c.add_argument("--device", default=None, help=_DEVICE_HELP)
    c.add_argument("--image-key", default=None, help="image member of shards (default: first of jpg, jpeg, png, "
                                                      "webp), as data.image_key")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_caption)

    w = sub.add_parser("interpolate", help="WiSE-FT: weights (1-a)*FROM + a*TO for each alpha a, each written as "
                                           "a model (and evaluated zero-shot with --data)")
    w.add_argument("--from", dest="init", default=None,
                   help="the initial model (run dir, its model/, an export, a checkpoint); default: the weights "
                        "the run --to started from (its config.yaml's model.pretrained or model.init_from)")
    w.add_argument("--to", dest="finetuned", required=True, help="the fine-tuned model (a run dir, its model/, an "
                                                                 "export), of the same architecture")
    w.add_argument("--alpha", type=float, nargs="+", required=True, help="one or more alphas in [0, 1]")
    w.add_argument("--out", required=True, help="output folder: alpha_<a>/ per alpha and wise_ft.json")
    w.add_argument("--data", default=None, help="ImageFolder or labelled shards to evaluate each alpha zero-shot")
    w.add_argument("--classnames", default=None, help="file, one class name per line in label order")
    w.add_argument("--templates", default="auto", help="as mmcl zeroshot --templates")
    w.add_argument("--batch-size", type=int, default=128, help="images per batch")
    w.add_argument("--workers", type=int, default=0, help="data-loading worker processes (0: in this process)")
    w.add_argument("--device", default=None, help=_DEVICE_HELP)
    w.set_defaults(func=cmd_interpolate)

    e = sub.add_parser("export", help="export the encoders")
    e.add_argument("--model", required=True, help=MODEL_HELP)
    e.add_argument("--format", choices=["open_clip", "hf", "onnx", "safetensors"],
                   help="open_clip local-dir, Hugging Face CLIPModel directory, ONNX encoders, or safetensors weights")
    e.add_argument("--adapters-only", action="store_true",
                   help="instead of --format: a LoRA run's adapters alone, in peft's format (from its newest "
                        "checkpoint)")
    e.add_argument("--out", required=True, help="output folder")
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("index", help="build an image embedding index")
    i.add_argument("--model", required=True, help=MODEL_HELP)
    i.add_argument("--data", required=True, help="shards whose images are indexed")
    i.add_argument("--out", required=True, help="index folder (for mmcl search --index)")
    i.add_argument("--batch-size", type=int, default=128, help="images per batch")
    i.add_argument("--workers", type=int, default=0, help="data-loading worker processes (0: in this process)")
    i.add_argument("--device", default=None, help=_DEVICE_HELP)
    i.set_defaults(func=cmd_index)

    q = sub.add_parser("search", help="query an index with text or an image")
    q.add_argument("--index", required=True, help="folder written by mmcl index")
    q.add_argument("query", nargs="?", default=None, help="text query")
    q.add_argument("--image", default=None, help="an image file as the query, instead of a text")
    q.add_argument("-k", type=int, default=10, help="number of hits")
    q.add_argument("--json", action="store_true",
                   help="print the hits as one JSON array (rank, score, key, caption, __url__, url, label)")
    q.set_defaults(func=cmd_search)

    pl = sub.add_parser("plot", help="plot a run: loss curves, lr/logit scale, alignment-uniformity plane")
    pl.add_argument("run_dir", help="a run folder (train.output_dir)")
    pl.set_defaults(func=cmd_plot)

    oc = sub.add_parser("from-open-clip", help="write an mmcl config file from open_clip_train's flags, listing "
                                               "those it could not map (docs/migration.md)")
    oc.add_argument("--out", required=True, help="the config file to write (a new file)")
    oc.add_argument("flags", nargs=argparse.REMAINDER, metavar="-- FLAGS",
                    help="open_clip_train's flags after --, e.g. -- --train-data 'shards/{0..9}.tar' --epochs 32")
    oc.set_defaults(func=cmd_from_open_clip)
    return p


def _says(err) -> bool:
    """Whether this process prints `err`: the main process always, the others their own errors only (not one that
    every process raised alike), so that a multi-process run ends with one line."""
    from ..config import is_main_process

    return not err.everywhere or is_main_process()


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for stream in (sys.stdout, sys.stderr):  # a name that is not UTF-8 never ends a command (`printable` escapes it)
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = _open_clip_train_args(argv) or parser.parse_args(argv)
    try:
        with warning_lines():
            return int(args.func(args) or 0)
    except MmclError as err:
        if _says(err):
            print(f"mmcl: error: {printable(err)}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a checkpoint was saved; the exit code: requeue or not (mmcl/run/signals.py)
        if _says(err):
            print(f"mmcl: {printable(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("mmcl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
