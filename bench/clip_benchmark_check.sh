#!/usr/bin/env bash
# Zero-shot accuracy of one model by LAION's CLIP_benchmark (its own loader, data reader and metrics) and by
# `mmcl zeroshot`, on the demo colour set. The two acc1 must agree within 0.5 points.
#
#   bench/clip_benchmark_check.sh MODEL DEMO_DATA [WORK_DIR]
#
# MODEL      an mmcl run dir, its model/, or an export (e.g. runs/tiny)
# DEMO_DATA  the output of `mmcl demo-data --out DIR` (uses DIR/zeroshot/colour)
# WORK_DIR   scratch directory (default: a new temp dir)
#
# CLIP_benchmark 1.6.2 needs numpy < 2.3 and imports requests, so it lives in its own venv (CB_VENV, default
# /tmp/cb-venv), never in the project's:
#   python -m venv /tmp/cb-venv
#   /tmp/cb-venv/bin/pip install "numpy<2.3" requests clip-benchmark==1.6.2 torch==2.14.1 torchvision==0.29.1 open-clip-torch
# (To save the 5.6 GB torch install, a .pth file in that venv's site-packages pointing at the project venv's
# site-packages works too: the venv's own numpy < 2.3 comes first on sys.path.)
set -euo pipefail

MODEL=${1:?usage: $0 MODEL DEMO_DATA [WORK_DIR]}
DEMO=${2:?usage: $0 MODEL DEMO_DATA [WORK_DIR]}
WORK=${3:-$(mktemp -d /tmp/cb-check.XXXXXX)}
CB_VENV=${CB_VENV:-/tmp/cb-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
FOLDER=$DEMO/zeroshot/colour
mkdir -p "$WORK"

# 1. open_clip export: the directory CLIP_benchmark loads with open_clip.create_model_and_transforms("local-dir:...").
"$PY" -m mmcl export --model "$MODEL" --format open_clip --out "$WORK/export" >&2

# 2. The demo ImageFolder as a CLIP_benchmark WebDataset set: DIR/test/{0.tar,nshards.txt}, classnames.txt,
#    zeroshot_classification_templates.txt (CLIP_benchmark formats templates with {c}).
"$PY" - "$FOLDER" "$WORK/wds_colour" <<'EOF'
import os, sys
import webdataset as wds

src, dst = sys.argv[1], sys.argv[2]
classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
names_file = os.path.join(src, "classnames.txt")
names = [l.strip() for l in open(names_file) if l.strip()] if os.path.isfile(names_file) else classes
assert len(names) == len(classes), (names, classes)
os.makedirs(os.path.join(dst, "test"), exist_ok=True)
n = 0
with wds.TarWriter(os.path.join(dst, "test", "0.tar")) as sink:
    for label, cls in enumerate(classes):  # ImageFolder labelling: sorted folder index
        for fname in sorted(os.listdir(os.path.join(src, cls))):
            stem, ext = os.path.splitext(fname)
            with open(os.path.join(src, cls, fname), "rb") as f:
                sink.write({"__key__": f"{cls}_{stem}", ext.lstrip(".").lower(): f.read(), "cls": label})
            n += 1
open(os.path.join(dst, "test", "nshards.txt"), "w").write("1\n")
open(os.path.join(dst, "classnames.txt"), "w").write("\n".join(names) + "\n")
templates = [l.strip() for l in open(os.path.join(src, "templates.txt")) if l.strip()]
open(os.path.join(dst, "zeroshot_classification_templates.txt"), "w").write(
    "\n".join(t.replace("{}", "{c}") for t in templates) + "\n")
print(f"wrote {n} samples, {len(names)} classes, {len(templates)} templates to {dst}", file=sys.stderr)
EOF

# 3. CLIP_benchmark, fp32 (--no_amp: on a CPU its default autocast computes in bfloat16).
T0=$(date +%s.%N)
( cd "$WORK" && "$CB_VENV/bin/clip_benchmark" eval --model_type open_clip --model "local-dir:$WORK/export" \
    --pretrained "" --dataset wds/colour --dataset_root "$WORK/wds_colour" --task zeroshot_classification \
    --no_amp --batch_size 64 --num_workers 0 --quiet --output "$WORK/cb_colour.json" >&2 )
T1=$(date +%s.%N)

# 4. mmcl on the same shards (CLIP_benchmark layout) and on the original ImageFolder.
"$PY" -m mmcl zeroshot --model "$WORK/export" --data "$WORK/wds_colour/test/0.tar" --out "$WORK/mmcl_wds.json" \
    --batch-size 64 > /dev/null
T2=$(date +%s.%N)
"$PY" -m mmcl zeroshot --model "$MODEL" --data "$FOLDER" --out "$WORK/mmcl_folder.json" > /dev/null

# 5. One JSON line per measurement, the wall times, then the comparison; non-zero exit when acc1 differs by more than
#    0.5 points.
"$PY" - "$WORK" "$T0" "$T1" "$T2" <<'EOF'
import json, sys

work = sys.argv[1]
t0, t1, t2 = map(float, sys.argv[2:5])
cb = json.load(open(f"{work}/cb_colour.json"))
rows = {"clip_benchmark": cb["metrics"], "mmcl_shards": json.load(open(f"{work}/mmcl_wds.json"))["metrics"],
        "mmcl_imagefolder": json.load(open(f"{work}/mmcl_folder.json"))["metrics"]}
for name, m in rows.items():
    print(json.dumps({"bench": "clip_benchmark_check", "evaluator": name, "dataset": "demo colour", **m}))
ref = rows["clip_benchmark"]["acc1"]
diffs = {k: 100 * abs(v["acc1"] - ref) for k, v in rows.items() if k != "clip_benchmark"}
ok = all(d <= 0.5 for d in diffs.values())
# wall time of each whole command (process start, model load, data, metrics), same batch size, one process
print(json.dumps({"bench": "clip_benchmark_check", "wall_s_clip_benchmark": round(t1 - t0, 1),
                  "wall_s_mmcl": round(t2 - t1, 1),
                  "ratio_wall_mmcl_over_clip_benchmark": round((t2 - t1) / (t1 - t0), 3)}))
print(json.dumps({"bench": "clip_benchmark_check", "acc1_diff_points_vs_clip_benchmark": diffs,
                  "ratio_acc1_mmcl_over_clip_benchmark": rows["mmcl_shards"]["acc1"] / ref if ref else None,
                  "agree_within_0.5_points": ok}))
sys.exit(0 if ok else 1)
EOF
