#!/usr/bin/env bash
# Multi-node training under SLURM: one `accelerate launch` per node, which starts one process per GPU.
#   sbatch --nodes=4 launch/slurm.sh configs/vit-b-32.yaml train.output_dir=/shared/runs/b32
#SBATCH --job-name=mmcl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=72:00:00
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm.sh CONFIG [key=value ...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
# Re-running the same command on the same train.output_dir resumes from the newest complete checkpoint,
# so a requeued job (preemption, node failure) continues where it stopped.
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
  --config_file launch/multi-node.yaml \
  --num_machines $SLURM_NNODES \
  --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
  --machine_rank \$SLURM_NODEID \
  --main_process_ip $MASTER_ADDR \
  --main_process_port $MASTER_PORT \
  -m mmcl train --config $CONFIG $*"
