#!/usr/bin/env bash
# Multi-node training under SLURM: one `accelerate launch` per node, which starts one process per GPU.
#   sbatch --nodes=4 launch/slurm.sh configs/vit-b-32.yaml train.output_dir=/shared/runs/b32
# Preemption and time limits (see launch/README.md): 120 s before the end SLURM sends SIGUSR1 to this script
# only (B:); the trap below passes SIGTERM on to srun -> accelerate launch -> every training process, which
# finish their step, save a checkpoint and exit; then the job requeues itself. The requeued job runs this same
# command, which resumes from that checkpoint.
#SBATCH --job-name=mmcl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=72:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm.sh CONFIG [key=value ...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}

stop_requested=0
on_stop() {
  stop_requested=1
  kill -TERM "$srun_pid" 2>/dev/null || true  # srun forwards it to the tasks (the launchers)
}
trap on_stop USR1 TERM

# Re-running the same command on the same train.output_dir resumes from the newest intact checkpoint,
# so a requeued job (preemption, node failure) continues where it stopped.
# The config and the overrides reach the inner shell as its arguments ("$0" "$@"), never as text it parses:
# a shard spec such as data.train=/data/shard-{000000..041455}.tar keeps its braces, a value its spaces.
# srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): without it each task is bound to one CPU, which
# the launcher's processes and their data loader workers would all share.
srun_args=(--kill-on-bad-exit=1)
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi
export GPUS_PER_NODE MASTER_ADDR MASTER_PORT
srun "${srun_args[@]}" bash -c 'exec accelerate launch \
  --config_file launch/multi-node.yaml \
  --num_machines "$SLURM_NNODES" \
  --num_processes "$((SLURM_NNODES * GPUS_PER_NODE))" \
  --machine_rank "$SLURM_NODEID" \
  --main_process_ip "$MASTER_ADDR" \
  --main_process_port "$MASTER_PORT" \
  -m mmcl train --config "$0" "$@"' "$CONFIG" "$@" &
srun_pid=$!

# `wait` returns as soon as a trapped signal arrives; keep waiting while the processes save their checkpoint.
status=0
while true; do
  wait "$srun_pid" && status=0 || status=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done

if [ "$stop_requested" = 1 ]; then
  echo "mmcl: stop signal: requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
# `mmcl train` run directly (one process, no launcher) exits 75 when a signal stopped it after a checkpoint.
if [ "$status" = 75 ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
