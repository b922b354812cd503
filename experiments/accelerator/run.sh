#!/usr/bin/env bash
# The prepared GPU check (experiments/accelerator/README.md), sized for one 10-minute call on a lent
# GPU machine: device facts, then experiments.accelerator.measure (decode tokens/s and % of the
# memory roofline at batch 1, 8, 64 for the 8B and 1B shapes in the old and new layouts,
# verification cost at k = 1..8, the bitwise block-vs-step check, the cost model), stopping new
# measurements after 480 s. Results: OUT/device.txt, OUT/accelerator.jsonl, OUT/measure.log.
#
#   bash experiments/accelerator/run.sh OUT [SECONDS]
set -u
out=${1:?usage: experiments/accelerator/run.sh OUT [SECONDS]}
secs=${2:-480}
export PYTHONUNBUFFERED=1 SPECJAX_XLA_DEFAULTS=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  git rev-parse HEAD 2>&1
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} >"$out/device.txt" 2>&1
cat "$out/device.txt"
timeout $((secs + 60)) python3 -m experiments.accelerator.measure "$out" --seconds="$secs" >"$out/measure.log" 2>&1
echo "== measure: exit $?"
tail -n 40 "$out/measure.log"
