#!/usr/bin/env bash
# The AOT tables (experiments/aot/README.md): programs compiled without the device, before and
# after, into OUT_DIR/rows.jsonl; then `python -m experiments.aot.report OUT_DIR`.
#
# GPU first (when GPU_PYTHON names a Python with jax-cuda12-plugin and jax-cuda12-pjrt, and
# GPU_SPECS a directory with XLA's h100_sxm.txtpb and h200.txtpb target descriptions): one H100
# (Llama-3.2-1B and Llama-3.1-8B shapes) and one H200 (Llama-3.1-8B), the old GPU profile
# (configs/generate_gpu_scan.py) and the new one, the decode step and k = 1, 8 at batch 1.
# TPU (libtpu, from pip install -e '.[tpu]' or '.[test]'), the old profile
# (configs/generate_tpu_scan.py) and the new one (configs/generate_tpu.py): on v5e:2x2 five target
# shapes, the decode step and verification blocks of k = 1, 8 at batch 1, a chain round
# (EAGLE-3-shaped head, gamma 3), the decode step at batch 64 x 2,048 committed tokens, and a
# dynamic-tree round for Llama-3.1-8B; on v5p:2x2x1 and v6e:2x4 four shapes, the decode step and
# k = 1, 8; the head's and a 2-layer draft's training steps for Llama-3.2-1B on v5e:2x2. (Each
# program compiles in seconds to two minutes on 2 cores; the tree round is the slowest.)
#
# Usage: experiments/aot/run.sh OUT_DIR
set -euo pipefail
out="${1:?usage: experiments/aot/run.sh OUT_DIR}"
mkdir -p "$out"
rows="$(cd "$out" && pwd)/rows.jsonl"
export JAX_PLATFORMS=cpu
aot() { python -m specjax.cli aot --config=configs/aot.py --config.out="$rows" "$@" > /dev/null; }
if [ -n "${GPU_PYTHON:-}" ] && [ -n "${GPU_SPECS:-}" ]; then
  for case in h100:1,llama-3.2-1b h100:1,llama-3.1-8b h200:1,llama-3.1-8b; do
    chip="${case%,*}"; target="${case#*,}"
    spec="$GPU_SPECS/h200.txtpb"; [ "$chip" = h100:1 ] && spec="$GPU_SPECS/h100_sxm.txtpb"
    for profile in gpu_scan gpu; do
      PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=3 "$GPU_PYTHON" -m specjax.cli aot \
        --config=configs/aot.py --config.out="$rows" --config.topology="$chip" --config.gpu_target_config="$spec" \
        --config.target="$target" --config.profile="configs/generate_$profile.py" --config.profile_name="$profile" \
        "--config.programs=('decode','verify')" "--config.verify_ks=(1,8)" > /dev/null 2>&1
    done
  done
fi
for topo in v5e:2x2 v5p:2x2x1 v6e:2x4; do
  targets="llama-3.2-1b llama-3.1-8b qwen3-8b gemma-3-12b"
  programs="('decode','verify')"
  if [ "$topo" = v5e:2x2 ]; then targets="$targets mixtral-8x7b"; programs="('decode','verify','chain')"; fi
  for target in $targets; do
    for profile in tpu_scan tpu; do
      aot --config.topology="$topo" --config.target="$target" --config.profile="configs/generate_$profile.py" \
        --config.profile_name="$profile" "--config.programs=$programs" "--config.verify_ks=(1,8)"
      if [ "$topo" = v5e:2x2 ]; then
        aot --config.topology="$topo" --config.target="$target" --config.profile="configs/generate_$profile.py" \
          --config.profile_name="$profile" "--config.programs=('decode',)" "--config.batch_sizes=(64,)" \
          --config.context=2048 --config.capacity=2112
      fi
      if [ "$topo" = v5e:2x2 ] && [ "$target" = llama-3.1-8b ]; then
        aot --config.topology="$topo" --config.target="$target" --config.profile="configs/generate_$profile.py" \
          --config.profile_name="$profile" "--config.programs=('tree',)"
      fi
    done
  done
done
aot --config.topology=v5e:2x2 --config.target=llama-3.2-1b --config.profile_name=tpu \
  "--config.programs=('train_head','train_draft')"
