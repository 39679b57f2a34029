"""What the captioning term costs: time and peak memory of one training step (forward, loss, backward, AdamW) of
SigLIP alone against SigLIP + captioning, on the same towers (`model.name coca_tiny`: its image and text towers
without the decoder for SigLIP alone, open_clip's CustomTextCLIP; with it, mmcl's CaptionCoCa), through mmcl's own
`Step`, on random 64 px images and captions of 12 tokens.

Each arm runs in its own process, the arms taking turns round by round; per arm one JSON line: ``ms_per_step``
(median over the rounds of each round's median step), ``peak_rss_growth_mib`` (the process's peak resident memory
after the steps minus before the first, the model built: activations, gradients, AdamW's state and the decoder's
logits over the vocabulary), the parameters; then a summary line with the ratios.

    PYTHONPATH=. .venv/bin/python bench/bench_caption.py [--batch 32] [--steps 6] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _arm(arm: str, batch: int, steps: int, threads: int) -> dict:
    import torch
    from accelerate import Accelerator

    from mmcl import models
    from mmcl.config import LossConfig, load_config
    from mmcl.training.step import Step, objective_from_config

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=coca_tiny", "model.init_logit_bias=-10"]).model
    model_cfg = models.resolve_model_config(cfg)
    if arm == "siglip":  # the same image and text towers, no decoder
        model_cfg.pop("multimodal_cfg")
        model_cfg["vision_cfg"]["output_tokens"] = model_cfg["text_cfg"]["output_tokens"] = False
    model = models.create(model_cfg)
    weights = {"clip": 0.0, "siglip": 1.0, "caption": 1.0 if arm == "siglip_caption" else 0.0}
    acc = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    step = Step(acc, model, acc.unwrap_model(model), optimizer, objective_from_config(LossConfig(**weights)),
                grad_clip=1.0, max_logit_scale=100.0)
    g = torch.Generator().manual_seed(1)
    text = torch.zeros(batch, 32, dtype=torch.long)
    text[:, :12] = torch.randint(1, 49406, (batch, 12), generator=g)
    text[:, 0], text[:, 11] = 49406, 49407
    b = {"image": torch.randn(batch, 3, 64, 64, generator=g), "text": text,
         "label": torch.full((batch,), -1, dtype=torch.long)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step([b], 1, False)  # the optimiser's state made: counted in the memory, not in the time
    times = []
    for i in range(steps):
        t = time.perf_counter()
        step([b], i + 2, False)
        times.append(time.perf_counter() - t)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"arm": arm, "ms_per_step": 1000 * statistics.median(times), "peak_rss_growth_mib": (after - before) / 1024,
            "params": sum(p.numel() for p in acc.unwrap_model(model).parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # an arm, in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_arm(args.one, args.batch, args.steps, args.threads)))
        return
    arms = ["siglip", "siglip_caption"]
    runs = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            out = subprocess.run([sys.executable, __file__, "--one", arm, "--batch", str(args.batch), "--steps",
                                  str(args.steps), "--threads", str(args.threads)], capture_output=True, text=True,
                                 check=True)
            runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {}
    for arm in arms:
        line = {"arm": arm, "batch": args.batch, "rounds": args.rounds,
                "ms_per_step": round(statistics.median(x["ms_per_step"] for x in runs[arm]), 1),
                "peak_rss_growth_mib": round(statistics.median(x["peak_rss_growth_mib"] for x in runs[arm]), 1),
                "params": runs[arm][0]["params"]}
        result[arm] = line
        print(json.dumps(line))
    a, b = result["siglip"], result["siglip_caption"]
    print(json.dumps({"summary": "siglip_caption / siglip",
                      "time": round(b["ms_per_step"] / a["ms_per_step"], 2),
                      "memory": round(b["peak_rss_growth_mib"] / max(a["peak_rss_growth_mib"], 1e-9), 2)}))


if __name__ == "__main__":
    main()
