"""``optim.name``: adamw is torch's fused AdamW as before; timm's optimisers (lamb, lion, adafactor, muon, adamuon,
sgd) run over mmcl's parameter groups, follow `set_lr`, train, resume exactly, and give the same weights on 1 and
2 processes (the loop's own steps over 2 gloo processes); an unknown name is one line naming the close ones."""

import io
import os

import pytest
import torch

from mmcl.config import LossConfig, OptimConfig, load_config
from mmcl.training import optim
from mmcl.training.step import apply_update, backward, forward_loss, objective_from_config

from helpers import fake_batch, micro_model
from spawned import end_worker, free_port, spawn

TIMM = ["lamb", "lion", "adafactor", "muon", "adamuon", "sgd"]
CLASSES = {"lamb": "Lamb", "lion": "Lion", "adafactor": "Adafactor", "muon": "Muon", "adamuon": "Muon", "sgd": "SGD"}
LABELS = dict(CLASSES, adamuon="Muon, timm's adamuon")  # as the host-path line names them
# Layer-wise and per-tower rates on, so that the groups carry several scales.
RATES = ["optim.lr=1e-3", "optim.weight_decay=0.1", "optim.image_lr_mult=0.5", "optim.image_layer_decay=0.8",
         "optim.text_layer_decay=0.5"]


def _cfg(name, *extra) -> OptimConfig:
    return load_config(None, [f"optim.name={name}", *RATES, *extra]).optim


def _step(model, optimizer, objective, seed, lr=1e-3):
    batch = fake_batch(4, seed)
    out = model(batch["image"], batch["text"])
    loss, _ = objective(out["image_features"], out["text_features"], out["logit_scale"], None, batch["label"])
    loss.backward()
    optim.set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _settings(model, groups):
    """name -> (weight decay, lr scale) of every parameter in `groups`."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["weight_decay"], g["lr_scale"]) for g in groups for p in g["params"]}


def test_adamw_is_the_fused_adamw_over_the_same_groups_as_before():
    model = micro_model()
    cfg = _cfg("adamw")
    assert OptimConfig().name == "adamw" and OptimConfig().kwargs == {}
    groups = optim.param_groups(model, cfg)
    built = optim.build_optimizer(model, cfg, groups)
    reference = torch.optim.AdamW(optim.optimizer_groups(groups), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  eps=cfg.eps, fused=True)
    assert type(built) is torch.optim.AdamW and optim.takes_found_inf(built)
    assert built.defaults == reference.defaults
    assert optim.host_check_line(built, None) is None
    assert len(built.param_groups) == len(reference.param_groups) == len(groups)
    for ours, theirs in zip(built.param_groups, reference.param_groups):
        assert ours.keys() == theirs.keys()
        assert all(a is b for a, b in zip(ours["params"], theirs["params"]))
        assert {k: v for k, v in ours.items() if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}
    # optim.kwargs reaches the constructor; betas and eps stay optim.beta1/beta2/eps.
    amsgrad = optim.build_optimizer(model, _cfg("adamw", "optim.kwargs={amsgrad: true}"), groups)
    assert amsgrad.defaults["amsgrad"] and amsgrad.defaults["fused"] and amsgrad.defaults["betas"] == (0.9, 0.98)


@pytest.mark.parametrize("name", TIMM)
def test_timm_optimisers_keep_the_groups_follow_set_lr_and_train(name):
    from timm.optim import get_optimizer_class

    model = micro_model()
    cfg = _cfg(name)
    groups = optim.param_groups(model, cfg)
    built = optim.build_optimizer(model, cfg, groups)
    assert type(built) is get_optimizer_class(name, bind_defaults=False) and type(built).__name__ == CLASSES[name]
    # Every parameter once, with mmcl's weight decay and lr scale, groups in mmcl's order.
    assert _settings(model, built.param_groups) == _settings(model, groups)
    assert sum(len(g["params"]) for g in built.param_groups) == sum(len(g["params"]) for g in groups)
    order = [(g["weight_decay"], g["lr_scale"]) for g in built.param_groups]
    merged = [s for i, s in enumerate(order) if i == 0 or s != order[i - 1]]  # the Muon family splits groups
    assert merged == [(g["weight_decay"], g["lr_scale"]) for g in groups]
    assert len({s[1] for s in order}) > 1
    optim.set_lr(built, 2e-3)
    assert [g["lr"] for g in built.param_groups] == [2e-3 * g["lr_scale"] for g in built.param_groups]
    line = optim.host_check_line(built, None)  # every optimiser but the fused AdamW decides on the host
    assert line.endswith(f"the optimiser ({LABELS[name]}) cannot take found_inf"), line

    objective = objective_from_config(LossConfig())
    losses = [_step(model, built, objective, seed=0) for _ in range(3)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0], losses


def test_muon_leaves_the_embedding_tables_and_the_projections_to_its_adamw_fallback():
    model = micro_model()
    cfg = _cfg("muon")
    built = optim.build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    fallback = {names[id(p)] for g in built.param_groups if g.get("use_fallback") for p in g["params"]}
    assert fallback == {"token_embedding.weight", "positional_embedding", "visual.positional_embedding",
                        "text_projection", "visual.proj"}
    objective = objective_from_config(LossConfig())
    _step(model, built, objective, seed=0)
    routed = {names[id(p)]: s["use_muon"] for p, s in built.state.items()}
    assert routed["visual.conv1.weight"] and routed["transformer.resblocks.0.attn.in_proj_weight"]
    assert not any(routed[n] for n in fallback)
    assert not routed["logit_scale"] and not routed["visual.class_embedding"] and not routed["ln_final.weight"]


@pytest.mark.parametrize("name", ["adamw", *TIMM])
def test_a_resumed_optimiser_takes_the_next_step_exactly(name):
    """k steps, model and optimiser state saved (as bytes), a fresh model and optimiser loaded from them: step k+1
    gives the uninterrupted run's weights bit for bit."""
    objective = objective_from_config(LossConfig())
    cfg = _cfg(name)
    model = micro_model(0)
    opt = optim.build_optimizer(model, cfg)
    for seed in (1, 2):
        _step(model, opt, objective, seed)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    _step(model, opt, objective, 3)

    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    fresh = micro_model(1)
    fresh.load_state_dict(state["model"])
    fresh_opt = optim.build_optimizer(fresh, cfg)
    fresh_opt.load_state_dict(state["optimizer"])
    _step(fresh, fresh_opt, objective, 3)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n


def test_an_unknown_optimiser_is_one_line_naming_the_close_ones(capsys):
    from mmcl.cli import main

    assert main(["train", "optim.name=lamm", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmcl: error: optim.name: unknown optimiser 'lamm' (adamw, or one of "
                   "timm.optim.list_optimizers()); did you mean lamb or lambw or lambc or clamb?"], err
    assert main(["train", "optim.name=lion", "optim.kwargs={momentum: 0.9}", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.kwargs: Lion (optim.name=lion) takes no 'momentum'; it takes betas" in err[0]


# --------------------------------------------------------------------------------------- 1 and 2 processes
def _train(model, acc, batches, cfg):
    """The loop's steps (`mmcl.training.step`: forward and loss over the processes, backward, clipped update,
    logit-scale clamp) with the optimiser `cfg` names, at the schedule's rate of each step."""
    raw = acc.unwrap_model(model)
    optimizer = optim.build_optimizer(raw, cfg)
    objective = objective_from_config(LossConfig())
    for step, batch in enumerate(batches):
        loss, _, cache = forward_loss(model, objective, [batch], acc)
        backward(acc, model, loss, [batch], cache)
        optim.set_lr(optimizer, optim.lr_at(step, cfg, len(batches)))
        apply_update(acc, model, raw, optimizer, cfg.grad_clip, 4.6052)
    return {n: p.detach().clone() for n, p in raw.named_parameters()}, _newton_schulz(raw, optimizer)


def _newton_schulz(model, optimizer):
    """The parameters a Muon optimiser updates by Newton-Schulz (none for the others)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p, s in optimizer.state.items() if s.get("use_muon")}


def _float32_newton_schulz():
    """timm's Muon runs Newton-Schulz in bfloat16 (as the Muon authors' does): gradients one float32 ulp apart
    (the summation order of 1 and 2 processes) can round to other bfloat16 values, which its iterations amplify
    to a few percent of the update. The comparison of 1 and 2 processes runs it in float32."""
    import functools

    from timm.optim import muon

    muon.zeropower_via_newtonschulz = functools.partial(muon.zeropower_via_newtonschulz, dtype=torch.float32)


def _ddp_worker(rank, world, port, name, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    _float32_newton_schulz()
    acc = Accelerator(cpu=True)
    model = acc.prepare(micro_model(0))
    n = 8 // world
    batches = [{k: v[rank * n:(rank + 1) * n] for k, v in fake_batch(8, seed=s).items()} for s in (1, 2, 3)]
    weights, _ = _train(model, acc, batches, _cfg(name, "optim.warmup_steps=1"))
    if rank == 0:
        torch.save(weights, out_path)
    end_worker()


def _without_key_bias(name, tensor, width=64):
    """The parameter without the key third of an attention's input bias: softmax ignores it, so its gradient is
    float32 noise whose sign (all that Lion and Adam's normalisation keep of it) differs between 1 and 2 processes."""
    if name.endswith("attn.in_proj_bias"):
        return torch.cat([tensor[:width], tensor[2 * width:]])
    return tensor


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", *TIMM])
def test_two_processes_end_with_the_weights_of_one(tmp_path, name, monkeypatch):
    """3 steps of a global batch of 8 on 2 gloo processes (4 each) and on 1: the same weights up to float32
    summation order (the features' all-gather, the gradients' all-reduce); Muon's Newton-Schulz in float32
    (`_float32_newton_schulz`). Adafactor and AdaMuon divide by a second moment (factored; per element of the
    orthogonalised update), which turns float32 noise in near-zero gradient entries into weight differences of up
    to 5e-5 (measured up to 2.2e-5 and 1.5e-5); plain SGD moves a weight
    by the gradient itself, so its smallest move is under Adam-like optimisers' 1e-4."""
    from accelerate import Accelerator
    from timm.optim import muon

    monkeypatch.setattr(muon, "zeropower_via_newtonschulz", muon.zeropower_via_newtonschulz)  # restored after
    _float32_newton_schulz()

    out = tmp_path / "ddp.pt"
    spawn(_ddp_worker, args=(2, free_port(), name, str(out)), nprocs=2)
    two = torch.load(out)
    acc = Accelerator(cpu=True)
    one, newton_schulz = _train(micro_model(0), acc, [fake_batch(8, seed=s) for s in (1, 2, 3)],
                                _cfg(name, "optim.warmup_steps=1"))
    assert one.keys() == two.keys() and bool(newton_schulz) == (name in ("muon", "adamuon"))
    start = dict(micro_model(0).named_parameters())
    moved = {k: (one[k] - start[k]).abs().max().item() for k in one}
    assert min(moved[k] for k in newton_schulz | {"visual.proj", "token_embedding.weight"}) > (
        1e-5 if name == "sgd" else 1e-4)
    worst = {k: (_without_key_bias(k, one[k]) - _without_key_bias(k, two[k])).abs().max().item() for k in one}
    tolerance = 5e-5 if name in ("adafactor", "adamuon") else 1e-5
    assert max(worst.values()) <= tolerance, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_a_resume_says_when_the_learning_rate_schedule_changed():
    """A run stopped at the end of its 72-step cosine and resumed with train.epochs raised to 96 steps: the line
    names the rate the last step took (kept in the optimiser, per group scaled by lr_scale) and the next one's."""
    cfg = OptimConfig(lr=1e-3, warmup_steps=5, schedule="cosine")
    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW([{"params": [weights[0]], "lr_scale": 0.0}, {"params": [weights[1]], "lr_scale": 0.25}])
    optim.set_lr(opt, optim.lr_at(71, cfg, 72))  # what step 72 (0-based 71) of the 72-step run took
    assert optim.schedule_change(opt, cfg, 72, 72) == ""  # finished: no next step
    assert optim.schedule_change(opt, cfg, 72, 96) == (
        f"; the learning-rate schedule changed: step 72 took lr {optim.lr_at(71, cfg, 72):.4g}, step 73 takes "
        f"{optim.lr_at(72, cfg, 96):.4g} (optim.schedule cosine over 96 steps)")
    assert optim.lr_at(72, cfg, 96) > 100 * optim.lr_at(71, cfg, 72)  # the jump it reports: the cosine re-spread
    optim.set_lr(opt, optim.lr_at(39, cfg, 72))  # stopped at step 40 and resumed unchanged
    assert optim.schedule_change(opt, cfg, 40, 72) == ""
    assert optim.schedule_change(opt, OptimConfig(lr=2e-3, warmup_steps=5), 40, 72).startswith(
        "; the learning-rate schedule changed: step 40 took lr")  # optim.lr edited
    assert optim.schedule_change(opt, cfg, 0, 72) == ""  # nothing trained yet
