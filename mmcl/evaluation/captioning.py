"""Captions out of a model with a captioning decoder (open_clip's CoCa, `mmcl.models.clip_classes.CaptionCoCa`):
`generate` (greedy or beam search) and `caption_images` (`mmcl caption`: one caption per image of a folder or of
shards, written as JSONL or CSV with each image's key).

Generation calls only the model's public forward, as open_clip's ``CoCa.generate`` does: the image tower once
(``model(images)`` gives ``image_features`` and ``image_embs``), then per new token the text tower and decoder on
the prefix so far (``model(images, prefix, image_latent=..., image_embs=..., output_labels=False)``), reading
the last position's logits. open_clip's own ``generate`` is not used: it imports transformers' ``BeamSearchScorer``,
which transformers 4.56 moved and 5.0 removed, so with transformers 5 open_clip 3.3's ``generate`` refuses every
generation type. Any model loaded as open_clip's CoCa class (an open_clip export folder read by open_clip itself)
captions here alike.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import data as data_mod
from .. import models
from ..config import say
from ..errors import ConfigError, DataError
from ..storage.fsutil import atomic_write_text, os_error_text
from .evaluate import eval_batches

OUTPUT_SUFFIXES = (".jsonl", ".csv")


def _prefix_limit(model) -> int:
    """The longest token prefix the text tower and the decoder take (their context lengths)."""
    text = getattr(model, "text", None)
    limits = [getattr(text, "context_length", None), getattr(getattr(model, "text_decoder", None), "context_length",
                                                               None)]
    return min(int(v) for v in limits if v)


@torch.no_grad()
def generate(model, images: torch.Tensor, sot_id: int, eot_id: int, max_length: int = 30, beams: int = 1,
             pad_id: int = 0, length_penalty: float = 1.0) -> List[List[int]]:
    """Each image's caption tokens, after the start token and up to and without the end token.

    Args:
        model: a CoCa (open_clip's class or mmcl's), in eval mode.
        images: (B, 3, H, W) float, preprocessed.
        sot_id, eot_id, pad_id: the tokenizer's start, end and padding tokens.
        max_length: the most tokens generated per caption, the end token included (at most the text context).
        beams: 1 is greedy decoding; K > 1 keeps the K most probable prefixes and returns the finished one of
            highest log-probability divided by its length ** `length_penalty` (transformers' beam-search rule).
    """
    limit = _prefix_limit(model)
    if not 1 <= max_length <= limit:
        raise ConfigError(f"--max-length must be in 1..{limit} (this model's text context; got {max_length})")
    if beams < 1:
        raise ConfigError(f"--beams must be >= 1 (got {beams})")
    b, device = images.shape[0], images.device
    enc = model(images)
    latent, embs = enc["image_features"], enc["image_embs"]
    if beams > 1:
        latent, embs = latent.repeat_interleave(beams, 0), embs.repeat_interleave(beams, 0)
        images = images.repeat_interleave(beams, 0)
    rows = b * beams
    seq = torch.full((rows, 1), sot_id, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    # The first beam of each image starts alone (the others would repeat it).
    score = torch.zeros(b, beams, device=device)
    score[:, 1:] = float("-inf")
    score = score.reshape(-1)
    for _ in range(max_length):
        logits = model(images, seq, image_latent=latent, image_embs=embs, output_labels=False)["logits"][:, -1]
        logp = F.log_softmax(logits.float(), dim=-1)  # (rows, V)
        if seq.shape[1] == max_length:  # the last place: the caption ends here
            forced = torch.full_like(logp, float("-inf"))
            forced[:, eot_id] = 0.0
            logp = forced
        # A finished row continues with padding at no cost.
        finished = torch.full_like(logp, float("-inf"))
        finished[:, pad_id] = 0.0
        logp = torch.where(done[:, None], finished, logp)
        if beams == 1:
            token = logp.argmax(dim=-1)
            score = score + logp.gather(1, token[:, None]).squeeze(1)
        else:
            vocab = logp.shape[1]
            cand = (score[:, None] + logp).reshape(b, beams * vocab)
            top, idx = cand.topk(beams, dim=1)
            origin = (idx // vocab + torch.arange(b, device=device)[:, None] * beams).reshape(-1)
            token, score = (idx % vocab).reshape(-1), top.reshape(-1)
            seq, done = seq[origin], done[origin]
        seq = torch.cat([seq, token[:, None]], dim=1)
        done = done | (token == eot_id)
        if bool(done.all()):
            break
    out = []
    for i in range(b):
        candidates = range(i * beams, (i + 1) * beams)
        best = max(candidates, key=lambda r: float(score[r]) / _length(seq[r], eot_id) ** length_penalty)
        out.append(_caption_tokens(seq[best], eot_id))
    return out


def _caption_tokens(row: torch.Tensor, eot_id: int) -> List[int]:
    tokens = row[1:].tolist()
    return tokens[:tokens.index(eot_id)] if eot_id in tokens else tokens


def _length(row: torch.Tensor, eot_id: int) -> int:
    """Tokens generated up to and with the end token."""
    return len(_caption_tokens(row, eot_id)) + 1


def decode(tokenizer, tokens: List[int]) -> str:
    """Caption text from token ids (open_clip's BPE tokenizer's ``decode``, the tokenizer of every decoder mmcl
    builds), whitespace collapsed."""
    return " ".join(tokenizer.decode(tokens).split())


def output_format(out: str) -> str:
    """``jsonl`` or ``csv`` from the output file's suffix; anything else is a `ConfigError`."""
    suffix = Path(out).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ConfigError(f"--out must end in .jsonl or .csv (got {out})")
    return suffix[1:]


def caption_images(model, preprocess, tokenizer, images: Any, out: str, max_length: int = 30, beams: int = 1,
                   batch_size: int = 32, workers: int = 0, device: Any = "cpu", progress: bool = True,
                   keys: Optional[Any] = None, model_name: str = "") -> Dict[str, Any]:
    """Caption every image of `images` (a folder of image files, at any depth, or shards) with `model`'s decoder
    (`generate`) and write one row per image to `out` (a new ``.jsonl`` or ``.csv`` file): ``key`` (the path
    relative to the folder, or the shard sample's key) and ``caption``. Unreadable images are skipped and named
    (one warning line, with the reasons counted, and in the summary). Returns the summary:
    ``{"model", "images", "out", "n_captioned", "n_skipped", "skipped": {reason: count}, "decoding"}``."""
    if not models.has_decoder(model):
        raise ConfigError(f"--model {model_name} has no captioning decoder (captions come from a CoCa model: train "
                          f"with model.name coca_* and loss.caption, or use an open_clip CoCa export)")
    fmt = output_format(out)
    target = Path(out)
    if target.exists() or target.is_symlink():
        raise ConfigError(f"--out {out} exists; mmcl caption writes a new file (choose another name, or move it away)")
    if batch_size <= 0 or workers < 0:
        raise DataError(f"--batch-size must be > 0 and --workers >= 0 (got {batch_size}, {workers})")
    ds = data_mod.build_image_set(images, preprocess, keys=keys)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                         collate_fn=data_mod.eval_collate)
    model = model.to(device).eval()
    sot, eot = int(tokenizer.sot_token_id), int(tokenizer.eot_token_id)
    rows: List[Dict[str, str]] = []
    skips: List[Any] = []
    try:
        total = len(loader)
    except TypeError:
        total = None
    batches = eval_batches(loader)
    try:
        shown = tqdm(batches, desc="caption", unit="batch", total=total, dynamic_ncols=True) if progress else batches
        for batch, _, _, batch_keys, problems, _ in shown:
            for problem in problems:
                if isinstance(problem, data_mod.EvalFailure):
                    raise problem.error
                skips.append(problem)
            if batch is None:
                continue
            tokens = generate(model, batch.to(device), sot, eot, max_length=max_length, beams=beams)
            rows += [{"key": k, "caption": decode(tokenizer, t)} for k, t in zip(batch_keys, tokens)]
    finally:
        batches.close()
    counts: Dict[str, int] = {}
    for skip in skips:
        counts[skip.reason] = counts.get(skip.reason, 0) + 1
    if skips:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        say(f"caption: skipped {len(skips)} images of {images} ({reasons}; first {skips[0].where}: "
            f"{skips[0].reason})", warning=True)
    if not rows:
        raise DataError(f"no readable images in {images}")
    try:
        atomic_write_text(target, _rows_text(rows, fmt))
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {os_error_text(err)}") from None
    return {"model": model_name, "images": str(images), "out": str(out), "n_captioned": len(rows),
            "n_skipped": len(skips), "skipped": counts,
            "decoding": {"beams": beams, "max_length": max_length}}


def _rows_text(rows: List[Dict[str, str]], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["key", "caption"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
