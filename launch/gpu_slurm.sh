#!/usr/bin/env bash
# Multi-node GPU run under SLURM: one process per node, all GPUs of a node per process.
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/gpu_slurm.sh specjax generate \
#       --config=configs/generate.py --config.distributed=True
#
# `jax.distributed.initialize()` (called by `--config.distributed=True`) reads the SLURM
# environment (coordinator address, process count and id) by itself.
#SBATCH --ntasks-per-node=1
#SBATCH --job-name=specjax
set -euo pipefail
pip install -q -e '.[gpu]'
srun "$@"
