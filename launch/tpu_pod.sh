#!/usr/bin/env bash
# A specjax job on a Cloud TPU VM slice (v5e, v6e, v4 ...): create it, copy this checkout to
# every worker, install with the TPU extra, run the same command on all workers, fetch the
# logs, delete the slice. Every step is a `gcloud compute tpus tpu-vm` command; --dry-run
# prints them and runs nothing.
#
#   launch/tpu_pod.sh [--dry-run] STEP [ARGS]
#     create NAME ZONE TYPE VERSION       e.g. create specjax-v5e europe-west4-b v5litepod-16 v2-alpha-tpuv5-lite
#     setup  NAME ZONE                    this checkout (git archive of HEAD) to ~/specjax on all workers,
#                                         then pip install -e '.[tpu]' there
#     run    NAME ZONE -- COMMAND...      COMMAND on all workers at once, in ~/specjax, output to
#                                         ~/specjax-logs/job-<worker hostname>.log on each worker
#     logs   NAME ZONE DEST               every worker's ~/specjax-logs/* into DEST/ (one file per worker)
#     delete NAME ZONE
#     all    NAME ZONE TYPE VERSION DEST -- COMMAND...    create, setup, run, logs, delete (delete
#                                         also runs when the job fails)
#
# The command must start the multi-controller runtime: pass --config.distributed=True to a
# specjax command (jax.distributed.initialize() then finds the coordinator and the process ids on
# Cloud TPU by itself). Example:
#   launch/tpu_pod.sh all specjax-v5e europe-west4-b v5litepod-16 v2-alpha-tpuv5-lite ./pod-logs -- \
#     specjax distill --config=configs/distill.py --config.distributed=True --workdir=/mnt/shared/distill
# (a distillation's workdir must be one file system all workers share, e.g. a GCS FUSE mount)
# Environment: WORKERS (default: all; e.g. 0 for one worker), PROJECT (gcloud --project, optional),
# SPECJAX_REMOTE_DIR (default: specjax, relative to the workers' home directory).
set -euo pipefail

dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
workers=${WORKERS:-all}
remote=${SPECJAX_REMOTE_DIR:-specjax}
project=()
if [ -n "${PROJECT:-}" ]; then
  project=(--project "$PROJECT")
fi

usage() {
  sed -n '2,24p' "$0" >&2
  exit 2
}

# Print a command (shell-quoted, one line), and run it unless --dry-run.
step() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$dry" -eq 0 ]; then
    "$@"
  fi
}

tpu() {
  step gcloud compute tpus tpu-vm "$@" ${project[@]+"${project[@]}"}
}

do_create() {
  [ $# -eq 4 ] || usage
  tpu create "$1" --zone "$2" --accelerator-type "$3" --version "$4"
}

do_setup() {
  [ $# -eq 2 ] || usage
  local archive
  archive=${TMPDIR:-/tmp}/specjax-$$.tar.gz
  step git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD || return
  tpu scp "$archive" "$1:specjax.tar.gz" --zone "$2" --worker="$workers" || return
  tpu ssh "$1" --zone "$2" --worker="$workers" --command \
    "mkdir -p $remote && tar -xzf specjax.tar.gz -C $remote && cd $remote && pip install -q -e '.[tpu]'" || return
  step rm -f "$archive"
}

do_run() {
  if [ $# -lt 4 ] || [ "$3" != "--" ]; then usage; fi
  local name=$1 zone=$2 cmd
  shift 3
  cmd=$(printf '%q ' "$@")
  tpu ssh "$name" --zone "$zone" --worker="$workers" --command \
    "mkdir -p specjax-logs && cd $remote && $cmd > ~/specjax-logs/job-\$(hostname).log 2>&1"
}

do_logs() {
  [ $# -eq 3 ] || usage
  step mkdir -p "$3"
  tpu scp "$1:specjax-logs/*" "$3/" --zone "$2" --worker="$workers"
}

do_delete() {
  [ $# -eq 2 ] || usage
  tpu delete "$1" --zone "$2" --quiet
}

do_all() {
  if [ $# -lt 7 ] || [ "$6" != "--" ]; then usage; fi
  local name=$1 zone=$2 type=$3 version=$4 dest=$5
  shift 6
  do_create "$name" "$zone" "$type" "$version"
  local rc=0
  { do_setup "$name" "$zone" && do_run "$name" "$zone" -- "$@"; } || rc=$?
  do_logs "$name" "$zone" "$dest" || true
  do_delete "$name" "$zone"
  return "$rc"
}

[ $# -ge 1 ] || usage
what=$1
shift
case $what in
  create) do_create "$@" ;;
  setup) do_setup "$@" ;;
  run) do_run "$@" ;;
  logs) do_logs "$@" ;;
  delete) do_delete "$@" ;;
  all) do_all "$@" ;;
  *) usage ;;
esac
