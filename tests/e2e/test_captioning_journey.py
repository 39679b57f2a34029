"""A CoCa run end to end (`model.name coca_tiny`, `loss.caption` beside `loss.clip`): it trains with the validation
loss and the weight average, resumes to the uninterrupted run's weights, evaluates zero-shot and retrieval, exports
to a folder open_clip loads bit-exactly, and `mmcl caption` writes captions from the run and from the export."""

import csv
import json

import open_clip
import pytest
import torch
from safetensors.torch import load_file

import mmcl
from mmcl.cli import main
from mmcl.evaluation.captioning import generate

from helpers import final_weights, metrics, short_run

CAPTION_RUN = ["model.name=coca_tiny", "loss.caption=1.0", "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def runs(small_demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("coca")
    val = f"eval.val_loss={small_demo['val']}"
    assert main(short_run(small_demo, root / "whole", *CAPTION_RUN, "train.steps=4", val, towers=[])) == 0
    assert main(short_run(small_demo, root / "parts", *CAPTION_RUN, "train.steps=2", val, towers=[])) == 0
    assert main(short_run(small_demo, root / "parts", *CAPTION_RUN, "train.steps=4", val, towers=[])) == 0
    return root


@pytest.mark.slow
def test_a_coca_run_logs_its_caption_term_and_resumes_to_the_uninterrupted_weights(runs):
    records = metrics(runs / "whole")
    assert [r["step"] for r in records if "loss/caption" in r] == [1, 2, 3, 4]
    assert all(r["loss"] == pytest.approx(r["loss/clip"] + r["loss/caption"], rel=1e-5) for r in records
               if "loss/caption" in r)
    assert any("val/loss/caption" in r for r in records)
    whole, parts = final_weights(runs / "whole"), final_weights(runs / "parts")
    assert whole.keys() == parts.keys() and any(k.startswith("text_decoder.") for k in whole)
    for k in whole:
        assert torch.equal(whole[k], parts[k]), k


@pytest.mark.slow
def test_the_open_clip_export_loads_bit_exactly_in_open_clip_and_captions_alike(runs, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", "--model", str(runs / "whole"), "--format", "open_clip", "--out", str(export)]) == 0
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    assert type(model) is open_clip.CoCa
    saved = load_file(str(runs / "whole" / "model" / "open_clip_model.safetensors"))
    state = model.state_dict()
    assert state.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    ours, pre, tokenizer = mmcl.load(str(runs / "whole"))
    from PIL import Image

    images = torch.stack([preprocess(Image.new("RGB", (40, 30), c)) for c in ((200, 20, 20), (20, 20, 200))])
    torch.testing.assert_close(images, torch.stack([pre(Image.new("RGB", (40, 30), c))
                                                    for c in ((200, 20, 20), (20, 20, 200))]))
    model.eval()
    for beams in (1, 3):
        got = generate(model, images, tokenizer.sot_token_id, tokenizer.eot_token_id, max_length=6, beams=beams)
        want = generate(ours.eval(), images, tokenizer.sot_token_id, tokenizer.eot_token_id, max_length=6,
                        beams=beams)
        assert got == want and all(len(t) <= 5 for t in got)
    # transformers' CLIPModel has no decoder: the hf format refuses in one line
    assert main(["export", "--model", str(runs / "whole"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "multimodal_cfg" in capsys.readouterr().err
    # safetensors keeps the decoder (mmcl.load reads it back whole); onnx exports the two encoders, checked by export
    assert main(["export", "--model", str(runs / "whole"), "--format", "safetensors", "--out",
                 str(tmp_path / "st")]) == 0
    again, _, _ = mmcl.load(str(tmp_path / "st"))
    assert all(torch.equal(v, saved[k]) for k, v in again.state_dict().items())
    assert main(["export", "--model", str(runs / "whole"), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    assert json.loads((tmp_path / "onnx" / "mmcl_export.json").read_text())["min_cosine_vs_source"] > 0.999


@pytest.mark.slow
def test_mmcl_caption_writes_one_caption_per_image_from_a_run_and_from_an_export(runs, small_demo, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", "--model", str(runs / "whole"), "--format", "open_clip", "--out", str(export)]) == 0
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (20, 20), (255, 0, 0)).save(folder / "a.png")
    Image.new("RGB", (20, 20), (0, 0, 255)).save(folder / "sub" / "b.jpg")
    (folder / "broken.png").write_bytes(b"not an image")
    capsys.readouterr()
    assert main(["caption", "--model", str(runs / "whole"), "--images", str(folder), "--out",
                 str(tmp_path / "run.jsonl"), "--max-length", "6", "--no-progress"]) == 0
    said = capsys.readouterr()
    assert "skipped 1 images" in said.err and "broken.png" in said.err
    rows = [json.loads(ln) for ln in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == ["a.png", "sub/b.jpg"]
    assert json.loads(said.out)["n_captioned"] == 2 and json.loads(said.out)["skipped"] == {"decode": 1}
    # the same captions from the export, greedy, and beam search from shards as CSV
    assert main(["caption", "--model", str(export), "--images", str(folder), "--out", str(tmp_path / "exp.jsonl"),
                 "--max-length", "6", "--no-progress"]) == 0
    assert (tmp_path / "exp.jsonl").read_text() == (tmp_path / "run.jsonl").read_text()
    assert main(["caption", "--model", str(export), "--images", small_demo["val"], "--out",
                 str(tmp_path / "val.csv"), "--beams", "2", "--max-length", "6", "--no-progress"]) == 0
    with open(tmp_path / "val.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and all(r["key"] for r in table)
    # bad input: one line each, nothing overwritten
    capsys.readouterr()
    for argv, says in (
            (["--out", str(tmp_path / "run.jsonl")], "exists; mmcl caption writes a new file"),
            (["--out", str(tmp_path / "x.txt")], "--out must end in .jsonl or .csv"),
            (["--out", str(tmp_path / "y.jsonl"), "--max-length", "99"], "--max-length must be in 1..32"),
            (["--out", str(tmp_path / "z.jsonl"), "--images", str(tmp_path / "empty")], "no images")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        base = ["caption", "--model", str(runs / "whole"), "--images", str(folder), "--no-progress"]
        assert main(base + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mmcl: error: ") and says in err[0], err
    assert (tmp_path / "run.jsonl").read_text() == (tmp_path / "exp.jsonl").read_text()


@pytest.mark.slow
def test_retrieval_and_zeroshot_work_on_a_coca_run(runs, small_demo, tmp_path):
    assert main(["retrieval", "--model", str(runs / "whole"), "--data", small_demo["val"], "--out",
                 str(tmp_path / "r.json")]) == 0
    recall = json.loads((tmp_path / "r.json").read_text())["metrics"]
    assert 0 <= recall["image_retrieval_recall@5"] <= 1
    assert main(["zeroshot", "--model", str(runs / "whole"), "--data", small_demo["zeroshot_colour"], "--out",
                 str(tmp_path / "z.json")]) == 0
    assert 0 <= json.loads((tmp_path / "z.json").read_text())["metrics"]["acc1"] <= 1


@pytest.mark.slow
def test_mmcl_caption_refuses_a_model_without_a_decoder(small_demo, tmp_path, capsys):
    assert main(short_run(small_demo, tmp_path / "plain")) == 0
    capsys.readouterr()
    assert main(["caption", "--model", str(tmp_path / "plain"), "--images", small_demo["val"], "--out",
                 str(tmp_path / "c.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no captioning decoder" in err[0]
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.slow
def test_reinforce_captions_from_a_run_adds_its_captions_and_the_new_shards_train(runs, small_demo, tmp_path,
                                                                                capsys):
    out = tmp_path / "reinforced"
    assert main(["reinforce", "--captions-from", str(runs / "whole"), "--data", small_demo["train"], "--out",
                 str(out), "--max-length", "6", "--no-progress"]) == 0
    # each sample's KEY.gen.txt is the caption `mmcl caption` writes for its image; every other member is kept
    assert main(["caption", "--model", str(runs / "whole"), "--images", small_demo["train"], "--out",
                 str(tmp_path / "c.jsonl"), "--max-length", "6", "--no-progress"]) == 0
    want = {r["key"]: r["caption"] for r in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())}
    import tarfile

    got, members = {}, set()
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                members.add(ext)
                if ext == "gen.txt":
                    got[key] = tar.extractfile(m).read().decode()
    assert got == want and len(got) == 64 and {"jpg", "txt", "gen.txt"} <= members
    # the generated captions train, alone as the caption source
    assert main(short_run(str(out / "shard-{000000..000001}.tar"), tmp_path / "run", *CAPTION_RUN,
                          "data.caption_key=gen.txt", towers=[])) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    capsys.readouterr()
    assert main(["reinforce", "--captions-from", str(runs / "whole"), "--teacher", str(runs / "whole"), "--data",
                 small_demo["train"], "--out", str(tmp_path / "both")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one of --teacher" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["train.phases=[{fraction: 0.5, image_size: 32, context_length: 16, patch_dropout: 0.5}, {}]"],
    ["model.lock_image=true", "model.grad_checkpointing=true"],
], ids=["phases_patch_dropout", "locked_image_checkpointed"])
def test_a_coca_run_takes_phases_patch_dropout_locks_and_checkpointing(small_demo, tmp_path, extra):
    assert main(short_run(small_demo, tmp_path / "run", *CAPTION_RUN, *extra, towers=[])) == 0
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["loss/caption"] < 20 for r in records)
    if "model.lock_image=true" in extra:  # the locked image tower did not move from its start (train.seed 0)
        from mmcl import models
        from mmcl.config import load_config

        torch.manual_seed(0)
        fresh, *_ = models.build(load_config(None, ["model.name=coca_tiny"]).model)
        start = {k: v for k, v in fresh.state_dict().items() if k.startswith("visual.")}
        end = final_weights(tmp_path / "run")
        assert all(torch.equal(end[k], v) for k, v in start.items())
        assert not all(torch.equal(end[k], v) for k, v in fresh.state_dict().items() if k.startswith("text_decoder."))


@pytest.mark.slow
def test_a_coca_run_under_fsdp_trains_to_the_weights_of_ddp(small_demo, tmp_path):
    """FSDP2 on 2 CPU processes (tests/fsdp_cpu_shim.py, as tests/e2e/test_distributed_fsdp.py launches it) against
    DDP, float32, 4 steps: the decoder shards and trains like the towers."""
    import os
    import subprocess

    import yaml

    from helpers import ACCELERATE_LAUNCH, ROOT, run_args

    cfg = yaml.safe_load((ROOT / "launch" / "fsdp.yaml").read_text())
    cfg.update(num_processes=2, mixed_precision="no", use_cpu=True)
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(cfg))
    shim = str(ROOT / "tests" / "fsdp_cpu_shim.py")
    out = {}
    for how, config, program in (("fsdp", tmp_path / "fsdp.yaml", [shim]),
                                 ("ddp", ROOT / "launch" / "cpu-2proc.yaml", ["-m", "mmcl"])):
        # CAPTION_RUN without its EMA, which FSDP refuses
        args = run_args(small_demo, tmp_path / how, *CAPTION_RUN[:2], "train.steps=4", "train.save_every=2",
                        "data.batch_size=4", "data.workers=0", "train.log_every=2", "train.log_with=[]",
                        "optim.warmup_steps=0", towers=[])
        p = subprocess.run([*ACCELERATE_LAUNCH, "--config_file", str(config), *program, "train", *args],
                           env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        out[how] = p.stdout
    assert "2 process(es), FSDP on cpu" in out["fsdp"]  # accelerate's FSDP path, not a fallback to DDP
    a, b = final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys() and any(k.startswith("text_decoder.") for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
