"""pyproject.toml's torch floor is the release that brought the newest torch API mmcl calls: a user on the floor
gets an error from pip, not an AttributeError or ImportError in the middle of a run."""

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]

# API (as written in the code) -> the torch release that made it public.
SINCE = {
    r"torch\.get_device_module\b": "2.3",
    r"torch\.amp\.is_autocast_available\b": "2.4",
    r"torch\.amp\.GradScaler\b": "2.3",
    r"from torch\.distributed\.fsdp import [^\n]*\b(fully_shard|MixedPrecisionPolicy)\b": "2.6",
    r"torch\.compiler\.disable\b": "2.1",
    r"torch\.nn\.utils\.get_total_norm\b": "2.6",
    r"torch\.nn\.attention\.flex_attention\b": "2.5",
    r"from torch\.distributed\.tensor import\b": "2.5",
    r"torch\.accelerator\.": "2.6",
}
# The torchvision release made for each torch floor.
TORCHVISION_FOR = {"2.3": "0.18", "2.4": "0.19", "2.5": "0.20", "2.6": "0.21", "2.7": "0.22"}


def _requirements():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def _floor(req: Requirement) -> Version:
    return max(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))


def test_the_torch_floor_is_the_release_of_the_newest_api_used():
    used = {}
    for path in sorted((REPO / "mmcl").rglob("*.py")):
        text = path.read_text()
        for pattern, since in SINCE.items():
            if re.search(pattern, text):
                used.setdefault(since, []).append(f"{path.relative_to(REPO)}: {pattern}")
    assert used, "none of the listed APIs found: the table is stale"
    newest = max(used, key=Version)
    floor = _floor(_requirements()["torch"])
    assert floor >= Version(newest), (f"pyproject.toml says torch>={floor}, but mmcl uses torch {newest} API: "
                                      f"{used[newest]}")


def test_torchvision_floor_pairs_with_torch_floor():
    reqs = _requirements()
    torch_floor = _floor(reqs["torch"])
    want = TORCHVISION_FOR[f"{torch_floor.major}.{torch_floor.minor}"]
    assert _floor(reqs["torchvision"]) >= Version(want)
