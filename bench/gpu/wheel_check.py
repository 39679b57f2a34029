"""Which packages the GPU machine must be given as wheels: mmcl's runtime requirements and, through them, every
requirement of a package the machine lacks, minus what the machine's image holds. A package the machine has is not
descended into (its installed release has its own requirements there).

    python bench/gpu/wheel_check.py REPORT.json   # from `pip install --dry-run --report` (bench/gpu/prepare.sh)

Without a report, the requirements of the packages installed in this environment are walked instead
(tests/test_gpu_proof.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Set

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages() -> Set[str]:
    return {norm(w) for line in (HERE / "gpu_machine_packages.txt").read_text().splitlines()
            if not line.startswith("#") for w in line.split()}


def mmcl_requirements() -> List[str]:
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def wheel_list() -> Dict[str, str]:
    """NAME -> VERSION of the WHEELS list in prepare.sh (between its BEGIN/END WHEELS lines)."""
    text = (HERE / "prepare.sh").read_text()
    block = text.split("# BEGIN WHEELS", 1)[1].split("# END WHEELS", 1)[0]
    pins = re.findall(r"^\s+([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", block, re.M)
    return {norm(n): v for n, v in pins}


def needed(requirements: Iterable[str], requires_of: Callable[[str], Optional[List[str]]],
           environment: Optional[Dict[str, str]] = None) -> Set[str]:
    """The packages, not on the machine, that `requirements` need (transitively through such packages).
    `requires_of(name)` gives a package's Requires-Dist (None when unknown)."""
    from packaging.requirements import Requirement

    machine = machine_packages()
    env = dict(environment or {}, extra="")
    out: Set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra's requirement, or another platform's
        name = norm(req.name)
        if name in machine or name in out:
            continue
        out.add(name)
        todo += requires_of(name) or []
    return out


def from_report(path: str) -> Set[str]:
    report = json.loads(Path(path).read_text())
    requires = {norm(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in report["install"]}
    return needed(mmcl_requirements(), requires.get, report.get("environment"))


def from_installed() -> Set[str]:
    import importlib.metadata as md

    def requires_of(name: str) -> Optional[List[str]]:
        try:
            return md.requires(name) or []
        except md.PackageNotFoundError:
            return None

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    return needed(mmcl_requirements(), requires_of, env)


def main(argv: List[str]) -> int:
    need = from_report(argv[0]) if argv else from_installed()
    wheels = set(wheel_list())
    missing, extra = sorted(need - wheels), sorted(wheels - need)
    print(f"wheel_check: the GPU machine lacks {sorted(need)}")
    if missing or extra:
        print(f"wheel_check: prepare.sh's WHEELS differs: missing {missing}, not needed {extra}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
