#!/usr/bin/env bash
# Start N CPU processes of one multi-process JAX job on this machine (coordinator on 127.0.0.1).
#
#   launch/local_cpu.sh N [--port P] [--logs DIR] [--dry-run] -- COMMAND...
#   e.g. launch/local_cpu.sh 2 -- specjax distill --config=configs/distill.py \
#            --config.distributed=True --workdir=/tmp/distill-2proc
#
# Every process runs COMMAND with SPECJAX_COORDINATOR=127.0.0.1:P, SPECJAX_NUM_PROCESSES=N,
# SPECJAX_PROCESS_ID=i and JAX_PLATFORMS=cpu; `specjax.distributed.initialize()` (what
# `--config.distributed=True` calls) reads them and switches on CPU collectives (gloo). Each
# process's output goes to DIR/process-i.log (default: a new temporary directory). The script
# waits for all of them; if one fails, the others are stopped, and the exit status is that of the
# first process that failed. Interrupting the script stops them all. --dry-run prints the
# commands and starts nothing. Needs bash >= 4.3 (wait -n).
set -euo pipefail

usage() {
  echo "usage: $0 N [--port P] [--logs DIR] [--dry-run] -- COMMAND..." >&2
  exit 2
}

[ $# -ge 1 ] || usage
n=$1
shift
case $n in ''|*[!0-9]*) usage ;; esac
[ "$n" -ge 1 ] || usage
port=${SPECJAX_PORT:-12731}
logs=""
dry=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --port) [ $# -ge 2 ] || usage; port=$2; shift 2 ;;
    --logs) [ $# -ge 2 ] || usage; logs=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) usage ;;
  esac
done
[ $# -ge 2 ] || usage
shift                                    # the "--"

if [ "$dry" -eq 1 ]; then
  for ((i = 0; i < n; i++)); do
    printf 'SPECJAX_COORDINATOR=127.0.0.1:%s SPECJAX_NUM_PROCESSES=%s SPECJAX_PROCESS_ID=%s JAX_PLATFORMS=cpu' \
      "$port" "$n" "$i"
    printf ' %q' "$@"
    printf ' > %s/process-%s.log 2>&1 &\n' "${logs:-LOGDIR}" "$i"
  done
  echo "wait"
  exit 0
fi

[ -n "$logs" ] || logs=$(mktemp -d "${TMPDIR:-/tmp}/specjax-local.XXXXXX")
mkdir -p "$logs"
pids=()
stop_all() {                             # each process leads its own group: stop it and its children
  for pid in "${pids[@]}"; do
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  done
}
trap 'stop_all; exit 130' INT TERM HUP

for ((i = 0; i < n; i++)); do
  SPECJAX_COORDINATOR=127.0.0.1:$port SPECJAX_NUM_PROCESSES=$n SPECJAX_PROCESS_ID=$i JAX_PLATFORMS=cpu \
    setsid "$@" > "$logs/process-$i.log" 2>&1 &
  pids+=("$!")
done
echo "[local_cpu] $n processes, coordinator 127.0.0.1:$port, logs in $logs" >&2

status=0
remaining=$n
while [ "$remaining" -gt 0 ]; do
  rc=0
  wait -n || rc=$?
  remaining=$((remaining - 1))
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "[local_cpu] a process failed (exit $rc); stopping the others" >&2
    stop_all
  fi
done
trap - INT TERM HUP
if [ "$status" -ne 0 ]; then
  for ((i = 0; i < n; i++)); do
    echo "----- process $i (last lines of $logs/process-$i.log)" >&2
    tail -n 20 "$logs/process-$i.log" >&2 || true
  done
fi
exit "$status"
