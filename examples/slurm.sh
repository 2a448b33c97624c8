#!/bin/bash
# Multi-host training under SLURM: one task per node, every GPU of the node in that task.
#
#   sbatch examples/slurm.sh                  # 2 nodes × 8 GPUs: dp 2 × sp 8 by default
#   sbatch --nodes 4 examples/slurm.sh --dp 4 --sp 8 --steps 1000
#
# No --coordinator, --num-processes or --process-id: inside a SLURM job (SLURM_JOB_ID and SLURM_NTASKS > 1)
# train.py lets jax.distributed.initialize() find the coordinator (the first node of the job), the number of
# processes and this process's id itself. The processes then compare a hash of their run settings and all
# stop, in one line, if one was given other flags. --coordinator HOST:PORT still overrides the detection
# (with --num-processes and --process-id, e.g. from $SLURM_NTASKS and $SLURM_PROCID).
# Under Open MPI the same holds: mpirun -n 2 --map-by ppr:1:node python train.py --dp 2 --sp 8
#
#SBATCH --job-name=jaxring
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
source .venv/bin/activate

ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
  ARGS=(--dp "${SLURM_NNODES:-2}" --sp 8 --steps 1000)
fi

# SIGTERM (scancel, the time limit) and SIGHUP: each process finishes its step, saves and exits 143/129;
# --resume continues from the newest intact checkpoint. The checkpoint directory must be shared storage.
srun --kill-on-bad-exit=1 python train.py \
  --checkpoint-dir "checkpoints/${SLURM_JOB_NAME}" --checkpoint-every 200 --resume \
  --tensorboard "runs/${SLURM_JOB_NAME}/tb" \
  "${ARGS[@]}"
