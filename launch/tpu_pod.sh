#!/usr/bin/env bash
# Run a specjax command on every worker of a Cloud TPU VM pod slice.
#
#   launch/tpu_pod.sh TPU_NAME ZONE -- specjax generate --config=configs/generate.py --config.distributed=True
#
# Every host runs the same program; `--config.distributed=True` makes it call
# `jax.distributed.initialize()`, which on Cloud TPU discovers the coordinator and the process
# ids by itself. The repository must be present at the same path on every worker (e.g. cloned
# by a startup script); this script only fans the command out.
set -euo pipefail
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 TPU_NAME ZONE -- COMMAND..." >&2
  exit 2
fi
name=$1 zone=$2
shift 3
repo=${SPECJAX_REMOTE_DIR:-\$HOME/specjax}
cmd=$(printf '%q ' "$@")
exec gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "cd $repo && pip install -q -e . && $cmd"
