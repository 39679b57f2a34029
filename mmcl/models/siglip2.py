"""The model's side of SigLIP 2's second stage (Tschannen et al. 2025): SILC's self-distillation (``loss.self_distill``)
and TIPS' masked prediction (``loss.masked``) need projection heads on the image tower, an EMA teacher of the tower
and the heads, local crops and masked views. `Siglip2` holds them and adds the student's scores and the teacher's
targets to the model's forward dict, which the objective's sample terms read (`mmcl.losses.self_distill`,
`mmcl.losses.masked`).

- The heads (`Siglip2Heads`: DINO's projection head for the pooled embedding, one for the patch tokens, the mask
  token) are a submodule of the model, ``model.siglip2_heads``: the optimiser, DDP, FSDP and accelerate's
  checkpoints see them as any parameter. They are training parts only: `detach` takes them off before ``model/``
  is saved, and a checkpoint read as a model leaves them out (`HEADS`), so exports are the student's CLIP.
- The teacher is the student's image tower and heads averaged by `mmcl.training.ema.WeightEMA`'s rule, run as a
  copy whose parameters are the average's own tensors (updated in place, never trained, in eval mode, without
  autograd). It is saved in the main process's rank state of each checkpoint (`state_dict`).
- When: each term starts at its ``start_fraction`` of the run (SigLIP 2: 0.8, the last 20 %). At the first step of
  the earlier term the heads are initialised afresh from the run's seed and the teacher starts as a copy of the
  student (SigLIP 2: "initializing the teacher with the student's parameters ... heads randomly"). Before that no
  crop is made, no teacher exists or runs, and the features are unchanged: the heads join the graph with a zero
  weight only (DDP expects a gradient for every parameter, and AdamW then counts their steps alike in one process
  and in several).
- Crops, flips and masks are drawn on the device from a counter-based hash of (seed, step, the sample's row in the
  step's global batch) (`mmcl.models.flip.patch_keys`), as FLIP's masks: a resumed run, two processes, several
  micro-batches and accumulation's two passes over a micro-batch draw the same ones, with no host generator and no
  host read.
- Local crops are cut from the batch's image on the device (bilinear, ``grid_sample``), not from the original
  image in the data workers: before the start they cost nothing at all, and the data stream is the one SigLIP
  alone reads. At a model's image size the crops see fewer source pixels than DINO's (they are up-sampled).
- The teacher's centres (running means of its scores, one per term) move once per applied step by the global
  batch's mean: each process sums its teacher scores over the micro-batches of the step (once per micro-batch:
  only in the forward that builds the graph), and `after_step` all-reduces the sums (one collective, on the device).

Only open_clip ViT image towers (a class token and a learned position embedding) are supported: the token path
(`vit_tokens`) embeds, masks and pools them; any other tower is refused in one line.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..losses import next_center, teacher_targets
from .clip_classes import HEADS, without_heads
from .flip import mask_seed, patch_keys
from .resize import resize_grid_embedding, vit_tower

_M32 = 0xFFFFFFFF
_CROP_DRAWS = 5  # per local crop: area, aspect ratio, x, y, flip
_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # DINO's local crops' aspect-ratio range (torchvision's default)


class ProjectionHead(nn.Module):
    """DINO's head (Caron et al. 2021): a three-layer MLP (GELU) to an L2-normalised bottleneck, then scores against
    `prototypes` weight-normalised prototypes (DINO's last layer with its gain fixed at 1)."""

    def __init__(self, in_dim: int, hidden: int, bottleneck: int, prototypes: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.prototypes = nn.Linear(bottleneck, prototypes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.prototypes.weight, dim=-1))


class Siglip2Heads(nn.Module):
    """The student's heads: ``image`` (the pooled embedding's, SILC), ``patch`` and ``mask_token`` (TIPS), each None
    where its term is off."""

    def __init__(self, embed_dim: int, width: int, hidden: int, bottleneck: int, image_prototypes: Optional[int],
                 patch_prototypes: Optional[int]):
        super().__init__()
        self.image = None if image_prototypes is None else ProjectionHead(embed_dim, hidden, bottleneck,
                                                                          image_prototypes)
        self.patch = None if patch_prototypes is None else ProjectionHead(width, hidden, bottleneck, patch_prototypes)
        self.mask_token = None if patch_prototypes is None else nn.Parameter(torch.zeros(width))

    @torch.no_grad()
    def reset(self, seed: int) -> None:
        """Initialise every weight from `seed` (truncated normal, std 0.02, DINO's; zero biases and mask token):
        the same on every process and in a resumed run."""
        g = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
        for name, p in sorted(self.named_parameters()):
            if p.dim() == 2:
                value = torch.nn.init.trunc_normal_(torch.empty(p.shape), std=0.02, a=-0.04, b=0.04, generator=g)
                p.copy_(value.to(p.dtype))
            else:
                p.zero_()


class _Student(nn.Module):
    """The image tower and the heads under one module: what the teacher averages (its parameter names)."""

    def __init__(self, visual: nn.Module, heads: Siglip2Heads):
        super().__init__()
        self.visual, self.heads = visual, heads


def vit_tokens(visual: nn.Module, x: torch.Tensor, mask_idx: Optional[torch.Tensor] = None,
               mask_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pooled embedding (n, D), patch tokens (n, P, width)) of an open_clip ViT on images `x` (n, 3, H, W) of any
    size its patch size divides (the position embedding resized, `resize_grid_embedding`), without patch dropout;
    with `mask_idx` (n, M) the patch embeddings at those positions are replaced by `mask_token` (iBOT, TIPS) before
    the position embedding is added. open_clip's ``VisionTransformer`` forward otherwise: class token, ``ln_pre``,
    the transformer, its pooling (``ln_post``) and projection."""
    x = visual.conv1(x)  # (n, width, gh, gw)
    n, width, gh, gw = x.shape
    x = x.reshape(n, width, gh * gw).permute(0, 2, 1)  # (n, P, width)
    if mask_idx is not None:
        masked = torch.zeros(n, gh * gw, 1, dtype=x.dtype, device=x.device).scatter_(
            1, mask_idx.unsqueeze(-1), 1.0)
        x = x * (1 - masked) + masked * mask_token.to(x.dtype)
    pos = resize_grid_embedding(visual.positional_embedding, (gh, gw))
    cls = visual.class_embedding.to(x.dtype).reshape(1, 1, -1).expand(n, 1, -1)
    x = torch.cat([cls, x], dim=1) + pos.to(x.dtype)
    x = visual.transformer(visual.ln_pre(x))
    pooled, tokens = visual._pool(x)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    return pooled, tokens


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms in [0, 1) from `patch_keys`' keys (their 32 hashed bits)."""
    return ((keys >> 16) & _M32).to(torch.float32) / float(2 ** 32)


def local_crops(images: torch.Tensor, u: torch.Tensor, size: int, scale: Sequence[float]) -> torch.Tensor:
    """(n * L, C, size, size): L random resized crops of each image of `images` (n, C, H, W), bilinear, from
    uniforms `u` (n, L, 5): the area fraction uniform in `scale`, the aspect ratio log-uniform in (3/4, 4/3), the
    centre uniform where the crop fits, a horizontal flip with probability 1/2. Float32."""
    n, crops = u.shape[:2]
    u = u.reshape(n * crops, _CROP_DRAWS)
    area = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    ratio = torch.exp(math.log(_RATIO[0]) + (math.log(_RATIO[1]) - math.log(_RATIO[0])) * u[:, 1])
    w = torch.sqrt(area * ratio).clamp(max=1.0)  # the crop's share of the image's width and height
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (2 * u[:, 2] - 1) * (1 - w)  # normalised coordinates in [-1, 1]: the crop lies inside the image
    cy = (2 * u[:, 3] - 1) * (1 - h)
    flip = torch.where(u[:, 4] < 0.5, -1.0, 1.0)
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([w * flip, zero, cx], 1), torch.stack([zero, h, cy], 1)], 1)  # (nL, 2, 3)
    src = images.float().unsqueeze(1).expand(n, crops, *images.shape[1:]).reshape(n * crops, *images.shape[1:])
    grid = F.affine_grid(theta, [n * crops, images.shape[1], size, size], align_corners=False)
    return F.grid_sample(src, grid, mode="bilinear", padding_mode="border", align_corners=False)


class _Draws:
    """Each step's seeds for the crops and the masks, and which micro-batch of the step a forward is (the k-th forward
    of a step is micro-batch k mod accum_steps, as for `mmcl.models.flip.SeededPatchDropout`; GradCache's re-run of
    the micro-batches comes after their first pass). A sample's draws are keyed by its row in the step's global batch
    (micro-batch, then process, then place), so one process with the whole batch, several processes and several
    micro-batches draw the same crops and masks for the same sample."""

    STREAMS = 2  # crops, masks

    def __init__(self, seed: int, accum_steps: int):
        self.seed, self.accum_steps = int(seed), int(accum_steps)
        self.seeds = torch.zeros(self.STREAMS, 2, dtype=torch.int64)
        self.turn = 0

    def begin_step(self, step: int, device: torch.device) -> None:
        rows = [[s & _M32, s >> 32] for s in (mask_seed(self.seed + 1 + k, step, 0) for k in range(self.STREAMS))]
        host = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()  # copied while the device works on, not waited for
        self.seeds = host.to(device, non_blocking=True)
        self.turn = 0

    def take(self) -> Tuple[torch.Tensor, int]:
        """(the step's seeds (STREAMS, 2), this forward's micro-batch); the next forward takes the next one."""
        micro = self.turn % self.accum_steps
        self.turn += 1
        return self.seeds, micro


class Siglip2:
    """The heads, teacher, views and schedule of ``loss.self_distill`` and ``loss.masked`` on one model (see the
    module docstring). `attach` builds it and hooks it into the model's forward; the loop calls `begin_step` before
    each step, the step `after_step` after each applied update, and `detach` before ``model/`` is saved.

    Args: the two sections' numbers (``sd``: ``loss.self_distill``, ``mk``: ``loss.masked``, each None when its
    weight is 0), ``shared``: ``loss.self_distill`` whatever its weight (the head sizes and the teacher's decay, which
    loss.masked uses too), the run's steps, seed, process and accumulation."""

    def __init__(self, model: nn.Module, sd: Optional[Any], mk: Optional[Any], total_steps: int, seed: int,
                 rank: int = 0, world_size: int = 1, accum_steps: int = 1, shared: Optional[Any] = None):
        visual = vit_tower(model)
        if visual is None or not callable(getattr(visual, "_pool", None)):
            tower = type(getattr(model, "visual", None)).__name__
            raise ConfigError(f"loss.self_distill and loss.masked need an open_clip ViT image tower (patch tokens, a "
                              f"class token); this model's image tower is {tower}: set their weights to 0")
        shared = sd if shared is None else shared
        self.sd, self.mk = sd, mk
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.starts = {name: start_step(cfg.start_fraction, total_steps)
                       for name, cfg in (("self_distill", sd), ("masked", mk)) if cfg is not None}
        self.start = min(self.starts.values())
        embed_dim = int(visual.output_dim) if visual.proj is not None else int(visual.positional_embedding.shape[1])
        width = int(visual.positional_embedding.shape[1])
        self.heads = Siglip2Heads(embed_dim, width, shared.head_hidden, shared.head_bottleneck,
                                  None if sd is None else sd.prototypes, None if mk is None else mk.prototypes)
        self.heads.reset(self.seed)
        model.add_module(HEADS, self.heads)
        self.patch = int(visual.patch_size[0])
        size = int(visual.image_size[0])
        self.local_size = (sd.local_size or max(self.patch, size // 2 // self.patch * self.patch)) if sd else 0
        if sd is not None and self.local_size % self.patch:
            raise ConfigError(f"loss.self_distill.local_size={self.local_size} is not a multiple of the patch size "
                              f"{self.patch}")
        self.draws = _Draws(seed, accum_steps)
        self.active: Dict[str, bool] = {name: False for name in self.starts}
        self.model = model
        self.student = _Student(visual, self.heads)
        self.teacher: Optional[_Student] = None
        self.ema = None  # the teacher's average (`WeightEMA`), from the start on
        self.ema_decay = float(shared.teacher_ema_decay)
        device = next(model.parameters()).device
        self.centers = {name: torch.zeros(cfg.prototypes, device=device)
                        for name, cfg in (("self_distill", sd), ("masked", mk)) if cfg is not None}
        self.pending = {name: torch.zeros(c.numel() + 1, device=device) for name, c in self.centers.items()}
        self.handle = model.register_forward_hook(self._hook)
        self.make_ema = None  # set by the trainer: decay -> module -> WeightEMA (training code owns the EMA)

    # ------------------------------------------------------------------------------------------ the schedule
    def begin_step(self, step: int, device: torch.device) -> None:
        """Before optimiser step `step` (0-based): the terms due from this step on run; at the first of them the
        heads are initialised afresh and the teacher starts as the student (a resumed run's teacher, loaded from
        its checkpoint, is kept)."""
        for name, start in self.starts.items():
            self.active[name] = step >= start
        if not any(self.active.values()):
            return
        if next(iter(self.centers.values())).device != device:  # built with the model, before it was placed
            self.centers = {k: c.to(device) for k, c in self.centers.items()}
            self.pending = {k: c.to(device) for k, c in self.pending.items()}
        if self.teacher is None:
            self.heads.reset(self.seed)
            self._start_teacher()
        self.draws.begin_step(step, device)

    def _start_teacher(self) -> None:
        self.ema = self.make_ema(self.student, self.ema_decay)
        teacher = copy.deepcopy(self.student)
        teacher.eval()
        params = dict(teacher.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.requires_grad_(False)
            for name, shadow in self.ema.shadow.items():  # the average's own tensors: updated in place
                params[name].data = shadow
        self.teacher = teacher

    @torch.no_grad()
    def after_step(self, skipped: Optional[torch.Tensor] = None) -> None:
        """After an applied optimiser step (`skipped`: the device's flag, 1 where the optimiser skipped it): the
        teacher's average moves towards the student, and each running centre by the step's global mean."""
        if self.teacher is None or not any(self.active.values()):
            return
        self.ema.update(self.student, skipped=skipped)
        weight = None if skipped is None else (skipped == 0).to(torch.float32)
        for name, cfg in (("self_distill", self.sd), ("masked", self.mk)):
            if cfg is None or not self.active[name]:
                continue
            pending = self.pending[name]
            self.centers[name] = next_center(self.centers[name], pending[:-1], pending[-1], cfg.center_momentum,
                                             self.world_size, weight)
            pending.zero_()

    # ------------------------------------------------------------------------------------------ the forward
    def _hook(self, model: nn.Module, args, output):
        if not model.training or not isinstance(output, dict) or not self.starts:
            return output
        images = args[0] if args else None
        if not isinstance(images, torch.Tensor) or images.device.type == "meta":
            return output
        n = images.shape[0]
        if not any(self.active.values()):
            for name in self.starts:  # no item: the term is 0, with nothing computed
                output.update(_empty(name, images))
            output["image_features"] = output["image_features"] + self._unused_zero(())
            return output
        seeds, micro = self.draws.take()
        first = (micro * self.world_size + self.rank) * n  # this process's first row in the step's global batch
        rows = torch.arange(first, first + n, device=images.device, dtype=torch.int64)
        counted = torch.is_grad_enabled()  # GradCache's first pass runs without: each micro-batch counted once
        with torch.no_grad():
            t_pooled, t_tokens = vit_tokens(self.teacher.visual, images)
        used = []
        if "self_distill" in self.starts:
            if self.active["self_distill"]:
                output.update(self._self_distill(images, seeds[0], rows, t_pooled, counted))
                used.append("image")
            else:
                output.update(_empty("self_distill", images))
        if "masked" in self.starts:
            if self.active["masked"]:
                output.update(self._masked(images, seeds[1], rows, t_tokens, counted))
                used += ["patch", "mask_token"]
            else:
                output.update(_empty("masked", images))
        output["image_features"] = output["image_features"] + self._unused_zero(used)
        return output

    def _self_distill(self, images, seeds, rows, t_pooled, counted) -> Dict[str, torch.Tensor]:
        n, crops, sd = images.shape[0], self.sd.local_crops, self.sd
        u = uniforms(patch_keys(seeds, rows, crops * _CROP_DRAWS)).reshape(n, crops, _CROP_DRAWS)
        views = local_crops(images, u, self.local_size, sd.local_scale).to(images.dtype)
        pooled, _ = vit_tokens(self.student.visual, views)
        student = self.heads.image(pooled).reshape(n, crops, -1)
        with torch.no_grad():
            t_logits = self.teacher.heads.image(t_pooled).float().unsqueeze(1)  # (n, 1, K): one global view
            if counted:
                self.pending["self_distill"] += torch.cat([t_logits.sum(dim=(0, 1)),
                                                           t_logits.new_full((1,), float(n))])
        return {"self_distill_student": student,
                "self_distill_teacher": teacher_targets(t_logits, self.centers["self_distill"], sd.teacher_temp)}

    def _masked(self, images, seeds, rows, t_tokens, counted) -> Dict[str, torch.Tensor]:
        n, patches = images.shape[0], t_tokens.shape[1]
        m = min(patches, max(1, int(round(self.mk.mask_ratio * patches))))
        idx = patch_keys(seeds, rows, patches).topk(m, dim=1).indices.sort(dim=1).values  # (n, M)
        _, tokens = vit_tokens(self.student.visual, images, idx, self.heads.mask_token)
        take = idx.unsqueeze(-1).expand(-1, -1, tokens.shape[-1])
        student = self.heads.patch(tokens.gather(1, take))  # (n, M, K)
        with torch.no_grad():
            t_logits = self.teacher.heads.patch(t_tokens.gather(1, take)).float()
            if counted:
                self.pending["masked"] += torch.cat([t_logits.sum(dim=(0, 1)), t_logits.new_full((1,), float(n * m))])
        return {"masked_student": student,
                "masked_teacher": teacher_targets(t_logits, self.centers["masked"], self.mk.teacher_temp)}

    def _unused_zero(self, used: Sequence[str]) -> torch.Tensor:
        """0 times the heads' parameters this forward did not use: DDP then finds a (zero) gradient for each, and
        the optimiser counts the same steps for them in one process as in several (AdamW's bias correction). The
        features' values are unchanged (x + 0 = x)."""
        params = [p for name, p in self.heads.named_parameters() if name.split(".")[0] not in used]
        if not params:
            return torch.zeros((), device=self.centers[next(iter(self.centers))].device)
        return 0.0 * sum(p.sum() for p in params)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The teacher's average (None before the start) and the centres, on the CPU."""
        return {"ema": None if self.ema is None else self.ema.state_dict(),
                "centers": {name: c.detach().cpu() for name, c in self.centers.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        centers = state.get("centers", {})
        if sorted(centers) != sorted(self.centers):
            raise ValueError(f"the checkpoint's teacher serves the terms {sorted(centers)}, this run "
                             f"{sorted(self.centers)}")
        for name, c in centers.items():
            self.centers[name] = c.to(self.centers[name].device, torch.float32).clone()
        if state.get("ema") is not None:
            if self.teacher is None:
                self._start_teacher()
            self.ema.load_state_dict(state["ema"])

    def detach(self) -> None:
        """Take the heads and the hook off the model (before ``model/`` is saved: the export is the student's CLIP)."""
        self.handle.remove()
        if hasattr(self.model, HEADS):
            delattr(self.model, HEADS)
        self.teacher = None


def _empty(name: str, images: torch.Tensor) -> Dict[str, torch.Tensor]:
    """A term's outputs holding no item (before its start): its loss is 0 and nothing is computed."""
    empty = images.new_zeros((images.shape[0], 0, 0), dtype=torch.float32)
    return {f"{name}_student": empty, f"{name}_teacher": empty}


def start_step(fraction: float, total_steps: int) -> int:
    """The first optimiser step (0-based) of a term that starts at `fraction` of a run of `total_steps`: floor, so
    0.8 of 4 steps is step 3 (the last)."""
    return int(math.floor(float(fraction) * int(total_steps) + 1e-9))


def attach(model: nn.Module, sd: Optional[Any], mk: Optional[Any], total_steps: int, seed: int, rank: int = 0,
           world_size: int = 1, accum_steps: int = 1, make_ema=None) -> Optional[Siglip2]:
    """`Siglip2` on `model` for the sections whose weight is positive (None when neither is)."""
    shared = sd
    sd = sd if sd is not None and sd.weight > 0 else None
    mk = mk if mk is not None and mk.weight > 0 else None
    if sd is None and mk is None:
        return None
    out = Siglip2(model, sd, mk, total_steps, seed, rank, world_size, accum_steps, shared)
    out.make_ema = make_ema
    return out


__all__: List[str] = ["HEADS", "ProjectionHead", "Siglip2", "Siglip2Heads", "attach", "local_crops", "start_step",
                      "uniforms", "vit_tokens", "without_heads"]
