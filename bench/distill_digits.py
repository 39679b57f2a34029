"""Does distillation help? A student trained with and without a teacher in the loop, on scikit-learn's digits.

Teacher: the LiT model of `bench/lit_digits.py` (a locked all-MiniLM-L6-v2 text tower, a small image tower trained
from scratch), trained once through mmcl. Student: mmcl's tiny CLIP with its own small text transformer, trained
the same number of steps on the same shards with ``loss.distill`` 0 (plain InfoNCE) and > 0 (InfoNCE plus the KL
from the teacher's batch distributions), for several seeds. Both are evaluated zero-shot on the held-out digits
with class names ("zero" .. "nine") and prompts that are not training captions (`lit_digits.zeroshot`).

    nice .venv/bin/python bench/distill_digits.py --work-dir /tmp/distill-digits [--seeds 0 1 2] [--epochs 6] [--stored]

Prints one JSON line per trained student, then a summary with the mean and every seed's top-1 per arm, and the
training samples/s of each arm: no teacher, the teacher in the loop, and (``--stored``) its embeddings read from
reinforced shards. Not a test; CPU minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_digits  # noqa: E402  (the same data, teacher recipe and evaluation)


def reinforce_shards(work: Path, data: dict, teacher: Path) -> str:
    """The training shards with the teacher's embeddings stored in them (`mmcl reinforce`)."""
    from mmcl.curation.reinforce import reinforce

    out = work / "reinforced"
    summary = reinforce(str(teacher), data["shards"], str(out), batch_size=128, progress=False)
    print(json.dumps({"reinforce": summary}), flush=True)
    return str(out / "*.tar")


def train_student(work: Path, data: dict, args, seed: int, teacher: Path, weight: float,
                  stored: str = "") -> dict:
    import mmcl

    out = work / f"student-distill{weight:g}{'-stored' if stored else ''}-seed{seed}"
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
    steps = args.epochs * (data["n_train"] // args.batch_size)
    cmd = [sys.executable, "-m", "mmcl", "train", "--config", "configs/tiny.yaml",
           f"model.image_size={args.image_size}", f"model.context_length={args.context_length}",
           f"data.train={stored or data['shards']}", f"data.batch_size={args.batch_size}", "data.workers=1",
           "data.shuffle_buffer=2000", f"train.steps={steps}", f"train.output_dir={out}", f"train.seed={seed}",
           f"train.save_every={steps}", "train.log_every=10", "train.plot=false", "train.progress=false",
           f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", "eval.zeroshot=null"]
    if weight > 0:
        cmd += [f"loss.distill={weight}", "distill.from_shards=true" if stored else f"distill.teacher={teacher}"]
    seconds = lit_digits.run(cmd, work / f"{out.name}.log", args.reuse, out / "model")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    sps = [r["samples_per_s"] for r in rows[1:]] or [rows[-1]["samples_per_s"]]  # the first window warms up
    model, preprocess, tokenizer = mmcl.load(out)
    arm = "none" if weight == 0 else f"{'stored' if stored else 'online'} distill={weight:g}"
    return {"arm": arm, "seed": seed, "steps": steps, "train_s": round(seconds, 1),
            "samples_per_s": round(float(np.median(sps)), 1),
            "final_loss_clip": rows[-1]["loss/clip"], **lit_digits.zeroshot(model, preprocess, tokenizer, data),
            "command": " ".join(map(str, cmd))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/distill-digits")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--context-length", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=6, help="student epochs")
    parser.add_argument("--teacher-epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 1.0], help="loss.distill values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--stored", action="store_true", help="also train from shards reinforced with the teacher "
                                                                "(mmcl reinforce, distill.from_shards)")
    parser.add_argument("--stored-only", action="store_true", help="with --stored, skip the teacher-in-the-loop arm "
                                                                     "(its targets equal the stored ones)")
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = lit_digits.make_data(work, args.image_size, seed=0)
    teacher_args = argparse.Namespace(**{**vars(args), "epochs": args.teacher_epochs, "wd": 0.1})
    teacher = lit_digits.train_mmcl(work, data, teacher_args, seed=0)
    teacher_dir = work / "mmcl-seed0"
    print(json.dumps({"teacher": "LiT (locked all-MiniLM-L6-v2)", **{k: teacher[k] for k in ("acc1", "acc5",
                                                                                             "steps", "train_s")}}),
          flush=True)
    stored = reinforce_shards(work, data, teacher_dir) if args.stored else ""
    results = []
    for seed in args.seeds:
        for weight in args.weights:  # the arms alternate, so machine load affects them alike
            arms = [""] if weight == 0 or not stored else [stored] if args.stored_only else ["", stored]
            for shards in arms:
                res = train_student(work, data, args, seed, teacher_dir, weight, shards)
                print(json.dumps(res), flush=True)
                results.append(res)
    summary = {"summary": "distill_digits zero-shot top-1 on held-out digits", "teacher_acc1": teacher["acc1"],
               "n_train": data["n_train"], "n_test": data["n_test"], "chance": 0.1}
    for name in dict.fromkeys(r["arm"] for r in results):
        arm = [r for r in results if r["arm"] == name]
        summary[name] = {"acc1_mean": round(float(np.mean([r["acc1"] for r in arm])), 4),
                         "acc1": [round(r["acc1"], 4) for r in arm],
                         "samples_per_s_median": round(float(np.median([r["samples_per_s"] for r in arm])), 1)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
