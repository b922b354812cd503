#!/usr/bin/env bash
# The speed benchmark's GPU workload in one call, as run on a lent GPU machine: the `:gpu` variant
# (random Llama-3.1-8B-shaped target, bfloat16, batch 1 and 8), then the 1B preset at batch 8 and 32.
# Each run has its own time limit, so a slow first run still leaves the second its share; a run cut
# off leaves results.jsonl.partial. Plots are dropped here (report.py redraws them from the JSONL).
#
#   bash experiments/bench_speed/gpu.sh OUT_DIR [SECONDS_8B] [SECONDS_1B]
set -u
out=${1:?usage: gpu.sh OUT_DIR [SECONDS_8B] [SECONDS_1B]}
t8=${2:-330}
t1=${3:-200}
export PYTHONUNBUFFERED=1 SPECJAX_XLA_DEFAULTS=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
bench() {   # bench NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m experiments.bench_speed.run --config=experiments/bench_speed/config.py:gpu \
      --config.out="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $?"; tail -n 25 "$out/$name.log"
  rm -f "$out/$name/plots.png"
}
bench gpu_8b "$t8"
bench gpu_1b "$t1" --config.workload=preset:1b --config.batch_sizes=8,32 --config.num_prompts=32 --config.repeats=2
