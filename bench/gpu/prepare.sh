#!/usr/bin/env bash
# Run here, where the package registry is reachable: downloads, for the GPU machine (CPython 3.12, manylinux
# x86-64, no network there), the wheels of what mmcl's runtime requirements need beyond the packages that
# machine's image holds (bench/gpu/gpu_machine_packages.txt) into .whl/ (ignored by git, carried with the call),
# prints their total size and fails over LIMIT_MIB (default 60: the tree and the wheels travel in 64 MiB).
#
#   bench/gpu/prepare.sh              # check the list against pip's resolution, then download
#   bench/gpu/prepare.sh --no-check   # download only (the check resolves torch's metadata: about three minutes here)
#
# The check (bench/gpu/wheel_check.py): `pip install --dry-run --report` resolves pyproject.toml's dependencies for
# that platform; walking the resolution from mmcl's requirements through every package the machine lacks (not into
# those it has: its own releases of them have their requirements there), the packages reached must be exactly
# WHEELS. tests/test_gpu_proof.py walks the installed packages' metadata the same way, offline.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-60}
DEST=.whl
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

# The versions mmcl is tested with here (pip list of .venv); one line each, NAME==VERSION first.
# BEGIN WHEELS
WHEELS=(
  open-clip-torch==3.3.0   # mmcl: open-clip-torch>=3.0,<3.4
  webdataset==1.0.2        # mmcl: webdataset>=0.2.90
  omegaconf==2.4.0         # mmcl: omegaconf>=2.3
  braceexpand==0.1.7       # mmcl, webdataset
  faiss-cpu==1.15.1        # mmcl: faiss-cpu>=1.7 (mmcl index/search)
  ftfy==6.3.1              # open-clip-torch
  wcwidth==0.9.4           # ftfy
)
# END WHEELS

if [[ "${1:-}" != "--no-check" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" - >"$tmp/reqs.txt" <<'EOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
EOF
  echo "prepare: resolving mmcl's dependencies for CPython 3.12 manylinux x86-64 (pip --dry-run)"
  "$PY" -m pip install --quiet --dry-run --ignore-installed --report "$tmp/report.json" --target "$tmp/t" \
    "${PLATFORM[@]}" -r "$tmp/reqs.txt" 2>"$tmp/pip.err" || { cat "$tmp/pip.err" >&2; exit 1; }
  "$PY" bench/gpu/wheel_check.py "$tmp/report.json"
fi

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$DEST" $(printf '%s\n' "${WHEELS[@]}")
count=$(ls "$DEST"/*.whl | wc -l)
if [[ "$count" != "${#WHEELS[@]}" ]]; then
  echo "prepare: expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
  exit 1
fi
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
ls -1s --block-size=K "$DEST"
echo "prepare: $count wheels, $bytes bytes (about $mib MiB) in $DEST"
if (( bytes > LIMIT_MIB * 1048576 )); then
  echo "prepare: over the ${LIMIT_MIB} MiB limit (the working tree travels in the same 64 MiB)" >&2
  exit 1
fi
