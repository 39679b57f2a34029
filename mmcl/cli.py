"""The ``mmcl`` command line (also ``python -m mmcl``). User errors end in one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from .errors import MmclError, RunStopped

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
        text = " ".join(str(message).split())
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
        from torch.distributed.distributed_c10d import _get_default_store

        key = "mmcl/warning/" + hashlib.sha1(text.encode()).hexdigest()
        return _get_default_store().add(key, 1) == 1
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
    text = json.dumps(obj, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)


def _device(name: Optional[str]):
    import torch

    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_train(args) -> int:
    from .config import load_config
    from .training.loop import train

    config, overrides = args.config, list(args.overrides)
    if config is None and overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]  # `mmcl train CONFIG key=value ...`
    cfg = load_config(config, overrides)
    train(cfg)
    return 0


def cmd_demo_data(args) -> int:
    from .data.demo import make_demo_data

    kwargs = {"n_train": args.n_train} if args.n_train is not None else {}
    paths = make_demo_data(args.out, seed=args.seed, **kwargs)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def cmd_shards(args) -> int:
    from .data import shards_from_input

    shards_from_input(args.input, args.out, shard_size=args.shard_size, caption_template=args.caption_template,
                      sep=args.sep, image_col=args.image_col, caption_col=args.caption_col)
    return 0


def cmd_reinforce(args) -> int:
    from .training.reinforce import reinforce

    keys = _sample_keys(args) if (args.image_key or args.caption_key) else None
    summary = reinforce(args.teacher, args.data, args.out, batch_size=args.batch_size, device=args.device,
                        keys=keys, progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def _load(args):
    from .storage.weights import load

    return load(args.model)


def _sample_keys(args):
    """--image-key / --caption-key as a `mmcl.data.SampleKeys` (None for the default members)."""
    from .data import sample_keys

    return sample_keys(image_key=args.image_key, caption_key=args.caption_key or "txt")


def cmd_zeroshot(args) -> int:
    from .evaluation.evaluate import zeroshot

    model, preprocess, tokenizer = _load(args)
    res = zeroshot(model, preprocess, tokenizer, args.data, classnames=args.classnames, templates=args.templates,
                   batch_size=args.batch_size, workers=args.workers, device=_device(args.device),
                   model_name=str(args.model), keys=_sample_keys(args))
    _write_json(res, args.out)
    return 0


def cmd_retrieval(args) -> int:
    from .evaluation.evaluate import retrieval

    model, preprocess, tokenizer = _load(args)
    res = retrieval(model, preprocess, tokenizer, args.data, batch_size=args.batch_size, workers=args.workers,
                    device=_device(args.device), model_name=str(args.model), keys=_sample_keys(args))
    _write_json(res, args.out)
    return 0


def cmd_linear_probe(args) -> int:
    from .evaluation.evaluate import linear_probe

    model, preprocess, tokenizer = _load(args)
    res = linear_probe(model, preprocess, args.train, args.test, batch_size=args.batch_size, workers=args.workers,
                       device=_device(args.device), model_name=str(args.model))
    _write_json(res, args.out)
    return 0


def cmd_export(args) -> int:
    from .storage.export import export

    out = export(args.model, args.format, args.out)
    print(f"mmcl: exported {args.format} to {out}")
    return 0


def cmd_index(args) -> int:
    from .evaluation.index import build_index

    build_index(args.model, args.data, args.out, batch_size=args.batch_size, workers=args.workers,
                device=_device(args.device))
    return 0


def cmd_search(args) -> int:
    from .evaluation.index import search

    hits = search(args.index, query=args.query, image=args.image, k=args.k)
    if args.json:
        print(json.dumps(hits, indent=2, ensure_ascii=False))
        return 0
    for hit in hits:
        source = hit.get("url") or hit.get("__url__", "")
        print(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['key']}  {hit.get('caption', '')!r}  {source}")
    return 0


def cmd_plot(args) -> int:
    from .evaluation.plot import plot_run

    for p in plot_run(args.run_dir):
        print(f"mmcl: wrote {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmcl", description="CLIP-style multimodal contrastive pretraining")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("train", help="train (single process, or several under `accelerate launch`)")
    t.add_argument("--config", "-c", help="YAML config file")
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. data.batch_size=32 (a first argument without '=' is the config)")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo-data", help="write the embedded synthetic dataset as WebDataset shards")
    d.add_argument("--out", required=True)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--n-train", type=int, default=None, help="training pairs (default: the demo's size)")
    d.set_defaults(func=cmd_demo_data)

    s = sub.add_parser("shards", help="write WebDataset shards from images with caption files (img2dataset's "
                                      "files layout), an ImageFolder, or a CSV, TSV, JSONL or parquet table")
    s.add_argument("--input", required=True,
                   help="folder of KEY.jpg + KEY.txt [+ KEY.json], ImageFolder, or table with image|url|filepath and "
                        "caption|title columns (open_clip's CSV layout: tab-separated filepath, title)")
    s.add_argument("--out", required=True)
    s.add_argument("--shard-size", type=int, default=1000)
    s.add_argument("--caption-template", default="a photo of a {}.", help="ImageFolder captions")
    s.add_argument("--sep", default=None,
                   help="a table's field separator, \\t for a tab (open_clip's --csv-separator; default: a tab for "
                        ".tsv, and for a .csv whose header holds one, else a comma)")
    s.add_argument("--image-col", default=None,
                   help="a table's image column (open_clip's --csv-img-key; default: image, url or filepath)")
    s.add_argument("--caption-col", default=None,
                   help="a table's caption column (open_clip's --csv-caption-key; default: caption or title)")
    s.set_defaults(func=cmd_shards)

    rf = sub.add_parser("reinforce", help="copy shards with a teacher's image and caption embeddings stored in "
                                          "each sample, for distill.from_shards")
    rf.add_argument("--teacher", required=True, help="run dir, its model/, an export, or a Hugging Face CLIP dir")
    rf.add_argument("--data", required=True, help="input shards (brace-expanded spec, a directory or a list)")
    rf.add_argument("--out", required=True, help="output directory (one shard per input shard, same names)")
    rf.add_argument("--batch-size", type=int, default=64)
    rf.add_argument("--device", default=None)
    rf.add_argument("--image-key", default=None, help="image member (default: first of jpg, jpeg, png, webp)")
    rf.add_argument("--caption-key", nargs="+", default=None,
                    help="caption member(s), as data.caption_key: every caption is embedded")
    rf.add_argument("--no-progress", action="store_true")
    rf.set_defaults(func=cmd_reinforce)

    def eval_args(x, data_help):
        x.add_argument("--model", required=True, help="run dir, its model/, or an export")
        x.add_argument("--data", required=True, help=data_help)
        x.add_argument("--out", help="results JSON")
        x.add_argument("--batch-size", type=int, default=128)
        x.add_argument("--workers", type=int, default=0)
        x.add_argument("--device", default=None)
        x.add_argument("--image-key", default=None, help="image member of shards (default: first of jpg, jpeg, png, "
                                                          "webp), as data.image_key")
        x.add_argument("--caption-key", nargs="+", default=None,
                       help="caption member(s) of shards, e.g. txt, json:caption, json:captions (a list); all "
                            "captions are scored (as data.caption_key)")

    z = sub.add_parser("zeroshot", help="zero-shot classification")
    eval_args(z, "ImageFolder or labelled shards (.cls)")
    z.add_argument("--classnames", default=None, help="file, one class name per line in label order")
    z.add_argument("--templates", default="auto",
                   help="file with '{}' templates, or openai_imagenet_template | simple_imagenet_template "
                        "(default: templates.txt next to the data, else openai_imagenet_template)")
    z.set_defaults(func=cmd_zeroshot)

    r = sub.add_parser("retrieval", help="image<->text retrieval recall@1/5/10")
    eval_args(r, "shards with captions")
    r.set_defaults(func=cmd_retrieval)

    lp = sub.add_parser("linear-probe", help="logistic regression on frozen image features")
    lp.add_argument("--model", required=True)
    lp.add_argument("--train", required=True)
    lp.add_argument("--test", required=True)
    lp.add_argument("--out")
    lp.add_argument("--batch-size", type=int, default=128)
    lp.add_argument("--workers", type=int, default=0)
    lp.add_argument("--device", default=None)
    lp.set_defaults(func=cmd_linear_probe)

    e = sub.add_parser("export", help="export the encoders")
    e.add_argument("--model", required=True)
    e.add_argument("--format", required=True, choices=["open_clip", "hf", "onnx", "safetensors"])
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("index", help="build an image embedding index")
    i.add_argument("--model", required=True)
    i.add_argument("--data", required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--batch-size", type=int, default=128)
    i.add_argument("--workers", type=int, default=0)
    i.add_argument("--device", default=None)
    i.set_defaults(func=cmd_index)

    q = sub.add_parser("search", help="query an index with text or an image")
    q.add_argument("--index", required=True)
    q.add_argument("query", nargs="?", default=None)
    q.add_argument("--image", default=None)
    q.add_argument("-k", type=int, default=10)
    q.add_argument("--json", action="store_true",
                   help="print the hits as one JSON array (rank, score, key, caption, __url__, url, label)")
    q.set_defaults(func=cmd_search)

    pl = sub.add_parser("plot", help="plot a run: loss curves, lr/logit scale, alignment-uniformity plane")
    pl.add_argument("run_dir")
    pl.set_defaults(func=cmd_plot)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warning_lines():
            return int(args.func(args) or 0)
    except MmclError as err:
        if not err.quiet:  # set on all processes but rank 0 of a multi-process run
            print(f"mmcl: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a checkpoint was saved; the exit code says whether to requeue (mmcl/preempt.py)
        if not err.quiet:
            print(f"mmcl: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("mmcl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
