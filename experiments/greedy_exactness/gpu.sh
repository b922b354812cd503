#!/usr/bin/env bash
# Greedy exactness on a lent GPU: a random Llama-3.2-1B-shaped target in float32 (the production
# layout of configs/generate.py), n-gram and early-exit drafts at gamma 4, batch 1 and 4, under
# XLA's default float32 matmul precision and again under "highest". Each run has its own limit.
#
#   bash experiments/greedy_exactness/gpu.sh OUT_DIR [SECONDS_EACH]
set -u
out=${1:?usage: gpu.sh OUT_DIR [SECONDS_EACH]}
secs=${2:-120}
export PYTHONUNBUFFERED=1 SPECJAX_XLA_DEFAULTS=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
args=(--config=experiments/greedy_exactness/config.py --config.workload=preset:1b --config.num_prompts=8
      --config.max_new_tokens=96 "--config.drafters=('ngram:4','early_exit:4')" --config.early_exit_layers=2)
for precision in default highest; do
  if [ "$precision" = default ]; then unset JAX_DEFAULT_MATMUL_PRECISION; else export JAX_DEFAULT_MATMUL_PRECISION=highest; fi
  timeout "$secs" python3 -m experiments.greedy_exactness.run "${args[@]}" --config.out="$out/$precision.jsonl" \
      >"$out/$precision.log" 2>&1
  echo "== $precision: exit $?"; grep -v "^I1\|^W1" "$out/$precision.log" | tail -n 12
done
