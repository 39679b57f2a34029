"""One optimiser step's forward and backward, and the update after it.

`train_step` runs the towers and the objective over a step's micro-batches (one contrastive problem over all of
them: GradCache when there are several) and returns the loss, its logged terms and the backward to run;
`apply_update` clips, steps the optimiser and clamps the temperature. `objective_from_config` builds the objective
from ``loss.*``. The loop (`mmcl.training.loop`) decides when a step is applied, logged and saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Tuple

import torch

from .. import losses, models
from ..config import LossConfig, get, term_keys
from ..errors import DataError


def _forward(model, images, texts):
    out = model(images, texts)
    return out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias")


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; from pinned memory (batches on CUDA) the copy runs without blocking the host."""
    return t.to(device, non_blocking=True)


def _images(b, device, finish_images):
    x = _moved(b["image"], device)
    return x if finish_images is None else finish_images(x)


def _leaf(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 copy of a forward output that collects the loss's gradient (GradCache's first pass)."""
    return value.detach().float().reshape(()).clone().requires_grad_(True)


def _through(output: torch.Tensor, grad: Optional[torch.Tensor]) -> torch.Tensor:
    """A term whose backward gives `output` the gradient `grad` (zero-weighted when the loss did not use it, so
    that the parameter stays in DDP's graph)."""
    if grad is None:
        return 0.0 * output.sum()
    return (output.float().reshape(()) * grad).sum()


def objective_from_config(cfg: LossConfig) -> losses.ContrastiveObjective:
    """The training objective from ``loss.*`` (validated by `config.validate`): each term's weight from its key
    (`config.term_keys`), the shared parameters, and the fields of each term's own section (``loss.mochi``: all
    but its weight) as the objective's keywords of the same names."""
    weights, sections = {}, {}
    for name, key in term_keys().items():
        weights[name] = get(cfg, key.split(".", 1)[1])  # the key below ``loss.``
        if key.endswith(".weight"):
            sections.update({k: v for k, v in dataclasses.asdict(getattr(cfg, name)).items() if k != "weight"})
    return losses.ContrastiveObjective(
        weights, chunk_size=cfg.chunk_size, tau_plus=cfg.tau_plus, hn_beta=cfg.hn_beta, align_alpha=cfg.align_alpha,
        uniform_t=cfg.uniform_t, **sections)


def score(objective, image_features, text_features, logit_scale, logit_bias, labels, with_metrics: bool = True,
          teacher=None, sample_ids=None):
    """The objective on this process's features: the global batch is gathered here when several processes run
    (`losses.gather_batch`, with the teacher's features for distillation), and a loss's complaint about its
    inputs becomes a `DataError` (one line). `sample_ids` (the batches' ``sample_id``) key the global
    contrastive term's estimates."""
    try:
        gathered = losses.gather_batch(image_features, text_features, labels, teacher=teacher)
        return objective(image_features, text_features, logit_scale, logit_bias, labels, with_metrics,
                         gathered=gathered, teacher=teacher, sample_ids=sample_ids)
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


def _teacher_features(teacher, batches, device, autocast=contextlib.nullcontext):
    """The teacher's features of the micro-batches, concatenated: computed by `teacher` (a
    `mmcl.training.teacher.Teacher`, under `autocast`, the student's mixed precision), or read from the batches (stored in
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


def train_step(model, objective, batches, accelerator, finish_images=None, with_metrics: bool = True,
               teacher=None):
    """One optimiser step's forward/backward over ``batches`` (a list of micro-batches).

    With several micro-batches the features of all of them form one contrastive problem (GradCache, Gao et al.
    2021): features are computed without autograd, the loss and its gradient w.r.t. the features are taken on the
    concatenation, then each micro-batch is re-run with autograd and back-propagated with its slice of that
    gradient. Loss and parameter gradients equal those of the single large batch. `finish_images` turns a
    batch's images into model input on the device (`TrainStream.finish_images`: uint8 -> normalised float).
    `with_metrics` is passed to the objective (its align/uniform metrics, needed only on logged steps).
    `teacher` (a `mmcl.training.teacher.Teacher`, distillation) scores the micro-batches' teacher views without gradient;
    with several micro-batches its features join the one contrastive problem like the student's.
    """
    device = accelerator.device
    teacher_features = _teacher_features(teacher, batches, device, accelerator.autocast)
    if len(batches) == 1:
        b = batches[0]
        with accelerator.autocast():
            image_features, text_features, logit_scale, logit_bias = _forward(
                model, _images(b, device, finish_images), _moved(b["text"], device))
            loss, terms = score(objective, image_features.float(), text_features.float(), logit_scale.float(),
                                None if logit_bias is None else logit_bias.float(), _moved(b["label"], device),
                                with_metrics, teacher_features, _sample_ids(batches, device))
        return loss, terms, lambda: accelerator.backward(loss)

    feats = []
    # Each micro-batch replays the same RNG states, the CPU's and the device's, on its second pass (dropout and
    # drop-path masks identical).
    rng_states = []
    with torch.no_grad():
        for b in batches:
            rng_states.append(rng_state(device))
            with accelerator.autocast():
                image_features, text_features, logit_scale, logit_bias = _forward(
                    model, _images(b, device, finish_images), _moved(b["text"], device))
            feats.append((image_features.float(), text_features.float()))
    all_image_features = torch.cat([f[0] for f in feats]).requires_grad_(True)
    all_text_features = torch.cat([f[1] for f in feats]).requires_grad_(True)
    # The scale and bias as the model's forward returns them (the same for every micro-batch), held like the
    # features: the loss's gradient with respect to them reaches the parameters through the last re-run below.
    logit_scale = _leaf(logit_scale)
    logit_bias = None if logit_bias is None else _leaf(logit_bias)
    # Each micro-batch's labels copied from its (pinned, on CUDA) memory without blocking, then joined on the device.
    labels = torch.cat([_moved(b["label"], device) for b in batches])
    loss, terms = score(objective, all_image_features, all_text_features, logit_scale, logit_bias, labels,
                        with_metrics, teacher_features, _sample_ids(batches, device))

    def backward():
        accelerator.backward(loss)  # grads for the features, logit scale and bias
        grad_image, grad_text = all_image_features.grad, all_text_features.grad
        grad_scale = logit_scale.grad
        grad_bias = None if logit_bias is None else logit_bias.grad
        start = 0
        for i, b in enumerate(batches):
            n = b["image"].shape[0]
            last = i == len(batches) - 1
            cm = contextlib.nullcontext() if last else accelerator.no_sync(model)
            with cm:
                with replayed_rng(rng_states[i], device), accelerator.autocast():
                    image_features, text_features, scale_out, bias_out = _forward(
                        model, _images(b, device, finish_images), _moved(b["text"], device))
                surrogate = ((image_features.float() * grad_image[start:start + n]).sum()
                             + (text_features.float() * grad_text[start:start + n]).sum())
                if last:  # once, inside the backward DDP averages across processes
                    surrogate = surrogate + _through(scale_out, grad_scale)
                    if bias_out is not None:
                        surrogate = surrogate + _through(bias_out, grad_bias)
                surrogate.backward()
            start += n

    return loss, terms, backward


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
