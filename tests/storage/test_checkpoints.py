"""Training checkpoints on disk (mmcl/storage/checkpoints.py): the step-N layout, the COMPLETE marker that records
every file's size and SHA-256, rotation to the newest `keep`, the `latest` pointer, verification and setting a
damaged checkpoint aside, and reading the model back bit for bit."""

import hashlib
import json
import pickle
import re

import pytest
import torch
from accelerate import Accelerator

from mmcl.errors import CheckpointError
from mmcl.run.processes import agreed
from mmcl.storage import checkpoints as ck

META = {"model_cfg": {"embed_dim": 4}, "preprocess_cfg": {"size": 8}}


@pytest.fixture
def saver(cpu_device, tmp_path):
    """save(step) writes one checkpoint of a tiny model with one process; returns (save, model, ckpt_dir)."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ckpt_dir = tmp_path / "run" / ck.CHECKPOINTS_DIR

    def save(step, keep=0):
        with torch.no_grad():
            model.weight.add_(1.0)  # each step's weights differ
        return ck.save_checkpoint(accelerator, ckpt_dir, {"step": step, "samples": 8 * step}, {"position": step},
                                  keep, agreed, model_meta=META)

    return save, model, ckpt_dir


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_checkpoint_records_every_file_it_holds_with_its_size_and_sha256(saver):
    save, model, ckpt_dir = saver
    ckpt = save(3)
    assert ckpt == ckpt_dir / "step-00000003" and ckpt.is_dir()
    marker = json.loads((ckpt / ck.COMPLETE).read_text())
    assert (marker["step"], marker["samples"], marker["world_size"]) == (3, 24, 1)
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != ck.COMPLETE)
    assert sorted(marker["files"]) == on_disk
    assert {ck.MODEL_WEIGHTS, ck.MODEL_CONFIG, "rank_state_0.pt"} <= set(on_disk)
    for rel, want in marker["files"].items():
        assert want == {"size": (ckpt / rel).stat().st_size, "sha256": _sha256(ckpt / rel)}, rel
    assert ck.read_marker(ckpt) == marker
    assert json.loads((ckpt / ck.MODEL_CONFIG).read_text()) == META
    assert ck.load_plain(ck.rank_state_file(ckpt, 0)) == {"position": 3}
    assert (ckpt_dir / ck.LATEST).read_text() == "step-00000003"
    assert [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")] == []
    assert ck.verify_checkpoint(ckpt) is None and ck.is_checkpoint(ckpt)


def test_rotation_keeps_exactly_the_newest_keep_checkpoints_and_latest_names_the_newest(saver):
    save, _, ckpt_dir = saver
    for step in (1, 2, 3, 4, 5):
        save(step, keep=2)
        kept = [p.name for p in ck.list_checkpoints(ckpt_dir)]
        assert kept == [f"step-{s:08d}" for s in range(max(1, step - 1), step + 1)]
        assert (ckpt_dir / ck.LATEST).read_text() == f"step-{step:08d}"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [ck.LATEST, "step-00000004", "step-00000005"]
    for step in (6, 7, 8):
        save(step, keep=0)  # 0 keeps all
    assert len(ck.list_checkpoints(ckpt_dir)) == 5


def test_the_model_read_back_is_the_saved_weights_bit_for_bit(saver):
    save, model, _ = saver
    ckpt = save(1)
    state, meta = ck.model_of_checkpoint(ckpt)
    want = {k: v.detach() for k, v in model.state_dict().items()}
    assert sorted(state) == sorted(want) and meta == META
    for name, tensor in want.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    (ckpt / ck.COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="incomplete: it has no COMPLETE marker"):
        ck.model_of_checkpoint(ckpt)


def test_latest_falls_back_to_the_newest_complete_checkpoint_ordered_by_the_marker(saver):
    save, _, ckpt_dir = saver
    a, b = save(1), save(2)
    assert ck.latest_checkpoint(ckpt_dir) == b
    (b / ck.COMPLETE).unlink()  # an interrupted save that `latest` still names
    assert ck.latest_checkpoint(ckpt_dir) == a and ck.list_checkpoints(ckpt_dir) == [a]
    (ckpt_dir / ck.LATEST).unlink()
    assert ck.latest_checkpoint(ckpt_dir) == a
    assert ck.latest_checkpoint(ckpt_dir / "nothing") is None


@pytest.mark.parametrize("damage,reason", [
    ("truncate", r"model.safetensors has \d+ bytes, \d+ were written"),
    ("flip", r"model.safetensors differs from what was written \(SHA-256 mismatch\)"),
    ("delete", "model.safetensors is missing"),
    ("marker", "its COMPLETE marker is unreadable"),
])
def test_a_damaged_checkpoint_is_named_and_the_older_intact_one_is_used(saver, damage, reason):
    save, _, ckpt_dir = saver
    older, newer = save(1), save(2)
    weights = newer / ck.MODEL_WEIGHTS
    raw = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(raw[:-1])
    elif damage == "flip":
        weights.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "delete":
        weights.unlink()
    else:
        (newer / ck.COMPLETE).write_text("{not json")
    damaged, usable = ck.damaged_and_usable(ckpt_dir)
    assert usable == older and len(damaged) == 1
    assert damaged[0][0] == newer
    assert re.match(reason, damaged[0][1]), damaged[0][1]
    assert ck.newest_verified_checkpoint(ckpt_dir) == older
    assert ck.newest_run_weights(ckpt_dir.parent) == older
    if damage != "marker":  # checking only another file passes
        assert ck.verify_checkpoint(newer, only=("rank_state_0.pt",)) is None
    first = ck.set_aside(newer)
    assert first.name == "damaged-step-00000002" and not newer.exists()
    newer.mkdir()
    assert ck.set_aside(newer).name == "damaged-step-00000002-2"
    assert ck.list_checkpoints(ckpt_dir) == [older]


def test_load_plain_refuses_a_file_that_names_code_and_bytes_that_are_no_torch_file(tmp_path):
    tensors = tmp_path / "ok.pt"
    torch.save({"a": torch.arange(3), "b": [1, "x"]}, tensors)
    got = ck.load_plain(tensors)
    assert torch.equal(got["a"], torch.arange(3)) and got["b"] == [1, "x"]
    code = tmp_path / "code.pt"
    code.write_bytes(pickle.dumps(print, protocol=2))  # a global: loading it by name would run what it names
    with pytest.raises(CheckpointError, match="refusing .*code.pt: it does not load as plain tensors"):
        ck.load_plain(code)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x80\x02nonsense")
    with pytest.raises(CheckpointError, match=r"cannot read .*junk.pt: it is not a file of tensors \(Unsupported"):
        ck.load_plain(junk)


def test_is_checkpoint_knows_a_checkpoint_by_marker_rank_state_or_name(tmp_path):
    folder = tmp_path / ck.CHECKPOINTS_DIR
    for name in ("step-00000004", ".tmp-step-00000005", "damaged-step-00000003-2", "notes"):
        (folder / name).mkdir(parents=True)
    assert [ck.is_checkpoint(folder / n) for n in ("step-00000004", ".tmp-step-00000005",
                                                   "damaged-step-00000003-2", "notes")] == [True, True, True, False]
    elsewhere = tmp_path / "other" / "step-00000004"
    elsewhere.mkdir(parents=True)
    assert not ck.is_checkpoint(elsewhere)
    (elsewhere / ck.COMPLETE).write_text("{}")
    assert ck.is_checkpoint(elsewhere)


def test_state_bytes_counts_parameters_and_two_adam_moments_per_trainable_value():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).half())
    model[0].bias.requires_grad_(False)
    # float32 weight 12 + bias 4 (frozen), float16 weight 8 + bias 2
    assert ck.state_bytes(model) == (12 * 4 + 12 * 8) + 4 * 4 + (8 * 2 + 8 * 8) + (2 * 2 + 2 * 8)
    assert ck.state_bytes(model, optimizer_slots=0) == 12 * 4 + 4 * 4 + 8 * 2 + 2 * 2
