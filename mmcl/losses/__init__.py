"""Contrastive objectives for image-text pretraining.

The losses import torch and nothing else of mmcl; bad tensors or arguments raise `LossInputError` (a
ValueError). Every loss is a pure function of L2-normalised features ``(B, D)`` and the already-exponentiated logit
scale ``s`` (a 0-dim tensor that carries gradient to the learned temperature ``t = log s``).

Distributed layout. The functions never read rank or world size. To train on a global batch split over
ranks, a caller gathers the features of all ranks (`gather_batch`, which keeps the gradient and sums it back in
backward) and passes them as one `Gathered` (``gathered=``): the gathered features ``all_image_features`` /
``all_text_features`` (and labels, teacher features) with ``offset``, the global index of this rank's first row.
The local features are then the rows (queries), the gathered ones the columns (keys), and the positive of local
row ``i`` is global column ``offset + i``.
Each rank's loss is the mean over its own rows, so the mean over ranks equals the global-batch loss; with
the summing all-gather backward each rank holds ``W`` times the global gradient of its own features and
DDP's averaging of parameter gradients turns that into exactly the global-batch gradient.

A variable number of pairs per process (batches filled to a token budget, NaFlex). Each rank pads its n <= C
pairs to a fixed capacity C (`pad_pairs`, which returns the (C,) mask ``valid`` of the real rows) and passes
``valid`` to `gather_batch` (whose `Gathered` then carries ``all_valid``) and to the objective (or to `clip_loss` /
`siglip_loss`). The terms in `VARIABLE_PAIR_TERMS` (clip, siglip) then give exactly the loss and gradients of the
global set of real pairs: padded columns enter no log-sum-exp, padded rows and pairs add nothing, and each rank's
loss is its sum over its real rows times W / N, N the global number of real pairs counted on the device. The other
terms refuse ``valid``.

Negatives from the data (NegCLIP). A sample may carry negative captions; their features come as one
`DataNegatives` ((n, K, D) and the (n, K) mask of the real ones, a variable number per sample) to the objective
(``negatives=``) or to `clip_loss` / `siglip_loss`. Each adds a column to its own image's row of the image-to-text
logits only (`data_negatives`); since no other row reads it, it is not gathered, and the split over ranks still
gives the loss and gradients of one process.

Memory. ``chunk_size`` switches the softmax losses (clip, supcon, debiased, hard-negative) to a tiled
computation (`TiledLogSumExp`): tiles of ``chunk_size`` rows (by up to `tile_elements` / chunk_size columns: 2^22
logits on a CPU, 2^24-2^28 on a GPU by its memory) of the logits are formed, reduced into row and column sums and
dropped; backward recomputes each tile once. Extra
memory is O((n + M) * D) plus two tiles instead of O(n * M), with the same value and gradients as the dense
computation, which stays in the package as the specification. SigLIP's sum over pairs is tiled the same way
(`TiledSigmoidPairs`, each tile recomputed once in backward), and MoCHi's real negatives and queue too (its
synthetic negatives are n x (s + s') x D).

`ContrastiveObjective` combines the weighted terms from plain numbers (training builds it from the config
with `mmcl.training.step.objective_from_config`); its terms are one table, a row per term (`objective`). The caller
gathers the global batch (`gather_batch`) and passes it in. The objective holds the only state: the MoCHi feature
queues, the random generator used to synthesise negatives, and the global contrastive term's per-sample estimates
(`GlobalEstimates`).

Layout: `inputs` (the `Gathered` batch and the shared argument checks), `tiling` (the shared autograd
machinery), `clip`, `supcon`, `siglip`, `reweighted` (debiased and hard-negative), `mochi`, `distill` (KL from a
teacher's distributions), `global_contrastive` (SogCLR / FastCLIP), `geometry` (align, uniform), `distributed`
(gather), `variable_pairs` (padding and the masks of a variable number of pairs per process), `data_negatives`
(negative captions from the data), `sample_terms` (terms scored sample by sample from the model's outputs) and
`caption` (the captioning term), `self_distill` (SILC's local-to-global consistency) and `masked` (TIPS' masked
prediction), `objective` and
`errors`.
"""

from .caption import caption_losses
from .clip import clip_loss, infonce_rows, logsumexp_rows
from .data_negatives import DATA_NEGATIVE_TERMS, DataNegatives
from .distill import TeacherFeatures, distill_loss
from .distributed import gather_batch, gather_features
from .errors import LossInputError
from .geometry import align_loss, uniform_loss
from .global_contrastive import GlobalEstimates, gamma_at, global_contrastive_loss
from .inputs import Gathered
from .masked import masked_losses
from .mochi import FeatureQueue, mochi_loss
from .objective import NOT_IN_VALIDATION, SAMPLE_TERMS, TERMS, TRAINING_VIEW_TERMS, ContrastiveObjective
from .reweighted import debiased_clip_loss, hard_negative_clip_loss
from .sample_terms import SampleLosses, joined, sample_mean
from .self_distill import next_center, self_distill_losses, teacher_targets
from .short_caption import short_caption_loss
from .siglip import TiledSigmoidPairs, siglip_loss
from .supcon import supcon_loss
from .tiling import TiledLogSumExp
from .variable_pairs import VARIABLE_PAIR_TERMS, pad_pairs

__all__ = [
    "TiledLogSumExp",
    "TiledSigmoidPairs",
    "logsumexp_rows",
    "infonce_rows",
    "clip_loss",
    "supcon_loss",
    "siglip_loss",
    "debiased_clip_loss",
    "hard_negative_clip_loss",
    "mochi_loss",
    "distill_loss",
    "TeacherFeatures",
    "global_contrastive_loss",
    "GlobalEstimates",
    "gamma_at",
    "align_loss",
    "uniform_loss",
    "gather_features",
    "gather_batch",
    "pad_pairs",
    "VARIABLE_PAIR_TERMS",
    "DataNegatives",
    "DATA_NEGATIVE_TERMS",
    "Gathered",
    "FeatureQueue",
    "ContrastiveObjective",
    "TERMS",
    "SAMPLE_TERMS",
    "NOT_IN_VALIDATION",
    "TRAINING_VIEW_TERMS",
    "SampleLosses",
    "caption_losses",
    "short_caption_loss",
    "self_distill_losses",
    "masked_losses",
    "teacher_targets",
    "next_center",
    "joined",
    "sample_mean",
    "LossInputError",
]
