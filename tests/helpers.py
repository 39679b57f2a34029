"""Builders shared by several test files: a micro model and fake batches, the tiny demo run's command line and its
outputs, the loss tests' feature pairs and float64 references, and the small images, shards and stream settings of
the data tests. Their fixtures (`demo`, `corpus`) are in conftest.py."""

import io
import json
import math
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image
from torchvision import transforms as T

from mmcl import models
from mmcl.config import DataConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
# accelerate's launcher, the launch_command that `accelerate launch` runs, started without the `accelerate` CLI's
# other subcommands, whose imports (timm, transformers) cost about 5 s of CPU per launch. One test runs the
# `accelerate` command itself (tests/training/test_loop.py).
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]

# ------------------------------------------------------------------------------------------- training
# Two tower sizes, smaller than configs/tiny.yaml's, as overrides of it. TRAINING_TOWERS still learn the demo's
# colours in a few dozen steps, each step milliseconds on a CPU: for tests of what a run computes and learns.
# FOLDER_TOWERS are the smallest a run can build: for tests of what a run leaves in its folder and says.
TRAINING_TOWERS = ["model.vision_cfg={layers: 2, width: 64, head_width: 32}",
                   "model.text_cfg={layers: 2, width: 64, heads: 2}", "model.embed_dim=32"]
FOLDER_TOWERS = ["model.vision_cfg={layers: 1, width: 32, head_width: 16}",
                 "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]
# A one-block timm NaFlexVit (8 px patches) and text tower, for configs/naflex.yaml runs.
NAFLEX_TOWERS = ["model.vision_cfg={timm_model_name: naflexvit_base_patch16_siglip, timm_model_kwargs: {"
                 "embed_dim: 16, depth: 1, num_heads: 2, patch_size: 8, pos_embed_grid_size: [4, 4], "
                 "pos_embed_use_grid_sample: true}}",
                 "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]


def naflex_args(data, out, *extra):
    """A configs/naflex.yaml run of NAFLEX_TOWERS on `data` into `out`: no workers, no trackers, a constant lr."""
    return ["train", "--config", str(ROOT / "configs" / "naflex.yaml"), f"data.train={data}",
            f"train.output_dir={out}", "train.progress=false", "train.plot=false", "train.log_with=[]",
            "data.workers=0", "data.shuffle_buffer=64", "train.log_every=1", "train.save_every=2",
            "optim.schedule=constant", "optim.warmup_steps=0", *NAFLEX_TOWERS, *extra]


def micro_model(seed=0, *extra):
    """A model of TRAINING_TOWERS (with `extra` overrides) from `seed`, its towers locked as the config says."""
    torch.manual_seed(seed)
    cfg = load_config(None, [*TRAINING_TOWERS, *extra]).model
    model, *_ = models.build(cfg)
    models.apply_locks(model, cfg)
    return model


def fake_batch(n, seed, image_size=64, context=32):
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(n, 3, image_size, image_size, generator=g),
            "text": torch.randint(1, 1000, (n, context), generator=g),
            "label": torch.full((n,), -1, dtype=torch.long)}


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_args(demo, out, *extra, towers=TRAINING_TOWERS, zeroshot="null"):
    """`mmcl train`'s arguments after the command's name: configs/tiny.yaml on the training shards of `demo` (a
    dataset of conftest.py's, or the shards' path) into `out`, with `towers` and `eval.zeroshot=zeroshot`, no
    progress bar nor plot; `extra` overrides come last, so they win."""
    train = demo["train"] if isinstance(demo, dict) else demo
    return ["--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train={train}", f"train.output_dir={out}",
            f"eval.zeroshot={zeroshot}", "train.progress=false", "train.plot=false", "data.shuffle_buffer=64",
            *towers, *extra]


# A two-step run of batches of 8 read in the main process, a checkpoint at step 2, a metrics line per step and no
# tracker: with FOLDER_TOWERS and conftest.py's `small_demo`, for tests of what a run leaves in its folder.
SHORT_RUN = ("data.shuffle_buffer=8", "data.batch_size=8", "data.workers=0", "train.save_every=2",
             "train.log_every=1", "train.log_with=[]", "train.steps=2")


def short_run(demo, out, *extra, towers=FOLDER_TOWERS, zeroshot="null"):
    """The command line of a SHORT_RUN for `mmcl.cli.main` (from the command's name, "train"): `run_args` with
    SHORT_RUN's settings before `extra`."""
    return ["train", *run_args(demo, out, *SHORT_RUN, *extra, towers=towers, zeroshot=zeroshot)]


def final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model" / "open_clip_model.safetensors"))


def metrics(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------- losses
def pair_features(n, d, dtype=torch.float32, seed=0, correlated=True):
    """n unit (image, text) pairs of width d from `seed`, drawn in float64 and cast to `dtype`; correlated: each text
    is its image plus noise (cosine ~0.8), so positives are more similar than negatives, as in a trained model."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g, dtype=torch.float64)
    txt = torch.randn(n, d, generator=g, dtype=torch.float64)
    if correlated:
        txt = img + 0.7 * txt
    return F.normalize(img, dim=1).to(dtype), F.normalize(txt, dim=1).to(dtype)


def fresh_leaves(*tensors):
    """Detached copies that require grad: the same inputs for two computations whose gradients are compared."""
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def assert_float32_close(got, want, scale):
    """Two float32 computations of the same logits-based quantity agree: 1e-5 relative, plus an absolute floor of
    scale * 2^-23, since each float32 logit of size <= scale is itself rounded by up to half that (a near-zero
    loss, an easy batch at a large scale, is only defined to about that much in any order of summation)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=float(scale) * 2**-23)


def grads_wrt(loss, tensors):
    return torch.autograd.grad(loss, tensors)


# float64 transcriptions of the papers' definitions, which the losses are checked against.
def ref_clip(img, txt, s):
    """Radford et al. 2021: mean of the two cross-entropies of the logit matrix and its transpose."""
    img, txt = img.double(), txt.double()
    logits = s * img @ txt.T
    idx = torch.arange(img.shape[0])
    return ((torch.logsumexp(logits, 1) - logits[idx, idx]).mean()
            + (torch.logsumexp(logits, 0) - logits[idx, idx]).mean()) / 2


def ref_supcon(img, txt, labels, s):
    """Khosla et al. 2020, L_out (mean of -log p over the positives, outside the log), taken across modalities:
    an image's positives are the texts of its class and its own caption (SupContrast's single-view form has the
    other views of the same modality and excludes the anchor itself); label -1, or labels None: the own caption
    only."""
    img, txt = img.double(), txt.double()
    n = img.shape[0]
    labels = torch.full((n,), -1) if labels is None else labels
    pos = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0) | torch.eye(n, dtype=torch.bool)
    out = 0
    for logits in (s * img @ txt.T, s * txt @ img.T):
        log_p = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        out = out + (-(log_p * pos).sum(1) / pos.sum(1)).mean() / 2
    return out


# ----------------------------------------------------------------------------------------------- data
SIDE = 8
MAX_PIXELS = 10_000  # small, so a 120x120 PNG is a decompression bomb for the stream

PREPROCESS = T.Compose([T.Resize(SIDE), T.CenterCrop(SIDE), T.ToTensor()])


def tokenizer(texts):
    """Bytes of the caption, padded to 24: deterministic and picklable, like a real tokenizer's output."""
    out = torch.zeros(len(texts), 24, dtype=torch.long)
    for i, text in enumerate(texts):
        raw = text.encode()[:24]
        out[i, : len(raw)] = torch.tensor(list(raw))
    return out


def encode(img, fmt):
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def image_for(i, size=12):
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def png(seed, size=32):
    """A PNG of random pixels from `seed`, `size` pixels square: a sample's image for shards a test writes."""
    return encode(Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)), "PNG")


def write_tar(path, members):
    """Write (name, bytes) members into a tar, in order."""
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def good_members(key, i, fmt="PNG", ext="png"):
    return [(f"{key}.{ext}", encode(image_for(i), fmt)), (f"{key}.txt", f"caption {key}".encode()),
            (f"{key}.cls", str(i % 5).encode())]


# Each bad sample: (members, reason it is skipped for).
def bad_samples():
    jpeg = encode(image_for(99, 32), "JPEG")
    return {
        "bad_trunc": ([("bad_trunc.jpg", jpeg[: len(jpeg) // 2]), ("bad_trunc.txt", b"cut")], "decode"),
        "bad_notimg": ([("bad_notimg.jpg", b"this is not an image"), ("bad_notimg.txt", b"x")], "decode"),
        "bad_nocap": ([("bad_nocap.png", encode(image_for(1), "PNG"))], "missing_caption"),
        "bad_noimg": ([("bad_noimg.txt", b"no image"), ("bad_noimg.cls", b"1")], "missing_image"),
        "bad_empty": ([("bad_empty.png", encode(image_for(2), "PNG")), ("bad_empty.txt", b"  \n")], "bad_caption"),
        "bad_utf8": ([("bad_utf8.png", encode(image_for(3), "PNG")), ("bad_utf8.txt", b"caf\xe9 \xff")],
                     "bad_caption"),
        "bad_label": ([("bad_label.png", encode(image_for(4), "PNG")), ("bad_label.txt", b"ok"),
                       ("bad_label.cls", b"three")], "bad_label"),
        "bad_bomb": ([("bad_bomb.png", encode(Image.new("RGB", (120, 120), (9, 9, 9)), "PNG")),
                      ("bad_bomb.txt", b"big")], "too_large"),
        # A float image holding NaN has no faithful 8-bit form (a TIFF under a .png name: Pillow goes by content).
        "bad_nan": ([("bad_nan.png", encode(Image.fromarray(np.full((8, 8), np.nan, np.float32)), "TIFF")),
                     ("bad_nan.txt", b"a scan with no data")], "unsupported_mode"),
    }


N_SHARDS, PER_SHARD, TRUNC_KEEP = 6, 10, 6


def stream_batch(shards, workers, pin_memory=False):
    """The first batch of a training stream over `shards` (8 samples, `workers` data workers), with open_clip's
    ViT-B-32 tokenizer cut after the longest caption as training cuts it."""
    import open_clip

    from mmcl.config import DataConfig
    from mmcl.data import build_train_stream
    from mmcl.data.transforms import ImageSpec
    from mmcl.models import TrimmedTokenizer

    # The tokenizer training gives open_clip's text transformer: batches cut after the longest caption.
    tokenizer = TrimmedTokenizer(open_clip.get_tokenizer("ViT-B-32"))
    cut = tokenizer(["a short caption", "another"])
    assert cut.shape[1] < 77 and not cut.is_contiguous()  # the view this test is about
    spec = ImageSpec(size=64, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    cfg = DataConfig(train=shards, batch_size=8, workers=workers, shuffle_buffer=16)
    stream = build_train_stream(cfg, spec, tokenizer, seed=0, pin_memory=pin_memory)
    it = iter(stream)
    batch = next(it)
    if hasattr(it, "close"):
        it.close()
    return batch


def cfg_for(spec, **kw):
    base = dict(train=spec, batch_size=1, workers=2, shuffle_buffer=5, max_image_pixels=MAX_PIXELS)
    base.update(kw)
    return DataConfig(**base)


# ------------------------------------------------------------------------------------------- evaluation
# Images of one flat colour, as ImageFolders and shards with captions and labels: what the evaluation tests score.
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def solid(rgb, size=8):
    return Image.new("RGB", (size, size), rgb)


def write_folder(root: Path, layout):
    """ImageFolder root/<class>/<i>.png from {class: [rgb, ...]}."""
    for cls, colours in layout.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i, rgb in enumerate(colours):
            solid(rgb).save(root / cls / f"{i}.png")
    return root


def write_shard(path: Path, samples):
    """samples: (key, rgb, caption or None, label or None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for key, rgb, caption, label in samples:
            sample = {"__key__": key, "png": solid(rgb)}
            if caption is not None:
                sample["txt"] = caption
            if label is not None:
                sample["cls"] = label
            sink.write(sample)
    return path


# ------------------------------------------------------------------------------------------- tokenizers
def varied_captions(n: int = 500):
    """Varied captions: case, punctuation, accents, HTML entities, odd whitespace, non-Latin text, over-long."""
    rng = random.Random(0)
    words = ["a", "photo", "of", "the", "Dog", "CAT", "café", "naïve", "Zürich", "São", "Paulo", "résumé", "jalapeño",
             "Ångström", "straße", "東京", "tower", "🐶", "x-ray", "e-mail", "U.S.A.", "don't", "it's", "50%", "$3.99",
             "C++", "#hashtag", "@user", "http://example.com/a?b=c", "mother-in-law", "ÉCOLE", "œuvre", "Ελληνικά",
             "Москва", "1,000", "3.14", "rock'n'roll", "O'Brien", "co-op", "…", "—", "«quoted»"]
    fixed = ["", " ", "A PHOTO OF A DOG.", "a photo of a dog", "Hello, World!!!", "What's this?? -- a test...",
             "Tom &amp; Jerry", "&quot;quoted&quot; &lt;b&gt;bold&lt;/b&gt;", "it&#39;s &#x27;here&#x27; &nbsp;ok",
             "&amp;amp; double-escaped", "<b>bold</b> <i>html</i> tags", "tabs\tand\nnewlines\r\nhere",
             "   leading and trailing spaces   ", "MiXeD CaSe WoRdS", "Crème brûlée à la française",
             "punctuation!!! ... ??? ;;; ::: ((( ))) [[[ ]]] {{{ }}}", "under_score and slash/back\\slash",
             "numbers 1 2 3 1st 2nd 3rd 1990s", "emoji 😀🎉 and symbols ©®™", "ＦＵＬＬＷＩＤＴＨ text",
             "a" * 300, " ".join(["word"] * 200), ("A long, punctuated caption; with clauses! " * 20).strip()]
    captions = list(fixed)
    while len(captions) < n:
        k = rng.randint(1, 60 if rng.random() < 0.15 else 12)
        text = " ".join(rng.choice(words) for _ in range(k))
        roll = rng.random()
        if roll < 0.2:
            text = text.upper()
        elif roll < 0.4:
            text = text.title()
        if rng.random() < 0.3:
            text = text.replace(" ", rng.choice(["  ", ", ", " - ", "\t", " &amp; ", ". "]), rng.randint(1, 3))
        if rng.random() < 0.4:
            text += rng.choice([".", "!", "?", "...", " :)", "&quot;", "'", ",", ";"])
        captions.append(text)
    return captions


# ------------------------------------------------------------------------------------------- Hugging Face cache
def hf_snapshot(cache: Path, repo: str, files: dict) -> Path:
    """Add a snapshot of `files` ({name: source path}) for `repo` to the hub cache `cache`, in the layout a download
    leaves (models--ORG--NAME/snapshots/<commit>/..., refs/main); returns the snapshot folder."""
    import hashlib
    import shutil

    commit = hashlib.sha1(repo.encode()).hexdigest()
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copyfile(source, snapshot / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


class TinyTowers(torch.nn.Module):
    """Two float64 linear towers (6 and 7 inputs to `dim`), normalised features, a learned scale and optionally
    SigLIP's bias: the smallest model for loss tests across processes."""

    def __init__(self, with_bias: bool, dim: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(6, dim).double()
        self.text = torch.nn.Linear(7, dim).double()
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-2.0, dtype=torch.float64)) if with_bias else None

    def forward(self, images, texts):
        return (F.normalize(self.image(images), dim=1), F.normalize(self.text(texts), dim=1),
                self.logit_scale.exp(), self.logit_bias)


def inputs_of(cfg):
    """The sections `mmcl.training.preflight.input_problems` checks, from a whole config."""
    return cfg.data, cfg.eval, cfg.model, cfg.distill


def check_run_inputs(cfg, processes: int = 1):
    """`mmcl.training.preflight.check_inputs` as a run of `cfg` on `processes` processes calls it."""
    from mmcl.training.preflight import check_inputs

    check_inputs(*inputs_of(cfg), processes, (cfg.data.batch_size, cfg.train.accum_steps))


def empty_tars(root):
    """Archives without members, as tarfile (ustar, pax, GNU; plain and gzip) and GNU tar's CLI write them."""
    paths = []
    for fmt, name in ((tarfile.USTAR_FORMAT, "ustar"), (tarfile.PAX_FORMAT, "pax"), (tarfile.GNU_FORMAT, "gnu")):
        for mode, ext in (("w", "tar"), ("w:gz", "tar.gz")):
            path = root / f"empty-{name}.{ext}"
            with tarfile.open(path, mode, format=fmt):
                pass
            paths.append(path)
    assert shutil.which("tar"), "GNU tar is needed to write the CLI's empty archive"
    cli = root / "empty-cli.tar"
    subprocess.run(["tar", "-cf", str(cli), "-T", "/dev/null"], check=True)
    paths.append(cli)
    one_block = root / "empty-one-block.tar"  # only the first end-of-archive block
    one_block.write_bytes(bytes(512))
    paths.append(one_block)
    return paths
