"""One optimiser step, top to bottom: `Step.__call__` runs the forward and the loss (`forward_loss`), decides
whether the step is applied (the loss finite on every process: on the device or on the host, `FiniteChecks`), runs
the backward (`backward`), the update with the clip and the temperature's clamp (`apply_update`) and the weight
average, and returns what it measured (`StepResult`). The loop (`mmcl.training.loop`) logs, saves, evaluates and
stops; `objective_from_config` builds the objective from ``loss.*``.

The finite-loss decision stays on the device where it can. Reading a per-step flag on the host (``.item()``) waits
for the device on a GPU and, with several processes, for the all-reduce that makes them agree: a stall on every
step. So each step's flag stays a tensor:

* every process's "this loss is not finite" flag (0 or 1) is reduced to its maximum over the processes on the
  device (one all-reduce of one number, not read), so every process holds the same decision, 0 or 1;
* the fused AdamW takes it as ``found_inf`` (the mechanism of `torch.amp.GradScaler`): where it is 1 the kernel
  leaves the parameters, both moments and the step count exactly as they were, as a skipped step did when it was
  decided on the host. It must be exactly 0 or 1: the kernel skips only on 1 and takes ``found_inf`` off the
  step count, so a count of the non-finite processes (2 where two are poisoned) would apply the step, NaN
  gradients and all, and move the step count back (to 0 and below: NaN from the bias correction next);
* the flags of the steps since the last read are read together on the next logged or saved step
  (`FiniteChecks.resolve`, one host read), where a non-finite step is counted and reported (``nan_policy=skip``)
  or ends the run (``stop``) before any checkpoint is written.

An optimiser without that mechanism (no fused kernel for the device or dtype), or a loss scaler (fp16), which sets
``found_inf`` itself, leaves the decision to the host every step (`agree_on_step`: one all-reduce that also agrees
on a stop signal).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import losses, models
from ..config import LossConfig, get, say, term_keys
from ..data import device_decode as data_device_decode
from ..data import naflex as data_naflex
from ..errors import DataError, TrainingError
from ..storage.checkpoints import latest_checkpoint
from .optim import takes_found_inf
from .state import RunState


def _forward(model, images, texts, b=None, device=None):
    """The model's features, scale and bias, and its whole output dict (what the sample terms read). A batch `b`
    that marks captions for parallel prediction (``caption_parallel``, ``loss.caption_parallel``) passes the marks."""
    if b is not None and "caption_parallel" in b:
        out = model(images, texts, caption_parallel=_moved(b["caption_parallel"], device))
    else:
        out = model(images, texts)
    return out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"), out


def _sample_losses(objective, out, b) -> Dict[str, losses.SampleLosses]:
    """The sample terms' losses of a micro-batch's pairs (`losses.sample_terms`) from the model's output dict, in
    float32; rows past the pairs (negative captions) are left out."""
    return objective.sample_losses(out, rows=_pairs(b))


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; from pinned memory (batches on CUDA) the copy runs without blocking the host."""
    return t.to(device, non_blocking=True)


def _images(b, device, finish_images):
    if data_device_decode.ENCODED in b:  # data.decode=device: decoded, cropped and finished on `device`
        return finish_images.batch(b, device)
    if "image" in b:
        x = _moved(b["image"], device)
    else:  # a NaFlex batch: the tower takes the patch dict (`mmcl.data.naflex`)
        x = {k: _moved(b[k], device) for k in data_naflex.PATCH_KEYS}
    return x if finish_images is None else finish_images(x)


# The texts a batch may bring besides its captions, in the order the text tower reads them after the captions:
# the negative captions (``data.negatives``: only the real ones, so padding costs no forward) and each image's short
# caption (``loss.short_caption``). One forward encodes them all.
_EXTRA_TEXTS = ("negatives", "short_text")


def _texts(b, device) -> torch.Tensor:
    """The text tower's input for a batch: its captions' tokens, then those of `_EXTRA_TEXTS` it holds."""
    extra = [_moved(b[k], device) for k in _EXTRA_TEXTS if k in b]
    if not extra:
        return _moved(b["text"], device)
    return torch.cat([_moved(b["text"], device), *extra])


def _split_texts(text_features: torch.Tensor, b, device):
    """(the captions' features, the batch's `losses.DataNegatives` or None, the short captions' features or None)
    from the text tower's output on `_texts`. The real negatives' slots are known on the host (the batch's mask is a
    host tensor): no device read."""
    n = _pairs(b)
    captions, rest = text_features[:n], text_features[n:]
    negatives = short = None
    if "negatives" in b:
        valid = b["negatives_valid"]
        real = b["negatives"].shape[0]
        slots = _moved(valid.reshape(-1).nonzero().squeeze(1), device)
        feats = text_features.new_zeros((valid.numel(), text_features.shape[1])).index_copy(0, slots, rest[:real])
        negatives, rest = losses.DataNegatives(feats.reshape(*valid.shape, -1), _moved(valid, device)), rest[real:]
    if "short_text" in b:
        short = rest[:n]
    return captions, negatives, short


def _pairs(b) -> int:
    """The pairs of a micro-batch (known on the host: its captions' rows)."""
    return int(b["text"].shape[0])


def _leaf(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 copy of a forward output that collects the loss's gradient (GradCache's first pass)."""
    return value.detach().float().reshape(()).clone().requires_grad_(True)


def _through(output: torch.Tensor, grad: Optional[torch.Tensor]) -> torch.Tensor:
    """A term whose backward gives `output` the gradient `grad` (zero-weighted when the loss did not use it, so
    that the parameter stays in DDP's graph)."""
    if grad is None:
        return 0.0 * output.sum()
    return (output.float().reshape(()) * grad).sum()


def objective_from_config(cfg: LossConfig, validation: bool = False) -> losses.ContrastiveObjective:
    """The training objective from ``loss.*`` (validated by `config.validate`): each term's weight from its key
    (`config.term_keys`), the shared parameters, and the fields of each term's own section (``loss.mochi``: all
    but its weight) as the objective's keywords of the same names (a section's ``OBJECTIVE_KEYS``: those alone,
    under the names it gives). With `validation`, the validation loss's: without the terms scored on the views a
    training step makes (`losses.TRAINING_VIEW_TERMS`), since it sees each held-out image once, as it is, nor the
    short-caption term, whose second caption only a training batch carries (`losses.NOT_IN_VALIDATION`)."""
    weights, sections = {}, {}
    for name, key in term_keys().items():
        weights[name] = get(cfg, key.split(".", 1)[1])  # the key below ``loss.``
        if validation and name in losses.NOT_IN_VALIDATION:
            weights[name] = 0.0
        if key.endswith(".weight"):
            section = getattr(cfg, name)
            # a section naming its objective keys (`OBJECTIVE_KEYS`) passes those, renamed; its other keys are
            # another part's (a model side's: `models.siglip2`)
            names = getattr(section, "OBJECTIVE_KEYS", None)
            sections.update({names.get(k, k) if names is not None else k: v
                             for k, v in dataclasses.asdict(section).items()
                             if k != "weight" and (names is None or k in names)})
    return losses.ContrastiveObjective(
        weights, chunk_size=cfg.chunk_size, tau_plus=cfg.tau_plus, hn_beta=cfg.hn_beta, align_alpha=cfg.align_alpha,
        uniform_t=cfg.uniform_t, **sections)


def score(objective, image_features, text_features, logit_scale, logit_bias, labels, with_metrics: bool = True,
          teacher=None, sample_ids=None, capacity: Optional[int] = None, negatives=None, samples=None,
          short_text=None):
    """The objective on this process's features: the global batch is gathered here when several processes run
    (`losses.gather_batch`, with the teacher's features for distillation), and a loss's complaint about its
    inputs becomes a `DataError` (one line). `sample_ids` (the batches' ``sample_id``) key the global
    contrastive term's estimates. `capacity` (NaFlex: a varying number of pairs per process) pads the features
    to that many rows (`losses.pad_pairs`) and scores the real pairs only (``valid``). `negatives` (a
    `losses.DataNegatives` of these rows, ``data.negatives``) add columns to their own images' rows. `samples` (the
    sample terms' `losses.SampleLosses` of these rows, `objective.sample_losses`) are neither padded nor gathered.
    `short_text` (the features of these images' short captions, ``loss.short_caption``) is gathered with the rest."""
    try:
        valid = None
        if capacity is not None:
            n = image_features.shape[0]
            image_features, text_features, valid = losses.pad_pairs(image_features, text_features, capacity)
            labels = torch.nn.functional.pad(labels, (0, capacity - n))
            sample_ids = None  # the terms that take a varying number of pairs keep no per-sample state
            if negatives is not None:  # padded rows carry no negative
                negatives = losses.DataNegatives(
                    torch.nn.functional.pad(negatives.features, (0, 0, 0, 0, 0, capacity - n)),
                    torch.nn.functional.pad(negatives.valid, (0, 0, 0, capacity - n)))
        gathered = losses.gather_batch(image_features, text_features, labels, teacher=teacher, valid=valid,
                                       short_text=short_text)
        return objective(image_features, text_features, logit_scale, logit_bias, labels, with_metrics,
                         gathered=gathered, teacher=teacher, sample_ids=sample_ids, valid=valid, negatives=negatives,
                         samples=samples, short_text=short_text)
    except losses.LossInputError as err:
        raise DataError(str(err)) from None


def _sample_ids(batches, device):
    """The micro-batches' stable sample ids (``sample_id``, `mmcl.data.pipeline.sample_id`) joined on the device;
    None when a batch has none (a stream other than mmcl's)."""
    if any("sample_id" not in b for b in batches):
        return None
    return torch.cat([_moved(b["sample_id"], device) for b in batches])


def _stored_teacher(b, device) -> losses.TeacherFeatures:
    """The teacher embeddings a batch read from reinforced shards (``distill.from_shards``), as float32 unit
    vectors on the device (they are stored as float16)."""
    image = torch.nn.functional.normalize(_moved(b["teacher_image_features"], device).float(), dim=1)
    text = torch.nn.functional.normalize(_moved(b["teacher_text_features"], device).float(), dim=1)
    return losses.TeacherFeatures(image, text, _moved(b["teacher_scale"][0], device).float())


def teacher_targets(teacher, batches, device, autocast=contextlib.nullcontext):
    """The teacher's features of the micro-batches, concatenated: computed by `teacher` (a
    `evaluation.teacher.Teacher`, under `autocast`, the student's mixed precision), or read from the batches (stored
    in
    the shards); None without distillation."""
    if teacher is not None:
        with autocast():
            parts = [teacher.embed(b["teacher_image"], b["teacher_text"]) for b in batches]
    elif "teacher_image_features" in batches[0]:
        parts = [_stored_teacher(b, device) for b in batches]
    else:
        return None
    if len(parts) == 1:
        return parts[0]
    return losses.TeacherFeatures(torch.cat([p.image for p in parts]), torch.cat([p.text for p in parts]),
                                  parts[0].scale)


def device_rng(device: torch.device):
    """The module holding `device`'s random generators (``torch.cuda``, ``torch.xpu``, ...), or None on the CPU,
    whose generator ``torch.get_rng_state`` already covers."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def rng_state(device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The CPU generator's state and `device`'s (None on the CPU): what draws dropout and drop-path masks."""
    on_device = device_rng(device)
    return torch.get_rng_state(), None if on_device is None else on_device.get_rng_state(device)


@contextlib.contextmanager
def replayed_rng(state: Tuple[torch.Tensor, Optional[torch.Tensor]], device: torch.device):
    """Run the block from the generator states `state` (`rng_state`), then put back the states it found: the
    block draws the same numbers as the pass that `state` was taken before, on the CPU and on the device."""
    on_device = device_rng(device)
    found = rng_state(device)
    torch.set_rng_state(state[0])
    if on_device is not None:
        on_device.set_rng_state(state[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(found[0])
        if on_device is not None:
            on_device.set_rng_state(found[1], device)



@dataclasses.dataclass
class GradCache:
    """What the second pass of a step over several micro-batches needs (GradCache, Gao et al. 2021): the features
    and the temperature held as leaves that collect the loss's gradient, and each micro-batch's RNG states."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    logit_scale: torch.Tensor
    logit_bias: Optional[torch.Tensor]
    rng_states: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    negatives: Optional[losses.DataNegatives] = None  # their features held like the captions' (data.negatives)
    samples: Dict[str, losses.SampleLosses] = dataclasses.field(default_factory=dict)  # the sample terms' sums
    objective: Any = None  # what makes the sample terms' losses again in each re-run
    short_text: Optional[torch.Tensor] = None  # the short captions' features, held like the captions'


def forward_loss(model, objective, batches, accelerator, finish_images=None, with_metrics: bool = True,
                 teacher=None, capacity: Optional[int] = None
                 ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Optional[GradCache]]:
    """The forward and the loss of one optimiser step over ``batches`` (a list of micro-batches): (loss, its logged
    terms, None for one micro-batch or the `GradCache` the backward re-runs them from).

    With several micro-batches the features of all of them form one contrastive problem (GradCache): features are
    computed without autograd and the loss taken on their concatenation; `backward` then re-runs each micro-batch
    with autograd and back-propagates its slice of the loss's gradient. Loss and parameter gradients equal those of
    the single large batch. `finish_images` turns a batch's images into model input on the device
    (`TrainStream.finish_images`: uint8 -> normalised float). `with_metrics` is passed to the objective (its
    align/uniform metrics, needed only on logged steps). `teacher` (a `mmcl.evaluation.teacher.Teacher`,
    distillation) scores the micro-batches' teacher views without gradient; with several micro-batches its
    features join the one contrastive problem like the student's. `capacity` (NaFlex batches, whose number of
    pairs varies) is the most pairs one micro-batch holds: the step's features are padded to ``capacity`` times
    the micro-batches and only the real pairs are scored (`score`).
    """
    device = accelerator.device
    step_capacity = None if capacity is None else capacity * len(batches)
    from_teacher = teacher_targets(teacher, batches, device, accelerator.autocast)
    ids = _sample_ids(batches, device)
    if len(batches) == 1:
        b = batches[0]
        with accelerator.autocast():
            image_features, text_features, logit_scale, logit_bias, out = _forward(
                model, _images(b, device, finish_images), _texts(b, device), b, device)
            text_features, negatives, short = _split_texts(text_features.float(), b, device)
            samples = _sample_losses(objective, out, b)
            loss, terms = score(objective, image_features.float(), text_features, logit_scale.float(),
                                None if logit_bias is None else logit_bias.float(), _moved(b["label"], device),
                                with_metrics, from_teacher, ids, step_capacity, negatives, samples, short)
        return loss, terms, None
    feats, rng_states, sampled = [], [], []
    # Each micro-batch replays the same RNG states, the CPU's and the device's, on its second pass (dropout and
    # drop-path masks identical).
    with torch.no_grad():
        for b in batches:
            rng_states.append(rng_state(device))
            with accelerator.autocast():
                image_features, text_features, logit_scale, logit_bias, out = _forward(
                    model, _images(b, device, finish_images), _texts(b, device), b, device)
                sampled.append(_sample_losses(objective, out, b))
            feats.append((image_features.float(), *_split_texts(text_features.float(), b, device)))
    # The scale and bias as the model's forward returns them (the same for every micro-batch), held like the
    # features: the loss's gradient with respect to them reaches the parameters through the last re-run.
    negatives = None
    if feats[0][2] is not None:  # every micro-batch has K slots per sample (data.negatives)
        negatives = losses.DataNegatives(torch.cat([f[2].features for f in feats]).requires_grad_(True),
                                         torch.cat([f[2].valid for f in feats]))
    short = None if feats[0][3] is None else torch.cat([f[3] for f in feats]).requires_grad_(True)
    # The sample terms' per-sample sums held as leaves too: each re-run gives its rows' sums their gradient.
    samples = {name: losses.SampleLosses(torch.cat([s[name].sums for s in sampled]).requires_grad_(True),
                                         torch.cat([s[name].counts for s in sampled])) for name in sampled[0]}
    cache = GradCache(torch.cat([f[0] for f in feats]).requires_grad_(True),
                      torch.cat([f[1] for f in feats]).requires_grad_(True), _leaf(logit_scale),
                      None if logit_bias is None else _leaf(logit_bias), rng_states, negatives, samples, objective,
                      short)
    # Each micro-batch's labels copied from its (pinned, on CUDA) memory without blocking, then joined on the device.
    labels = torch.cat([_moved(b["label"], device) for b in batches])
    loss, terms = score(objective, cache.image_features, cache.text_features, cache.logit_scale, cache.logit_bias,
                        labels, with_metrics, from_teacher, ids, step_capacity, negatives, samples, short)
    return loss, terms, cache


def backward(accelerator, model, loss: torch.Tensor, batches, cache: Optional[GradCache],
             finish_images=None) -> None:
    """The backward of `loss` (`forward_loss`); with several micro-batches, each is then re-run with autograd from
    its saved RNG states and back-propagated with its slice of the features' gradient (DDP all-reduces once, in
    the last micro-batch's backward)."""
    accelerator.backward(loss)  # with a GradCache: grads for the features, logit scale and bias
    if cache is None:
        return
    device, start = accelerator.device, 0
    for i, b in enumerate(batches):
        n = _pairs(b)
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            with replayed_rng(cache.rng_states[i], device), accelerator.autocast():
                image_features, text_features, scale_out, bias_out, out = _forward(
                    model, _images(b, device, finish_images), _texts(b, device), b, device)
                sampled = _sample_losses(cache.objective, out, b) if cache.samples else {}
            text_features, negatives, short = _split_texts(text_features.float(), b, device)
            surrogate = ((image_features.float() * cache.image_features.grad[start:start + n]).sum()
                         + (text_features * cache.text_features.grad[start:start + n]).sum())
            for name, values in sampled.items():
                surrogate = surrogate + (values.sums * cache.samples[name].sums.grad[start:start + n]).sum()
            if negatives is not None:
                surrogate = surrogate + (negatives.features * cache.negatives.features.grad[start:start + n]).sum()
            if short is not None:
                surrogate = surrogate + (short * cache.short_text.grad[start:start + n]).sum()
            if last:  # once, inside the backward DDP averages across processes
                surrogate = surrogate + _through(scale_out, cache.logit_scale.grad)
                if bias_out is not None:
                    surrogate = surrogate + _through(bias_out, cache.logit_bias.grad)
            surrogate.backward()
        start += n


def apply_update(accelerator, model, raw_model, optimizer, grad_clip: Optional[float], max_logit_scale: float):
    """After backward: clip the gradients (when `grad_clip`), step and clear the optimiser, and keep the learned
    temperature of `raw_model` (the unwrapped `model`) within ``exp(t) <= max_logit_scale``
    (`models.clamp_logit_scale`). Returns the gradient norm before clipping as a tensor (read it, a device sync,
    only when it is logged), or None without clipping."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip) if grad_clip else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    models.clamp_logit_scale(raw_model, max_logit_scale)
    return grad_norm


class FiniteChecks:
    """The device-side finite-loss flags of the steps not yet read (see the module's notes)."""

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.on_device = takes_found_inf(self.inner) and getattr(accelerator, "scaler", None) is None
        self.pending: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, flag, loss)

    def not_finite_anywhere(self, loss: torch.Tensor) -> torch.Tensor:
        """A float32 0-d tensor, the same on every process: 1.0 where `loss` is not finite on some process, else
        0.0 (a flag, never a count: see the module's notes on ``found_inf``)."""
        bad = (~torch.isfinite(loss.detach())).reshape(()).to(torch.float32)
        if self.accelerator.num_processes > 1:

            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # in place; nothing is read on the host
        return bad

    def arm(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Before this step's backward (device path): the coming optimiser step is skipped where the loss is not
        finite on some process. `step` is the 1-based number of the step. Returns the flag."""
        bad = self.not_finite_anywhere(loss)
        self.inner.found_inf = bad
        self.pending.append((step, bad, loss.detach()))
        return bad

    def resolve(self) -> List[Tuple[int, float]]:
        """The steps since the last call whose loss was not finite on some process, as (step, this process's loss);
        one host read of all their flags."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        flags = torch.stack([flag for _, flag, _ in pending]).tolist()
        return [(step, float(loss)) for (step, _, loss), f in zip(pending, flags) if f > 0]




def non_finite_step(step: int, value: float, processes: int, nan_policy: str, checkpoints_dir: Path) -> None:
    """Step `step` (1-based) had a loss that is not finite on some process (`value` here): raise TrainingError
    (``train.nan_policy=stop``, naming the last good checkpoint under `checkpoints_dir`), or say that it was skipped
    (``skip``)."""
    where = f"{value}" if processes == 1 else f"not finite on some process ({value} here)"
    if nan_policy == "stop":
        good = latest_checkpoint(checkpoints_dir)
        err = TrainingError(f"loss is {where} at step {step}; last good checkpoint: "
                            f"{good if good else 'none'} (set train.nan_policy=skip to skip such steps)")
        err.everywhere = True  # all processes stop alike; one line
        raise err
    say(f"skipped step {step}: loss is {where}")


def settle_skipped(checks: FiniteChecks, state: RunState, applied: bool, loss: torch.Tensor, read: bool,
                   samples_of: Callable[[int], int], processes: int, nan_policy: str, checkpoints_dir: Path) -> bool:
    """The host's side of the finite-loss decision after a step: a step the host decided to skip (not `applied`)
    is counted at once; the steps the device skipped are found where the host reads their flags (`read`: logged and
    saved steps, the last, a stop) and taken off the progress then, their samples (`samples_of(step)`) un-counted.
    Advances `state`'s progress for a skipped step (an applied one is counted by the loop). Returns whether the
    step just taken was skipped."""
    progress = state.progress
    skipped_now = not applied
    if not applied:
        non_finite_step(progress.step + 1, loss.item(), processes, nan_policy, checkpoints_dir)  # raises on stop
        progress.skipped_steps += 1
        progress.step += 1
    if checks.on_device and read:
        for bad_step, value in checks.resolve():
            non_finite_step(bad_step, value, processes, nan_policy, checkpoints_dir)  # before any save
            progress.skipped_steps += 1
            n = samples_of(bad_step)
            progress.samples -= n
            state.window_samples -= n
            skipped_now = skipped_now or bad_step == progress.step
    return skipped_now


def agree_on_step(accelerator, loss: torch.Tensor, stop_requested: bool) -> Tuple[bool, bool]:
    """The host's decision (an optimiser without the device path): (the loss is finite on every process, a stop
    signal came to some process), from one all-reduce.

    All processes must take the same branch: one skipping backward while the others run it would pair their
    gradient all-reduces with the wrong steps (and end in a hang); and all must stop after the same step,
    whichever of them got the signal.
    """
    flags = torch.stack([torch.isfinite(loss.detach()).reshape(()).float(),
                         torch.tensor(float(stop_requested), device=loss.device)])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    finite_count, stop_count = flags.tolist()
    return finite_count >= accelerator.num_processes, stop_count > 0


@dataclasses.dataclass
class StepResult:
    """What one step measured. `applied` is False only where the host decided to skip it (a step the device skips
    is found later, by `FiniteChecks.resolve`); `stop` is the agreed stop signal where the host decided (None:
    not asked this step)."""

    loss: torch.Tensor
    terms: Dict[str, torch.Tensor]
    grad_norm: Optional[torch.Tensor]
    applied: bool
    stop: Optional[bool]
    pairs: Optional[int] = None  # NaFlex: the step's pairs over all processes (known on the host); None: the batch


class Step:
    """One optimiser step of a run, from its micro-batches to the updated weights (`__call__`)."""

    def __init__(self, accelerator, model, raw_model, optimizer, objective, *, grad_clip: Optional[float],
                 max_logit_scale: float, ema=None, teacher=None, finish_images=None, capacity: Optional[int] = None,
                 siglip2=None):
        self.accelerator, self.model, self.raw_model = accelerator, model, raw_model
        self.capacity = capacity  # NaFlex: the most pairs of a micro-batch (`forward_loss`); None: fixed batches
        self.optimizer, self.objective = optimizer, objective
        self.grad_clip, self.max_logit_scale = grad_clip, max_logit_scale
        self.ema, self.teacher, self.finish_images = ema, teacher, finish_images
        self.siglip2 = siglip2  # loss.self_distill / loss.masked: the EMA teacher and centres (`models.siglip2`)
        self.checks = FiniteChecks(accelerator, optimizer)

    def __call__(self, batches: List[Dict[str, Any]], step: int, with_metrics: bool,
                 stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
        """Optimiser step `step` (1-based) over `batches`: forward and loss, the finite-loss decision, backward, the
        update and the weight average. `stop_requested` reads this process's stop flag where the host decides (after
        the forward, so a signal that came during it stops the run after this step)."""
        loss, terms, cache = forward_loss(self.model, self.objective, batches, self.accelerator,
                                          self.finish_images, with_metrics, self.teacher, self.capacity)
        pairs = None
        if self.capacity is not None:  # every process draws the same lengths, so holds the same number of pairs
            pairs = sum(_pairs(b) for b in batches) * self.accelerator.num_processes
            if with_metrics:
                terms = dict(terms, **naflex_metrics(batches))
        flag, stop = None, None
        if self.checks.on_device:  # the update runs; the optimiser leaves everything as it was where flag is 1
            flag = self.checks.arm(loss, step)
        else:
            finite, stop = agree_on_step(self.accelerator, loss, stop_requested())
            if not finite:
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(loss, terms, None, False, stop, pairs)
        backward(self.accelerator, self.model, loss, batches, cache, self.finish_images)
        grad_norm = apply_update(self.accelerator, self.model, self.raw_model, self.optimizer, self.grad_clip,
                                 self.max_logit_scale)
        if self.ema is not None:  # not moved on a step the optimiser skipped (the device's flag is not read)
            self.ema.update(self.raw_model, skipped=flag)
        if self.siglip2 is not None:  # the teacher and its centres, likewise
            self.siglip2.after_step(skipped=flag)
        return StepResult(loss, terms, grad_norm, True, stop, pairs)


def naflex_metrics(batches) -> Dict[str, torch.Tensor]:
    """The logged numbers of a step's NaFlex micro-batches (host tensors, no device read): the share of patch slots
    that are padding, the sequence length (the mean over the micro-batches) and this process's pairs."""
    valid = [b["patch_valid"] for b in batches]
    slots = sum(v.numel() for v in valid)
    return {"data/naflex_padding_waste": torch.tensor(sum(float((~v).sum()) for v in valid) / max(1, slots)),
            "data/naflex_seq_len": torch.tensor(sum(float(v.shape[1]) for v in valid) / len(valid)),
            "data/naflex_pairs": torch.tensor(float(sum(v.shape[0] for v in valid)))}
