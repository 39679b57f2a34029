"""FSDP2 through accelerate's own plugin, run on 2 CPU processes (gloo): the same weights as DDP, locked towers,
sharded checkpoints with an exact resume, and a model/ that open_clip loads.

accelerate takes its FSDP branch only on GPU-like devices; `tests/fsdp_cpu_shim.py` (test-only) lets a CPU launch
take it, and everything after that is accelerate's and torch's FSDP2 code, as a GPU run with launch/fsdp.yaml
gets it."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from helpers import ACCELERATE_LAUNCH, ROOT, final_weights, metrics, run_args

SHIM = str(Path(__file__).resolve().parents[1] / "fsdp_cpu_shim.py")
STEPS = 20


def _fsdp_config(tmp_path) -> Path:
    """launch/fsdp.yaml for 2 CPU processes in float32: only the process count, precision and device differ."""
    cfg = yaml.safe_load((ROOT / "launch" / "fsdp.yaml").read_text())
    cfg.update(num_processes=2, mixed_precision="no", use_cpu=True)
    path = tmp_path / "fsdp-cpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(config, program, out, *extra, env=None):
    args = run_args(demo_paths["demo"], out, f"train.steps={STEPS}", "train.save_every=10", "data.batch_size=4",
                    "data.workers=0", "train.log_every=5", *extra)
    cmd = [*ACCELERATE_LAUNCH, "--config_file", str(config), *program, "train", *args]
    p = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {})),
                       capture_output=True, text=True, timeout=600)
    return p


demo_paths = {}


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory):
    """FSDP and DDP runs of the same config, plain and with the text tower locked (and accumulation)."""
    demo_paths["demo"] = demo
    root = tmp_path_factory.mktemp("fsdp")
    config = _fsdp_config(root)
    out = {}
    # "locked": the text tower locked, with GradCache accumulation (no_sync), gradient checkpointing and in-loop
    # evaluations (one pair of launches for what a plain run lacks: each launch costs about 25 s on 2 cores)
    variants = (("plain", ()),
                ("locked", ("model.lock_text=true", "model.lock_text_freeze_layer_norm=true", "train.accum_steps=2",
                            "data.batch_size=2", "model.grad_checkpointing=true",
                            f"eval.zeroshot={demo['zeroshot_colour']}", "eval.every=10")))
    for name, extra in variants:
        for how, cfg, program in (("fsdp", config, [SHIM]), ("ddp", ROOT / "launch" / "cpu-2proc.yaml",
                                                           ["-m", "mmcl"])):
            run = root / f"{how}-{name}"
            p = _launch(cfg, program, run, *extra)
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
            out[(how, name)] = (run, p.stdout)
    out["config"] = config
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "locked"])
def test_fsdp_trains_to_the_weights_of_ddp(runs, name):
    fsdp_run, stdout = runs[("fsdp", name)]
    assert "2 process(es), FSDP on cpu" in stdout  # accelerate's FSDP path, not a silent DDP fallback
    a, b = final_weights(fsdp_run), final_weights(runs[("ddp", name)][0])
    assert a.keys() == b.keys() and a["logit_scale"].shape == ()  # open_clip's layout, 0-dim scale included
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst
    rows_a, rows_b = metrics(fsdp_run), metrics(runs[("ddp", name)][0])
    assert [r["step"] for r in rows_a] == [5, 10, 15, 20]
    for ra, rb in zip(rows_a, rows_b):
        for key in ("loss", "logit_scale", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4), key
        evals = sorted(k for k in ra if k.startswith("eval/"))
        assert evals == sorted(k for k in rb if k.startswith("eval/"))
        assert all(ra[k] == pytest.approx(rb[k], abs=1e-6) for k in evals)
    if name == "locked":  # evaluated in the loop (step 10) and at the end, on the gathered weights
        assert [r["step"] for r in rows_a if "eval/zeroshot_classification/colour/acc1" in r] == [10, 20]
    text = [k for k in a if k.startswith(("transformer.", "token_embedding", "ln_final", "positional",
                                           "text_projection"))]
    if name == "locked":
        # The locked tower never moves: bit-identical to DDP's locked tower (both are the seed's initial weights,
        # where any update, weight decay included, would have made them differ), while the plain runs trained it.
        assert text and all(torch.equal(a[k], b[k]) for k in text)
        trained = final_weights(runs[("fsdp", "plain")][0])
        assert all(not torch.equal(a[k], trained[k]) for k in text)
        assert not torch.equal(a["visual.conv1.weight"], trained["visual.conv1.weight"])


@pytest.mark.slow
def test_fsdp_model_loads_in_open_clip_with_the_same_features(runs):
    import open_clip
    from PIL import Image

    import mmcl

    run = runs[("fsdp", "plain")][0]
    model, preprocess = mmcl.load(run)[:2]
    oc_model, _, oc_preprocess = open_clip.create_model_and_transforms(f"local-dir:{run / 'model'}")
    oc_model.eval()
    image = Image.new("RGB", (80, 60), (200, 40, 30))
    tokens = open_clip.get_tokenizer(f"local-dir:{run / 'model'}")(["a red circle"])
    with torch.no_grad():
        ours = model.encode_image(preprocess(image)[None], normalize=True)
        theirs = oc_model.encode_image(oc_preprocess(image)[None], normalize=True)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(model.encode_text(tokens), oc_model.encode_text(tokens))


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_resumes_exactly(runs, tmp_path):
    run = tmp_path / "run"
    p = _launch(runs["config"], [SHIM], run, env={"MMCL_TEST_STOP_AT_STEP": "13"})
    # With several processes a stop is agreed at the next logged or saved step (no host sync on the others): 15.
    assert p.returncode != 0 and "preempted (SIGTERM) at step 15" in p.stderr, p.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-00000015"
    assert (ckpt / "pytorch_model_fsdp_0").is_dir() and (ckpt / "optimizer_0").is_dir()  # sharded (DCP)
    p = _launch(runs["config"], [SHIM], run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout
    a, b = final_weights(run), final_weights(runs[("fsdp", "plain")][0])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in metrics(run)] == [5, 10, 15, 20]


@pytest.mark.slow
def test_naflex_under_fsdp_trains_to_the_weights_of_ddp(demo, tmp_path):
    """NaFlex batches under FSDP2: each process pads its varying number of pairs to the capacity, and the sharded
    towers train to the weights DDP gives the same 2 processes."""
    from helpers import naflex_args

    config = _fsdp_config(tmp_path)
    runs = {}
    for how, cfg, program in (("fsdp", config, [SHIM]), ("ddp", ROOT / "launch" / "cpu-2proc.yaml", ["-m", "mmcl"])):
        runs[how] = tmp_path / how
        cmd = [*ACCELERATE_LAUNCH, "--config_file", str(cfg), *program,
               *naflex_args(demo["train"], runs[how], "train.steps=4", "train.save_every=0")]
        p = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        assert how != "fsdp" or "2 process(es), FSDP on cpu" in p.stdout
    a, b = final_weights(runs["fsdp"]), final_weights(runs["ddp"])
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst
    pairs = [[r["data/naflex_pairs"] for r in metrics(runs[how])] for how in ("fsdp", "ddp")]
    assert pairs[0] == pairs[1] and len(set(pairs[0])) > 1  # the same batches, of different sizes
