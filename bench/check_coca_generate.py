"""open_clip's own ``CoCa.generate`` on mmcl's open_clip export of a CoCa run, under transformers 4.x, against mmcl's
`mmcl.evaluation.captioning.generate` on the same model.

open_clip 3.3's ``generate`` needs transformers' ``BeamSearchScorer``, which transformers 5 removed (the project's
venv has 5.x: there open_clip refuses every generation type). This script installs transformers 4.x (with the
tokenizers and huggingface-hub it needs, no other package) into a directory of its own with
``pip install --target``, exports the run (``mmcl export --format open_clip``), and in a subprocess with that
directory first on ``PYTHONPATH`` loads the export with ``open_clip.create_model_and_transforms`` and captions a few
images with open_clip's greedy decoding (``generation_type="top_k", top_k=1``) and beam search, and with mmcl's
greedy decoding on the model open_clip loaded. Prints one JSON line; exits 1 when the greedy tokens differ.

    python bench/check_coca_generate.py --model RUN [--work /tmp/mmcl-coca-tf4] [--transformers 4.55.4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SIDE = r"""
import json, sys
import open_clip, torch, transformers
from PIL import Image
from mmcl.evaluation.captioning import generate

export, seq_len = sys.argv[1], int(sys.argv[2])
model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
tokenizer = open_clip.get_tokenizer(f"local-dir:{export}")
model.eval()
colours = [(230, 30, 30), (30, 30, 230), (30, 200, 30), (240, 240, 240)]
images = torch.stack([preprocess(Image.new("RGB", (64, 64), c)) for c in colours])
sot, eot = tokenizer.sot_token_id, tokenizer.eot_token_id

def tokens(row):
    out = [t for t in row.tolist()[1:]]
    return out[:out.index(eot)] if eot in out else [t for t in out if t != 0]

greedy = model.generate(images, seq_len=seq_len, min_seq_len=1, generation_type="top_k", top_k=1)
beams = model.generate(images, seq_len=seq_len, min_seq_len=1, generation_type="beam_search", num_beams=3,
                       num_beam_groups=1)
ours = generate(model, images, sot, eot, max_length=seq_len - 1)
print(json.dumps({"transformers": transformers.__version__, "open_clip": open_clip.__version__,
                  "open_clip_greedy": [tokens(r) for r in greedy], "mmcl_greedy": ours,
                  "open_clip_beam_search": [open_clip.decode(r) for r in beams],
                  "greedy_equal": [tokens(r) for r in greedy] == ours}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a CoCa run (model.name coca_*) or its model/")
    ap.add_argument("--work", default="/tmp/mmcl-coca-tf4")
    ap.add_argument("--transformers", default="4.55.4")
    ap.add_argument("--seq-len", type=int, default=8, help="open_clip's seq_len: the start token and the rest")
    args = ap.parse_args()
    work = Path(args.work)
    site = work / f"transformers-{args.transformers}"
    if not (site / "transformers").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        f"transformers=={args.transformers}", "tokenizers>=0.21,<0.22",
                        "huggingface-hub>=0.23.2,<1.0"], check=True)
    export = work / "export"
    if not export.is_dir():
        subprocess.run([sys.executable, "-m", "mmcl", "export", "--model", args.model, "--format", "open_clip",
                        "--out", str(export)], check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", SIDE, str(export), str(args.seq_len)], check=True, env=env,
                         capture_output=True, text=True)
    line = out.stdout.strip().splitlines()[-1]
    print(line)
    return 0 if json.loads(line)["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
