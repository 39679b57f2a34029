"""Settings open_clip_train has on a GPU, checked on the CPU: cuDNN's autotuner, DDP's options through accelerate,
evaluation under the run's mixed precision, and data workers sized from the CPUs."""

import os
import subprocess
import sys

import pytest
import torch

from mmcl import models
from mmcl.config import DataConfig, data_workers, load_config
from mmcl.evaluation.in_run import run_eval
from mmcl.training import plan as runtime
from mmcl.training.setup import evaluation_for

from helpers import COLOURS, ROOT, TRAINING_TOWERS, write_folder
from spawned import free_port


def test_cudnn_benchmark_is_on_for_a_cuda_device_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    runtime.set_cudnn_benchmark(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    runtime.set_cudnn_benchmark(torch.device("cuda"))
    assert torch.backends.cudnn.benchmark is True


def test_ddp_options_reach_the_accelerator(fresh_accelerate_state):
    cfg = load_config(None, ["train.ddp.static_graph=true", "train.ddp.gradient_as_bucket_view=true",
                             "train.ddp.bucket_cap_mb=50"])
    accelerator = runtime.make_accelerator("fp32", kwargs_handlers=runtime.ddp_options(cfg.train.ddp))
    assert accelerator.ddp_handler.to_kwargs() == {"static_graph": True, "gradient_as_bucket_view": True,
                                                   "bucket_cap_mb": 50}
    assert runtime.ddp_options(load_config(None, []).train.ddp) == []  # unset: torch's defaults
    fresh_accelerate_state()


@pytest.mark.slow
def test_two_processes_train_with_a_static_graph(demo, tmp_path):
    from helpers import run_args

    args = run_args(demo, tmp_path / "run", "train.steps=2", "data.batch_size=4", "data.workers=0",
                    "train.log_with=[]", "train.ddp.static_graph=true", "train.ddp.gradient_as_bucket_view=true")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "-m", "mmcl", "train", *args],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 process(es), MULTI_CPU" in p.stdout
    assert (tmp_path / "run" / "model").is_dir()


def test_evaluation_runs_under_the_run_mixed_precision(tmp_path, fresh_accelerate_state):
    data = write_folder(tmp_path / "zs", {c: [rgb, rgb] for c, rgb in COLOURS.items()})
    cfg = load_config(None, [*TRAINING_TOWERS, f"eval.zeroshot={data}"])
    model, _, pp, _, _, tokenizer = models.build(cfg.model)
    model.eval()
    seen = []
    model.visual.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    results = {}
    for precision in ("fp32", "bf16"):
        fresh_accelerate_state()
        accelerator = runtime.make_accelerator(precision)
        results[precision] = {}
        run_eval(evaluation_for(cfg), model, tokenizer, pp, accelerator, None, 4, results[precision])
    fresh_accelerate_state()
    assert seen[0] is False and seen[-1] is True, seen
    fp32, bf16 = (results[p]["zeroshot"]["zs"]["metrics"] for p in ("fp32", "bf16"))
    assert fp32.keys() == bf16.keys() and all(abs(fp32[k] - bf16[k]) <= 0.34 for k in fp32)


def test_bf16_eval_features_are_close_to_fp32():
    from mmcl.evaluation.evaluate import encode_texts

    cfg = load_config(None, TRAINING_TOWERS)
    model, *_, tokenizer = models.build(cfg.model)
    model.eval()
    texts = ["a red thing", "a green thing", "a blue thing"]
    with torch.no_grad():
        full = encode_texts(model, tokenizer, texts, 2, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = encode_texts(model, tokenizer, texts, 2, "cpu")
    assert half.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(full, half).min() > 0.99


def test_data_workers_default_from_the_cpus(monkeypatch):
    assert DataConfig().workers is None
    assert data_workers(3) == 3 and data_workers(0) == 0  # a set value stays as it is
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert data_workers(None) == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert data_workers(None) == 15  # no fixed cap: every CPU the process has feeds its step
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert data_workers(None) == 11  # 12 CPUs for each of 8 GPUs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert data_workers(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert data_workers(None) == 1
