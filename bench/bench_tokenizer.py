"""The exports' tokenizer.json (Hugging Face `tokenizers`, no Python in the loop) against open_clip's SimpleTokenizer:
agreement of the token ids and time per caption, on one thread.

    python bench/bench_tokenizer.py [--n 2000] [--context-length 77]

Captions are random word sequences drawn from the CLIP vocabulary (open_clip caches BPE per word, so repeated
words would flatter it), with a share of them carrying HTML entities, punctuation and non-ASCII text. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread, as open_clip's tokenizer runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--context-length", type=int, default=77)
    args = ap.parse_args()

    from open_clip.tokenizer import SimpleTokenizer
    from tokenizers import Tokenizer

    from mmcl.storage.clip_tokenizer_file import tokenizer_json

    t0 = time.perf_counter()
    text = tokenizer_json(args.context_length)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = Tokenizer.from_str(text)
    load_s = time.perf_counter() - t0
    oc = SimpleTokenizer(context_length=args.context_length)
    words = [w[:-4] for w in list(oc.encoder)[1000:45000:5] if w.endswith("</w>") and w[:-4].isalpha()]
    extras = ["&amp;", "&quot;", "it&#39;s", "&lt;3", "café", "東京", "“quoted”", "ＦＵＬＬ", "!!", "3.5", "e-mail"]
    rng = random.Random(0)
    captions = []
    for i in range(args.n):
        parts = [rng.choice(words) for _ in range(rng.randint(5, 20))]
        if i % 4 == 0:
            parts.insert(rng.randrange(len(parts)), rng.choice(extras))
        captions.append(" ".join(parts))
    t0 = time.perf_counter()
    ids = [e.ids for e in tok.encode_batch(captions)]
    t_file = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = oc(captions).tolist()
    t_oc = time.perf_counter() - t0
    agree = sum(a == b for a, b in zip(ids, ref)) / len(captions)
    print(json.dumps({"captions": len(captions), "context_length": args.context_length, "ids_agree": agree,
                      "ms_per_caption_tokenizer_json": round(1000 * t_file / len(captions), 3),
                      "ms_per_caption_open_clip": round(1000 * t_oc / len(captions), 3),
                      "ratio": round(t_file / t_oc, 2), "build_s": round(build_s, 1),
                      "load_s": round(load_s, 2), "file_mb": round(len(text) / 1e6, 2)}))
    return 0 if agree == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
