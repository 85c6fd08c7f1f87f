#!/usr/bin/env bash
# Multi-host training under Slurm: one process per host, each driving all GPUs of its host.
#
#   sbatch --nodes=4 --gpus-per-node=8 scripts/launch_slurm.sh --config default --rules fsdp_tp \
#          --run-dir /shared/runs/exp1 [--resume] [key=value ...]
#
# JAX finds the coordinator (first host of the allocation), the process count and each
# process's id from Slurm's variables (jax.distributed.initialize's Slurm detection); the run
# directory must be on a file system every host sees (checkpoints are written collectively).
# Requeue after preemption with `--resume`: Slurm's SIGTERM makes every process finish the
# step in flight, write a checkpoint and exit 0.
#SBATCH --job-name=meshlab
#SBATCH --ntasks-per-node=1
#SBATCH --signal=TERM@120
#SBATCH --output=meshlab-%j.out
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# sbatch runs a copy of this file from Slurm's spool directory: then the repository is where the job was
# submitted from (sbatch ... scripts/launch_slurm.sh, run in the repository's root)
if [[ ! -f "$REPO/scripts/train.py" && -n "${SLURM_SUBMIT_DIR:-}" ]]; then
  REPO="$SLURM_SUBMIT_DIR"
fi
if [[ ! -f "$REPO/scripts/train.py" ]]; then
  echo "error: no scripts/train.py in $REPO; submit from the meshlab repository's root (cd it; sbatch ... scripts/launch_slurm.sh ARGS)" >&2
  exit 2
fi
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  echo "error: run this under Slurm (sbatch or salloc), e.g. sbatch --nodes=2 --gpus-per-node=8 $0 ARGS" >&2
  exit 2
fi
if [[ "${SLURM_NTASKS_PER_NODE:-1}" != "1" ]]; then
  echo "error: one task per node is expected (got --ntasks-per-node=${SLURM_NTASKS_PER_NODE}); each process drives its host's GPUs" >&2
  exit 2
fi
# Every GPU of the node belongs to the one process (Slurm may narrow CUDA_VISIBLE_DEVICES per task).
if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
  export CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((SLURM_GPUS_ON_NODE - 1)))"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
echo "meshlab: $SLURM_NNODES hosts x ${SLURM_GPUS_ON_NODE:-?} GPUs, job $SLURM_JOB_ID"
# srun forwards SIGTERM to every task; exec keeps python as the signalled process.
exec srun --kill-on-bad-exit=1 "$PYTHON" "$REPO/scripts/train.py" "$@"
