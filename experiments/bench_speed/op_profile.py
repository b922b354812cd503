"""Where a decode step's time goes, per XLA operation: an XLA profile of target-only decoding.

    python -m experiments.bench_speed.op_profile --contexts 100,700 --out experiments/bench_speed/results
    python -m experiments.bench_speed.op_profile --model tiny --contexts 20 --out /tmp/op   (CI smoke)

For each context length it runs target-only greedy decoding (the engine's jitted loop, fused
layers as in the benchmark) of `--short` and `--long` new tokens under `jax.profiler.trace`,
sums the traced durations of XLA's executed operations (thunks) by kind (the HLO name without
its numeric suffix: `dot`, `ynn_fusion`, `copy`, `copy_bitcast_fusion`, ...), and reports the
difference per extra token: prefill, compilation and the loop's set-up cancel out. The prompt
is random token ids (cost depends on its length only). Profiling adds overhead (~10%): compare
rows with each other, not with the benchmark's tokens/s.

With `--forward_k` (default 1,5) it also profiles single jitted, cache-donated k-token forwards
(the verification pass at k = gamma + 1) at the first context, per call.

Writes `<out>/op_profile.jsonl` (appends; one record per context and per k, each with its
operations and the provenance block) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import pathlib
import re
import tempfile

import numpy as np

from experiments.bench_speed import common


CONTAINERS = ("while", "conditional", "call")


def _op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds and call counts of the traced XLA operations, by kind."""
    files = glob.glob(str(pathlib.Path(trace_dir) / "**" / "*.trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
    events = json.load(gzip.open(files[0]))["traceEvents"]
    us, calls = collections.Counter(), collections.Counter()
    for e in events:
        op = (e.get("args") or {}).get("hlo_op")
        if e.get("ph") != "X" or not op:
            continue
        kind = re.sub(r"[._]\d+$", "", op)
        us[kind] += e["dur"]
        calls[kind] += 1
    return us, calls


def profile_context(w, context: int, short: int, long: int, seed: int = 0) -> dict:
    import jax

    from specjax import decoding
    from specjax import sampling as sampling_lib

    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, w.target.vocab_size, context)]
    prompt_BP, plens = decoding.pad_prompts([prompt], w.target.vocab_size, multiple=128)
    capacity = decoding.capacity_for([context], decoding.GenerationConfig(max_new_tokens=long, gamma=0),
                                     multiple=128)
    key_B = decoding.request_keys(jax.random.key(seed), [0])
    greedy = sampling_lib.SamplingConfig.make(temperature=0.0)
    runs = {}
    for n in (short, long):
        def run(n=n):
            out = decoding.autoregressive_generate(w.target, w.params, prompt_BP, plens, key_B, greedy, n,
                                                   eos_ids=(), capacity=capacity)
            return jax.block_until_ready(out.status_B)
        run()                                            # compile, warm up
        wall, _ = common.timed(run)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                run()
            runs[n] = (wall, *_op_times(d))
    extra = long - short
    (w_s, us_s, c_s), (w_l, us_l, c_l) = runs[short], runs[long]
    per_token = {k: {"ms_per_token": (us_l[k] - us_s[k]) / extra / 1e3,
                     "calls_per_token": (c_l[k] - c_s[k]) / extra} for k in set(us_l) | set(us_s)}
    # Control flow (the generation loop, its branches) contains the other operations.
    containers = {k: per_token.pop(k) for k in CONTAINERS if k in per_token}
    ops = per_token
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms_per_token"]))
    return {"context": context, "capacity": capacity, "tokens": [short, long],
            "decode_ms_per_token_unprofiled": (w_l - w_s) / extra * 1e3,
            "profiled_ms_per_token": sum(v["ms_per_token"] for v in ops.values()), "ops": ops,
            "control_flow_ms_per_token": {k: v["ms_per_token"] for k, v in containers.items()}}


def profile_forward(w, k: int, context: int, calls: int = 10) -> dict:
    """The same per-operation sums for one jitted, cache-donated k-token forward (a
    verification pass at k = gamma + 1), per call, against a cache holding `context` tokens."""
    import jax

    from experiments.bench_speed import sj_bench

    capacity = -(-(context + k) // 128) * 128
    call = sj_bench.donated_step(w.target, w.params, k, context, capacity)
    call()                                                  # compile, warm up
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                call()
        us, counts = _op_times(d)
    ops = {kind: {"ms_per_call": us[kind] / calls / 1e3, "calls_per_call": counts[kind] / calls} for kind in us}
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms_per_call"]))
    return {"forward_k": k, "context": context, "capacity": capacity, "calls": calls,
            "profiled_ms_per_call": sum(v["ms_per_call"] for v in ops.values()), "ops": ops}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name or GGUF path, or 'tiny'")
    p.add_argument("--layers", choices=("fused", "unrolled", "scan"), default="fused")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",") if x], default=[100, 700])
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=72)
    p.add_argument("--forward_k", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 5],
                   help="also profile one donated k-token forward per k (at the first context)")
    p.add_argument("--top", type=int, default=8, help="operation kinds printed per context")
    p.add_argument("--out", default="/tmp/op_profile", help="directory; records appended to op_profile.jsonl")
    args = p.parse_args(argv)
    if not 0 < args.short < args.long:
        p.error("need 0 < --short < --long")
    from specjax import build
    build.tune_xla_cpu()
    from experiments.bench_speed.workload import load_workload

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = load_workload(args.model, 1, out / "_work", with_transformers=False, layers=args.layers)
    prov = {"date_utc": common.utc_now(), **common.git_state(exclude=[out]), "machine": common.machine(),
            "args": vars(args), "model": w.name}
    records = []
    for ctx in args.contexts:
        rec = profile_context(w, ctx, args.short, args.long)
        records.append(rec)
        print(f"context {ctx} (capacity {rec['capacity']}): {rec['decode_ms_per_token_unprofiled']:.1f} ms/token "
              f"unprofiled, {rec['profiled_ms_per_token']:.1f} in traced operations")
        for kind, v in list(rec["ops"].items())[:args.top]:
            print(f"  {v['ms_per_token']:7.2f} ms/token  {v['calls_per_token']:6.1f} calls/token  {kind}")
    for k in args.forward_k:
        rec = profile_forward(w, k, args.contexts[0])
        records.append(rec)
        print(f"{k}-token forward at context {rec['context']} (capacity {rec['capacity']}): "
              f"{rec['profiled_ms_per_call']:.1f} ms per call in traced operations")
        for kind, v in list(rec["ops"].items())[:args.top]:
            print(f"  {v['ms_per_call']:7.2f} ms/call  {v['calls_per_call']:6.1f} ops/call  {kind}")
    with open(out / "op_profile.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps({**r, "provenance": prov}) + "\n")
    return records


if __name__ == "__main__":
    main()
