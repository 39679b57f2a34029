#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, with .whl/ carried (bench/gpu/prepare.sh made it): installs the
# wheels into a folder of their own, puts it and this checkout on PYTHONPATH (mmcl as an editable install would
# see it), then runs bench/gpu/proof.py within its budget. Everything goes to $OUT as it is made, at most 7 files
# (the device returns 8): install.log, nvidia-smi.txt, proof.log, pytest.log, e2e.log, summary.json, summary.md.
#
#   bash bench/gpu/run.sh [--budget-s 420] [other proof.py arguments]
#
# The budget is proof.py's own (it skips or cuts stages and arms to keep it); this script adds a hard stop 60 s after
# it, and summary.json is rewritten after every arm (summary.md after every stage), so a run killed from outside
# still returns what it had. 420 s of proof, the install and the machine's start fit a 15-minute device lease.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/proof-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/mmcl-site}
budget=420
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ "${args[$i]}" == "--budget-s" ]] && budget=${args[$((i + 1))]}
done

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
{
  echo "== $(date -u +%FT%TZ) $($PY --version 2>&1)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  echo "install exit $?"
} >"$OUT/install.log" 2>&1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Versions of what mmcl needs, and whether each requirement holds with the wheels on the path.
"$PY" - >>"$OUT/install.log" 2>&1 <<'EOF'
import importlib.metadata as md, tomllib
from packaging.requirements import Requirement
reqs = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
reqs += [r for r in md.requires("open-clip-torch") or [] if "extra" not in r]  # timm>=1.0.17 among them
for line in reqs:
    req = Requirement(line)
    try:
        have = md.version(req.name)
        print(f"{req.name} {have}: {'ok' if req.specifier.contains(have, prereleases=True) else 'NOT ' + str(req.specifier)}")
    except md.PackageNotFoundError:
        print(f"{req.name}: MISSING")
EOF
cat "$OUT/install.log"
timeout --signal=TERM --kill-after=10 $((${budget%.*} + 60)) \
  "$PY" bench/gpu/proof.py --out "$OUT" "$@" 2>&1 | tee "$OUT/proof.log"
code=${PIPESTATUS[0]}
[[ -f "$OUT/summary.md" ]] && cat "$OUT/summary.md"
exit "$code"
