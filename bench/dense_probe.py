"""A dense probe of an image tower: images with known per-pixel labels, the frozen tower's patch tokens, a linear
classifier per patch, mIoU on held-out images. Used by bench/siglip2_digits.py; each part is usable alone.

- `Digits`: scikit-learn's digits split by index (every fifth image held out), fixed.
- `scene`: digits pasted at random places and sizes on a coloured background; returns the image, its label map
  (each pixel the class of the digit whose square covers it, `BACKGROUND` elsewhere) and a caption naming each
  digit and where it is ("a seven at the top left").
- `patch_labels`: a label map cut into the tower's patches, each patch labelled by the majority of its pixels.
- `patch_tokens`: the image tower's last-block patch tokens, (N, h, w, C), through open_clip's
  ``VisionTransformer.forward_intermediates`` (CLIP's and CoCa's image tower alike).
- `fit_probe` / `miou`: a softmax-regression classifier on standardised patch tokens, and the mean over classes
  of the intersection over union of its predictions (classes absent from both prediction and truth left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
BACKGROUND = 10  # the label of a pixel no digit covers; digits are labelled by their value 0..9
N_CLASSES = 11
# A square's centre in thirds of the image: (row, column) -> the words for it.
PLACES = {(0, 0): "top left", (0, 1): "top", (0, 2): "top right", (1, 0): "left", (1, 1): "centre",
          (1, 2): "right", (2, 0): "bottom left", (2, 1): "bottom", (2, 2): "bottom right"}
# How a caption names one digit: as a word or as a numeral, in several phrasings (`scene`).
NAMINGS = ["{a} {w}", "a handwritten {w}", "the digit {w}", "the numeral {d}", "{a} {d}"]


@dataclass(frozen=True)
class Digits:
    """scikit-learn's digits (1797 images of 8x8, ink 0..16), split by index: every fifth image (index % 5 == 0) is
    held out (360), the rest (1437) train. Fixed, so every arm and seed sees the same split."""

    images: np.ndarray  # (N, 8, 8) float, ink in [0, 1]
    labels: np.ndarray  # (N,) int
    train: np.ndarray  # indices
    test: np.ndarray

    @classmethod
    def load(cls) -> "Digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        idx = np.arange(len(d.target))
        return cls(d.images / 16.0, d.target.astype(np.int64), idx[idx % 5 != 0], idx[idx % 5 == 0])


def ink_image(ink: np.ndarray, size: int, background=(255, 255, 255), colour=(0, 0, 0)):
    """An 8x8 ink array upscaled (bilinear) to `size` px, as `colour` ink over `background`: a PIL RGB image."""
    from PIL import Image

    alpha = np.asarray(Image.fromarray((ink * 255).astype(np.uint8), "L").resize((size, size), Image.BILINEAR),
                       dtype=np.float32)[..., None] / 255.0
    pixels = np.asarray(background, np.float32) * (1 - alpha) + np.asarray(colour, np.float32) * alpha
    return Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8), "RGB")


def place_words(box: Tuple[int, int, int, int], image_size: int) -> str:
    """Where a square (top, left, height, width) is: the third of the image its centre falls in, as words."""
    top, left, h, w = box
    row = min(2, int(3 * (top + h / 2) / image_size))
    col = min(2, int(3 * (left + w / 2) / image_size))
    return PLACES[(row, col)]


def scene(rng: np.random.Generator, digits: Digits, pool: np.ndarray, image_size: int, n_digits: int,
          sizes: Tuple[int, int]) -> Tuple["object", np.ndarray, str]:
    """`n_digits` digits drawn from the indices `pool`, each pasted as a square of a side drawn from `sizes`
    (inclusive) at a random place not overlapping the others (a digit that finds no free place after 50 tries is
    left out), in a dark colour, on a light background with faint noise.

    Returns (PIL RGB image, label map (image_size, image_size) int64, caption): the label map holds each digit's
    class over its square and `BACKGROUND` elsewhere; the caption names each digit and its place, in the order
    pasted, joined by "and".
    """
    from PIL import Image

    bg = rng.integers(170, 256, size=3)
    noise = rng.normal(0, 6, size=(image_size, image_size, 3))
    canvas = Image.fromarray((bg + noise).round().clip(0, 255).astype(np.uint8), "RGB")
    labels = np.full((image_size, image_size), BACKGROUND, dtype=np.int64)
    parts: List[str] = []
    for _ in range(n_digits):
        side = int(rng.integers(sizes[0], sizes[1] + 1))
        for _try in range(50):
            top, left = (int(v) for v in rng.integers(0, image_size - side + 1, size=2))
            if (labels[top:top + side, left:left + side] == BACKGROUND).all():
                break
        else:
            continue
        i = int(pool[rng.integers(len(pool))])
        label = int(digits.labels[i])
        ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
        patch = np.asarray(canvas, dtype=np.float32)[top:top + side, left:left + side]
        alpha = np.asarray(Image.fromarray((digits.images[i] * 255).astype(np.uint8), "L")
                           .resize((side, side), Image.BILINEAR), dtype=np.float32)[..., None] / 255.0
        mixed = patch * (1 - alpha) + np.asarray(ink, np.float32) * alpha
        canvas.paste(Image.fromarray(mixed.round().clip(0, 255).astype(np.uint8), "RGB"), (left, top))
        labels[top:top + side, left:left + side] = label
        naming = NAMINGS[int(rng.integers(len(NAMINGS)))].format(w=WORDS[label], d=label,
                                                                 a="an" if label == 8 else "a")
        parts.append(f"{naming} at the {place_words((top, left, side, side), image_size)}")
    return canvas, labels, " and ".join(parts)


def patch_labels(label_map: np.ndarray, patch: int) -> np.ndarray:
    """(H, W) pixel labels -> (H // patch, W // patch): each patch's most frequent label (a tie goes to the
    smallest label). H and W must be multiples of `patch`."""
    h, w = label_map.shape
    if h % patch or w % patch:
        raise ValueError(f"a {h}x{w} label map does not split into {patch} px patches")
    blocks = label_map.reshape(h // patch, patch, w // patch, patch).transpose(0, 2, 1, 3).reshape(-1, patch * patch)
    counts = np.stack([np.bincount(b, minlength=int(label_map.max()) + 1) for b in blocks])
    return counts.argmax(1).reshape(h // patch, w // patch)


def image_tower(model):
    """The image tower of an open_clip CLIP or CoCa model (``model.visual``), if it gives patch tokens."""
    visual = getattr(model, "visual", None)
    if visual is None or not hasattr(visual, "forward_intermediates"):
        raise TypeError(f"{type(model).__name__}'s image tower has no forward_intermediates (open_clip's "
                        f"VisionTransformer has): no patch tokens to probe")
    return visual


def patch_tokens(model, images, batch_size: int = 128):
    """The image tower's last-block patch tokens (before its final norm and pooling), (N, h, w, C) float32.

    `images`: (N, 3, H, W) float tensor, already preprocessed as the model expects.
    """
    import torch

    visual = image_tower(model)
    was_training = visual.training
    visual.eval()
    out = []
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            maps = visual.forward_intermediates(images[start:start + batch_size], indices=1,
                                                intermediates_only=True)["image_intermediates"][-1]
            out.append(maps.permute(0, 2, 3, 1).float())  # NCHW -> NHWC
    visual.train(was_training)
    return torch.cat(out)


def fit_probe(features, labels, n_classes: int, steps: int = 300, lr: float = 0.05, weight_decay: float = 1e-4,
              seed: int = 0):
    """A softmax-regression classifier of (n, C) features to labels in [0, n_classes), full batch, Adam; the
    features standardised by their own mean and std. Returns a function (m, C) features -> (m,) predicted labels."""
    import torch

    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(x.shape[1], n_classes, generator=gen) * 0.01).requires_grad_()
    bias = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=lr, weight_decay=weight_decay)
    xs = (x - mean) / std
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(xs @ weight + bias, y).backward()
        opt.step()
    weight, bias = weight.detach(), bias.detach()

    def predict(f):
        f = torch.as_tensor(f, dtype=torch.float32)
        return (((f - mean) / std) @ weight + bias).argmax(1)

    return predict


def confusion(pred, target, n_classes: int) -> np.ndarray:
    """(n_classes, n_classes) counts: row the true label, column the predicted one."""
    pred, target = np.asarray(pred).ravel(), np.asarray(target).ravel()
    return np.bincount(target * n_classes + pred, minlength=n_classes * n_classes).reshape(n_classes, n_classes)


def miou(conf: np.ndarray) -> Tuple[float, np.ndarray]:
    """(mean IoU, per-class IoU) from a confusion matrix; a class neither true nor predicted anywhere has IoU nan
    and is left out of the mean."""
    conf = np.asarray(conf, dtype=np.float64)
    inter = np.diag(conf)
    union = conf.sum(0) + conf.sum(1) - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / union, np.nan)
    return float(np.nanmean(iou)), iou


def labelled_set(rng: np.random.Generator, digits: Digits, pool: np.ndarray, n: int, image_size: int,
                 n_digits: Tuple[int, int] = (1, 3), sizes: Optional[Tuple[int, int]] = None
                 ) -> Tuple[list, np.ndarray]:
    """`n` scenes of `n_digits` (inclusive range) digits from `pool`: (PIL images, (n, H, W) label maps)."""
    sizes = sizes or (image_size // 4, image_size // 2)
    images, maps = [], []
    for _ in range(n):
        img, lab, _ = scene(rng, digits, pool, image_size, int(rng.integers(n_digits[0], n_digits[1] + 1)), sizes)
        images.append(img)
        maps.append(lab)
    return images, np.stack(maps)


def dense_probe(model, preprocess, train: Tuple[Sequence, np.ndarray], test: Tuple[Sequence, np.ndarray],
                n_classes: int = N_CLASSES, steps: int = 300, seed: int = 0) -> Dict[str, float]:
    """Fit `fit_probe` on the patches of `train` (images, label maps) and score `test`'s patches: mIoU over the
    classes, per-patch accuracy, and the share of background patches (what predicting background everywhere scores
    as accuracy)."""
    import torch

    def tokens_and_labels(images, maps):
        feats = patch_tokens(model, torch.stack([preprocess(im) for im in images]))
        _, h, w, _ = feats.shape
        patch = maps.shape[1] // h
        if maps.shape[1] != h * patch or maps.shape[2] != w * patch:
            raise ValueError(f"label maps of {maps.shape[1:]} px do not match the tower's {h}x{w} patch grid "
                             f"(images must be at the model's own size)")
        labels = np.stack([patch_labels(m, patch) for m in maps])
        return feats.reshape(-1, feats.shape[-1]), labels.reshape(-1)

    x_train, y_train = tokens_and_labels(*train)
    x_test, y_test = tokens_and_labels(*test)
    predict = fit_probe(x_train, y_train, n_classes, steps=steps, seed=seed)
    pred = predict(x_test).numpy()
    mean_iou, per_class = miou(confusion(pred, y_test, n_classes))
    return {"dense_miou": round(mean_iou, 4), "dense_patch_acc": round(float((pred == y_test).mean()), 4),
            "dense_background_share": round(float((y_test == BACKGROUND).mean()), 4),
            "dense_iou_background": round(float(per_class[BACKGROUND]), 4)}
