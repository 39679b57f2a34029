"""Long-CLIP's short-caption term (Zhang et al. 2024, "Long-CLIP: Unlocking the Long-Text Capability of CLIP"):
fine-tuning on long captions alone teaches the image features every detail a long caption names, and a short
caption ("a handwritten seven"), which names only the main thing, then matches them less well. Long-CLIP adds a
second, coarse alignment: each image's features reduced to the batch's main directions ("primary component
matching") against the features of a short caption of the same image.

`short_caption_loss`: the global batch's (normalised) image features ``X`` (M, D) are centred on their mean ``mu``,
the top ``k`` principal directions ``V`` (D, k) of the centred rows are found (the eigenvectors of the largest
eigenvalues of ``Xc^T Xc``, in float64 where the device has it), and each image is rebuilt from them,
``x' = (x - mu) V V^T + mu``, normalised, and scored against the short captions' normalised features by the
symmetric InfoNCE loss (`clip_loss`, tiled with ``chunk_size``).

Choices, each also in docs/finetuning.md (Captions longer than the text tower's positions):
* The basis ``V`` carries no gradient; the gradient flows through the projection and the mean. Long-CLIP
  back-propagates through a singular value decomposition, whose gradient has terms in ``1 / (s_i^2 - s_j^2)``
  that blow up when two singular values come close (at random initialisation, or in bf16); the directions are a
  statistic of the batch, like a batch norm's, and the loss's value is the same.
* The basis is the global batch's: with several processes it is found from the gathered features on every rank
  alike (the same numbers everywhere), so two processes give one process's loss and gradients. Long-CLIP's code
  takes each GPU's own batch.
* ``k`` larger than the batch's rank (M - 1 after centring) keeps every direction there is: the rebuilt features
  are then the features themselves.
* Finding the basis is one symmetric eigendecomposition of a D x D matrix per step; on CUDA, torch checks its
  result on the host, so the term costs one device synchronisation per step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .clip import clip_loss
from .errors import LossInputError
from .inputs import Gathered, check_pair
from .precision import float32_math, scaled_products


def principal_basis(x: Tensor, components: int) -> Tensor:
    """(D, k) orthonormal columns: the top `components` principal directions of the rows of `x` (M, D) about their
    mean, without gradient, in `x`'s dtype (found in float64 where the device has it, else float32). k is
    `components` capped at D."""
    if components < 1:
        raise LossInputError(f"the short-caption term keeps at least 1 principal component (got {components})")
    with torch.no_grad():
        work = torch.float32 if x.device.type == "mps" else torch.float64
        xc = x.detach().to(work)
        xc = xc - xc.mean(dim=0, keepdim=True)
        _, vectors = torch.linalg.eigh(xc.T @ xc)  # ascending eigenvalues
        k = min(int(components), x.shape[1])
        return vectors[:, -k:].flip(1).to(x.dtype)


def primary_components(x: Tensor, basis: Tensor) -> Tensor:
    """Long-CLIP's rebuilt features: `x` (M, D) centred on its mean, projected on `basis` (D, k) and back, the mean
    added again, then L2-normalised (differentiable in `x`; `basis` is a constant)."""
    mean = x.mean(dim=0, keepdim=True)
    # the products in float32 at least, forward and backward, under any autocast (`scaled_products`)
    rebuilt = scaled_products(scaled_products(x - mean, basis.T), basis) + mean
    return torch.nn.functional.normalize(rebuilt, dim=-1)


@float32_math
def short_caption_loss(image: Tensor, short_text: Tensor, logit_scale: Tensor, components: int = 32,
                       chunk_size: Optional[int] = None, gathered: Optional[Gathered] = None,
                       all_short_text: Optional[Tensor] = None) -> Tensor:
    """The short-caption term over this rank's rows (see the module docstring).

    Args:
        image: (n, D) this rank's normalised image features.  short_text: (n, D) the normalised features of the same
            images' short captions.  logit_scale: 0-dim, the run's learned scale (Long-CLIP's one scale for both).
        components: the principal directions kept (Long-CLIP: 32).
        chunk_size: None (dense) or the InfoNCE's tile size.
        gathered: the global batch (`gather_batch`); its image features (with their gradient back to each owner)
            give the basis, the mean and the rebuilt columns. Then `all_short_text` (M, D) are the global batch's
            short captions, gathered with their gradient.
    Returns the 0-dim loss of this rank's rows: with several ranks, DDP's average of their gradients is one
    process's on the global batch.
    """
    check_pair(image, short_text)
    if gathered is None:
        return clip_loss(primary_components(image, principal_basis(image, components)), short_text, logit_scale,
                         chunk_size)
    if all_short_text is None:
        raise LossInputError("the short-caption term on several processes needs the gathered short captions")
    all_image = gathered.all_image_features
    rebuilt = primary_components(all_image, principal_basis(all_image, components))
    n, offset = image.shape[0], gathered.offset
    columns = Gathered(rebuilt, all_short_text, offset=offset, world_size=gathered.world_size)
    return clip_loss(rebuilt[offset:offset + n], short_text, logit_scale, chunk_size, gathered=columns)
