"""The embedded demo dataset: coloured shapes with captions, as WebDataset shards and zero-shot folders.

Every image shows one shape of one colour at one of nine positions and one of three sizes, on a
low-saturation background (gradient, stripes or checks), so colour is always the most salient
attribute. Captions name the colour always with the same word and describe shape, position and size in
varied phrasings; the zero-shot prompt templates use the same phrasings.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..config import say
from ..errors import DataError
from ..storage.fsutil import atomic_write_text, make_folder, new_file, unlink_inside
from ..storage.manifest import OutputManifest
from .writer import ShardWriter

# Alphabetical, so that a class's index is the same in `.cls`, classnames.txt and the ImageFolder's sorted
# folder order.
COLOURS: Dict[str, Tuple[int, int, int]] = {
    "black": (10, 10, 10),
    "blue": (30, 70, 225),
    "green": (30, 170, 50),
    "orange": (255, 140, 0),
    "purple": (140, 40, 190),
    "red": (220, 30, 30),
    "white": (250, 250, 250),
    "yellow": (245, 225, 30),
}
DONE = "demo.json"  # the settings of a complete demo, written last
SHAPES = ("circle", "cross", "diamond", "square", "star", "triangle")
SHAPE_WORDS = {  # a shape is sometimes called by a synonym; classnames use the first word
    "circle": ("circle", "disc", "round dot"),
    "square": ("square", "box"),
    "triangle": ("triangle",),
    "diamond": ("diamond", "rhombus"),
    "star": ("star", "five-pointed star"),
    "cross": ("cross", "plus sign"),
}
# (row, column) cell of a 3x3 grid -> its name
POSITIONS = {
    (0, 0): "top left", (0, 1): "top", (0, 2): "top right",
    (1, 0): "left", (1, 1): "center", (1, 2): "right",
    (2, 0): "bottom left", (2, 1): "bottom", (2, 2): "bottom right",
}
SIZES = {"small": 0.16, "medium": 0.24, "large": 0.32}  # shape radius as a fraction of the image side

CAPTION_FORMS = (
    "a {colour} {shape} in the {where}",
    "{where_dash}: {size} {colour} {shape}",
    "a {size} {colour} {shape} at the {where} of the image",
    "{colour} {shape}, {where}, {size}",
    "a picture of a {size} {colour} {shape} in the {where}",
    "there is a {colour} {shape} in the {where}",
    "a {colour} shape in the {where}",
    "a {size} {colour} object",
    "a photo of a {colour} {shape}.",
    "{size} {colour} {shape} on a plain background",
)
COLOUR_TEMPLATES = (
    "a {} shape",
    "a {} object",
    "a photo of a {} shape.",
    "a small {} shape",
    "a large {} shape",
    "a picture of a {} shape in the center",
)
SHAPE_TEMPLATES = (
    "a {}",
    "a photo of a {}.",
    "a picture of a {} in the center",
    "there is a {} in the image",
    "a small {}",
    "a large {}",
)


def _background(rng: np.random.Generator, side: int) -> np.ndarray:
    """A low-saturation mid-grey background (side, side, 3) uint8: gradient, stripes or checks."""
    base = rng.uniform(90, 170)
    tint = rng.uniform(-18, 18, size=3)
    a = np.clip(base + tint, 0, 255)
    b = np.clip(a + rng.uniform(-40, 40), 0, 255)
    xx = np.broadcast_to(np.arange(side, dtype=np.float32)[None, :] / side, (side, side))
    yy = xx.T
    kind = rng.integers(3)
    if kind == 0:
        angle = rng.uniform(0, 2 * math.pi)
        t = (xx * math.cos(angle) + yy * math.sin(angle))
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    elif kind == 1:
        period = rng.uniform(0.1, 0.3)
        t = (np.floor((xx if rng.integers(2) else yy) / period) % 2).astype(np.float32)
    else:
        period = rng.uniform(0.15, 0.35)
        t = ((np.floor(xx / period) + np.floor(yy / period)) % 2).astype(np.float32)
    img = a[None, None, :] * (1 - t[..., None]) + b[None, None, :] * t[..., None]
    return img.astype(np.uint8)


def _shape_points(shape: str, cx: float, cy: float, r: float, rot: float) -> Optional[List[Tuple[float, float]]]:
    def poly(n: int, radius: List[float], phase: float) -> List[Tuple[float, float]]:
        pts = []
        for i in range(n * len(radius)):
            ang = phase + rot + 2 * math.pi * i / (n * len(radius))
            rad = radius[i % len(radius)]
            pts.append((cx + rad * math.cos(ang), cy + rad * math.sin(ang)))
        return pts

    if shape == "square":
        return poly(4, [r * 1.1], math.pi / 4)
    if shape == "triangle":
        return poly(3, [r * 1.15], -math.pi / 2)
    if shape == "diamond":
        return [(cx, cy - r * 1.2), (cx + r * 0.75, cy), (cx, cy + r * 1.2), (cx - r * 0.75, cy)]
    if shape == "star":
        return poly(5, [r * 1.2, r * 0.5], -math.pi / 2)
    if shape == "cross":
        w = r * 0.38
        arm = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w),
               (-w, -w)]
        c, s = math.cos(rot), math.sin(rot)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm]
    return None  # circle


def render(colour: str, shape: str, cell: Tuple[int, int], size: str, rng: np.random.Generator,
           image_size: int = 64) -> Image.Image:
    """Draw one shape; returns an RGB PIL image (image_size, image_size).

    The shape's mask is drawn at 4x and downsampled, so edges are antialiased like photos rather than
    aliased like pixel art; the background is drawn at the final size.
    """
    scale = 4
    side = image_size * scale
    background = Image.fromarray(_background(rng, image_size))
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    r = SIZES[size] * side / 2 * rng.uniform(0.9, 1.1)
    row, col = cell
    # Cell centres at 1/6, 3/6, 5/6 of the side, jittered, clamped so the shape stays inside the image.
    cx = float(np.clip((2 * col + 1) / 6 * side + rng.uniform(-0.05, 0.05) * side, r * 1.25, side - r * 1.25))
    cy = float(np.clip((2 * row + 1) / 6 * side + rng.uniform(-0.05, 0.05) * side, r * 1.25, side - r * 1.25))
    jitter = rng.integers(-12, 13, size=3)
    fill = tuple(int(v) for v in np.clip(np.array(COLOURS[colour]) + jitter, 0, 255))
    pts = _shape_points(shape, cx, cy, r, rng.uniform(-0.25, 0.25))
    if pts is None:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    else:
        draw.polygon(pts, fill=255)
    mask = mask.resize((image_size, image_size), Image.BOX)
    return Image.composite(Image.new("RGB", (image_size, image_size), fill), background, mask)


def caption(colour: str, shape: str, cell: Tuple[int, int], size: str, rng: np.random.Generator) -> str:
    """A caption naming the colour (always by its class name) and, in varied words, shape/position/size."""
    form = CAPTION_FORMS[int(rng.integers(len(CAPTION_FORMS)))]
    words = SHAPE_WORDS[shape]
    where = POSITIONS[cell]
    text = form.format(colour=colour, shape=words[int(rng.integers(len(words)))], where=where,
                       where_dash=where.replace(" ", "-"), size=size)
    return re.sub(r"\ba (?=[aeiou])", "an ", text)


def _attributes(rng: np.random.Generator) -> Tuple[int, int, Tuple[int, int], str]:
    colour = int(rng.integers(len(COLOURS)))
    shape = int(rng.integers(len(SHAPES)))
    cell = list(POSITIONS)[int(rng.integers(len(POSITIONS)))]
    size = list(SIZES)[int(rng.integers(len(SIZES)))]
    return colour, shape, cell, size


def _samples(n: int, seed: int, stream: int, image_size: int, prefix: str) -> Iterator[Dict]:
    colours = list(COLOURS)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, stream])
    for i in range(n):
        c, s, cell, size = _attributes(rng)
        yield {"key": f"{prefix}{i:07d}", "image": render(colours[c], SHAPES[s], cell, size, rng, image_size),
               "caption": caption(colours[c], SHAPES[s], cell, size, rng), "label": c,
               "json": {"colour": colours[c], "shape": SHAPES[s], "position": POSITIONS[cell], "size": size}}


def _progress(iterable, total: int, desc: str, show: bool):
    if not show:
        return iterable

    return tqdm(iterable, total=total, desc=desc, unit="img", leave=False)


def _write_folder(root: str, classes: List[str], templates: Tuple[str, ...], per_class: int,
                  make, rng: np.random.Generator, image_size: int, show: bool, desc: str) -> None:
    make_folder(root)  # every write relative to the held --out folder (`OutputManifest.claim`)
    atomic_write_text(Path(root) / "classnames.txt", "\n".join(classes) + "\n")
    atomic_write_text(Path(root) / "templates.txt", "\n".join(templates) + "\n")
    jobs = [(k, i) for k in range(len(classes)) for i in range(per_class)]
    for k, i in _progress(jobs, len(jobs), desc, show):
        folder = os.path.join(root, classes[k])
        make_folder(folder)
        with new_file(folder, f"{i:04d}.png") as f:
            make(k, rng).save(f, format="PNG")


def _demo_files(colours: List[str], n_train: int, n_val: int, n_zeroshot: int, shard_size: int) -> List[str]:
    """Every file `make_demo_data` writes, relative to its folder (shards with their temporary names)."""
    files = []
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(-(-n // shard_size)):
            files += [f"{split}/shard-{i:06d}.tar", f"{split}/shard-{i:06d}.tar.tmp"]
        files.append(f"{split}/classnames.txt")
    for task, classes in (("colour", colours), ("shape", list(SHAPES))):
        files += [f"zeroshot/{task}/classnames.txt", f"zeroshot/{task}/templates.txt"]
        files += [f"zeroshot/{task}/{c}/{i:04d}.png" for c in classes for i in range(n_zeroshot)]
    return files


def make_demo_data(out_dir: str, seed: int = 0, n_train: int = 20000, n_val: int = 500, image_size: int = 64,
                   n_zeroshot: int = 50, shard_size: int = 2000, progress: bool = True) -> Dict[str, str]:
    """Generate the demo dataset under `out_dir`; deterministic from `seed`.

    Writes ``train/shard-*.tar`` and ``val/shard-*.tar`` (JPEG images, ``.txt`` captions, ``.cls`` = colour
    index, ``.json`` attributes), and ImageFolders ``zeroshot/colour/<colour>/*.png`` and
    ``zeroshot/shape/<shape>/*.png``, each with ``classnames.txt`` and ``templates.txt``, and the list of those
    files (``mmcl-manifest.json``). `out_dir` must be new, empty or an earlier demo's (ConfigError otherwise).

    Returns:
        {"train": shard spec, "val": shard spec, "zeroshot_colour": dir, "zeroshot_shape": dir,
         "classnames": colour classnames file}.
    """
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_zeroshot", n_zeroshot),
                        ("image_size", image_size)):
        if value <= 0:
            raise DataError(f"{name} must be > 0 (got {value})")
    colours = list(COLOURS)
    # `out_dir` must be new, empty or an earlier demo's (its manifest lists the demo's files): the files of an
    # earlier, larger demo are deleted, and nothing else is ever replaced or deleted.
    owned = OutputManifest.claim(out_dir, "demo-data")
    planned = _demo_files(colours, n_train, n_val, n_zeroshot, shard_size)
    # The demo is made once: DONE, written last, records the settings; the same settings find it and stop.
    settings = dict(seed=seed, n_train=n_train, n_val=n_val, image_size=image_size, n_zeroshot=n_zeroshot,
                    shard_size=shard_size)
    done = os.path.join(out_dir, DONE)
    if _read_json(done) == settings and all(os.path.isfile(os.path.join(out_dir, f)) for f in planned
                                            if not f.endswith(".tmp")):
        if progress:
            say(f"{out_dir} holds this demo already (seed {seed}, {n_train} training pairs): not written again")
        return _demo_paths(out_dir, n_train, n_val, shard_size)
    owned.will_write(planned + [DONE])
    owned.keep_only(planned + [DONE])
    unlink_inside(out_dir, DONE)
    # Independent RNG streams per split, so changing n_train leaves val and zero-shot images unchanged.
    for split, n, stream in (("train", n_train, 1), ("val", n_val, 2)):
        folder = os.path.join(out_dir, split)
        make_folder(folder)
        with ShardWriter(folder, shard_size=shard_size, prefix="shard", image_format="jpg", quality=92) as w:
            for sample in _progress(_samples(n, seed, stream, image_size, split[0]), n, f"demo {split}", progress):
                w.write(sample)
        w.close()
        atomic_write_text(Path(folder) / "classnames.txt", "\n".join(colours) + "\n")

    def colour_image(k: int, rng: np.random.Generator) -> Image.Image:
        _, s, cell, size = _attributes(rng)
        return render(colours[k], SHAPES[s], cell, size, rng, image_size)

    def shape_image(k: int, rng: np.random.Generator) -> Image.Image:
        c, _, cell, size = _attributes(rng)
        return render(colours[c], SHAPES[k], cell, size, rng, image_size)

    zs = os.path.join(out_dir, "zeroshot")
    _write_folder(os.path.join(zs, "colour"), colours, COLOUR_TEMPLATES, n_zeroshot, colour_image,
                  np.random.default_rng([seed & 0xFFFFFFFF, 3]), image_size, progress, "demo zero-shot colour")
    _write_folder(os.path.join(zs, "shape"), list(SHAPES), SHAPE_TEMPLATES, n_zeroshot, shape_image,
                  np.random.default_rng([seed & 0xFFFFFFFF, 4]), image_size, progress, "demo zero-shot shape")
    atomic_write_text(Path(done), json.dumps(settings))
    return _demo_paths(out_dir, n_train, n_val, shard_size)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _demo_paths(out_dir: str, n_train: int, n_val: int, shard_size: int) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for split, n in (("train", n_train), ("val", n_val)):
        last = -(-n // shard_size) - 1
        out[split] = os.path.join(out_dir, split, "shard-{000000..%06d}.tar" % last if last else "shard-000000.tar")
    zs = os.path.join(out_dir, "zeroshot")
    out["zeroshot_colour"] = os.path.join(zs, "colour")
    out["zeroshot_shape"] = os.path.join(zs, "shape")
    out["classnames"] = os.path.join(zs, "colour", "classnames.txt")
    return out
