#!/usr/bin/env bash
# A multi-node GPU job under SLURM: the same specjax command in every process, which starts
# the multi-controller runtime itself (--config.distributed=True: jax.distributed.initialize()
# reads the coordinator, the process count and this process's id from SLURM's environment).
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/gpu_slurm.sh [--dry-run] -- \
#       specjax distill --config=configs/distill.py --config.distributed=True --workdir=/shared/distill
#
# Explicit choices (environment variables, set with `sbatch --export=ALL,NAME=VALUE`):
#   SPECJAX_PROCESSES=node (default)  one process per node driving all GPUs of its node
#                                     (SPECJAX_LOCAL_DEVICE_IDS=0,...,G-1 for jax.distributed);
#                    =gpu             one process per GPU: JAX gives task i of a node its GPU i
#                                     (SLURM_LOCALID); submit with --ntasks-per-node=G.
#   SPECJAX_INSTALL=shared (default)  the environment lives on a shared file system: installed
#                                     once, here on the batch host, before the job step;
#                  =per-node          installed on every node's local disk first (one task per node);
#                  =none              already installed; nothing is run.
# The workdir of a distillation must be on a file system all nodes share (checkpoints are
# written by every process).
#SBATCH --ntasks-per-node=1
#SBATCH --job-name=specjax
set -euo pipefail

dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
if [ "${1:-}" = "--" ]; then
  shift
fi
if [ $# -lt 1 ]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi

step() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$dry" -eq 0 ]; then
    "$@"
  fi
}

nodes=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}
gpus=${gpus##*:}                        # "gpu:8" -> 8
install=(python -m pip install -q -e '.[gpu]')
case ${SPECJAX_INSTALL:-shared} in
  shared) step "${install[@]}" ;;
  per-node) step srun --nodes="$nodes" --ntasks-per-node=1 "${install[@]}" ;;
  none) ;;
  *) echo "SPECJAX_INSTALL=${SPECJAX_INSTALL}: expected shared, per-node or none" >&2; exit 2 ;;
esac
case ${SPECJAX_PROCESSES:-node} in
  node)
    ids=$(seq -s, 0 $((gpus - 1)))
    step env SPECJAX_LOCAL_DEVICE_IDS="$ids" srun --nodes="$nodes" --ntasks-per-node=1 "$@" ;;
  gpu) step srun --nodes="$nodes" --ntasks-per-node="$gpus" "$@" ;;
  *) echo "SPECJAX_PROCESSES=${SPECJAX_PROCESSES}: expected node or gpu" >&2; exit 2 ;;
esac
