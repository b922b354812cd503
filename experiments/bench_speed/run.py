"""The speed benchmark: every measurement of one run written as JSONL records; `report` then
renders the tables from the JSONL alone (run here at the end, or on its own).

    python -m experiments.bench_speed.run --config=experiments/bench_speed/config.py
    python -m experiments.bench_speed.run --config=experiments/bench_speed/config.py:tiny --config.out=/tmp/bench
    python -m experiments.bench_speed.run --config=experiments/bench_speed/config.py:gpu --config.out=/tmp/gpu

Order: the settings checked and the provenance taken (git state, date, load: those of the
start); the peak-memory process (its own, first, so nothing of this one is counted); loading;
bandwidth; per batch size the k-token forward costs and the draft costs at a typical context,
and adaptive gamma's round times (`Engine.round_times` on the batch size's first batch);
generation per temperature, batch size and compiled shape (the programs of one shape are
dropped before the next's: compiled programs hold many memory mappings, and a process keeping
them all can reach vm.max_map_count, see PROFILE.md), every configuration of a batch
interleaved so slow drifts of the machine hit them alike; then transformers (batch 1).
"""

from __future__ import annotations

import collections
import gc
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import build, decoding, kernels, sampling

from experiments.lib import toolkit
from experiments.bench_speed import config, memory, report
from experiments.lib import measure
from experiments.lib import workload



def _log(msg: str):
    print(f"[bench_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run(c) -> pathlib.Path:
    t_start = time.perf_counter()
    config.check(c)
    out = pathlib.Path(c.out)
    # First: the commit, dirty flag, date and load of the start (the backend is started after
    # the memory process, which must find the device free).
    prov = toolkit.provenance("experiments.bench_speed.run", exclude=[out], with_backend=False, config=c.to_dict())
    out.mkdir(parents=True, exist_ok=True)
    mem = None
    if c.memory:
        _log("peak resident memory of a generation-only process (own process)")
        mem = memory.measure(c, out / "_work")
    _log(f"loading {c.workload}")
    w = workload.load(c, out / "_work", with_transformers=c.transformers and 1 in c.batch_sizes)
    methods = measure.methods(c, w)
    if skipped := sorted(set(c.methods) - {m.name for m in methods}):
        _log(f"skipped {skipped}: no distilled draft or draft head for {w.name} "
             f"(set --config.draft_model / --config.head_model)")
    max_gamma = max(max(m.gammas) for m in methods)
    ks = list(range(1, max(c.max_k, max_gamma + 1) + 1))
    prov["machine"].update(toolkit.backend())
    prov.update(model=w.name, model_file=w.model_file, model_sha256=w.model_sha256, model_notes=w.notes,
                random_weights=w.random_weights, prompt_ids=[p.question_id for p in w.prompts])
    jl = toolkit.Jsonl(out / "results.jsonl", prov)
    cfg = w.target.config
    jl.write("setup", num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, param_count=cfg.num_params(),
             # bytes a decode step streams (the packed layout's second copy of the head, head_linear,
             # replaces the embedding's reads, which are one row per token), and what is resident
             weight_bytes=sum(x.nbytes for k, x in w.params.items() if k != "head_linear" for x in jax.tree.leaves(x)),
             resident_param_bytes=sum(x.nbytes for x in jax.tree.leaves(w.params)),
             kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize,
             early_exit_layers=workload.early_exit_layers(w, c), eos_ids=list(w.eos_ids), layers=c.layers,
             cpu_kernel=kernels.isa(),
             prompt_tokens=[len(p.ids) for p in w.prompts],
             methods=[{"name": m.name, "description": m.describe()} for m in methods])
    if mem is not None:
        jl.write("memory", **mem)

    eos = () if c.ignore_eos else w.eos_ids
    probe = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=max_gamma)
    batches = {B: [(chunk, decoding.make_batch([list(p.ids) for p in chunk], probe, jax.random.key(c.seed),
                                               request_ids=[p.question_id for p in chunk],
                                               pad_multiple=c.pad_multiple))
                   for chunk in (w.prompts[i:i + B] for i in range(0, len(w.prompts), B))]
               for B in c.batch_sizes}
    with toolkit.CompileLog() as log:
        runner, round_times = measure.Runner(w, c, log, eos), {}
        _log(f"bandwidth ({c.bandwidth_gib} GiB)")
        jl.write("bandwidth", **measure.bandwidth(c.bandwidth_gib, c.bandwidth_threads))

        # k-token forward costs and draft costs at a typical context and capacity (the report's cost model)
        ctx = int(round(np.mean([len(p.ids) for p in w.prompts]) + c.max_new_tokens / 2))
        caps = collections.Counter(b.capacity for bs in batches.values() for _, b in bs)
        cap = max(caps.most_common(1)[0][0], -(-(ctx + max(ks)) // c.pad_multiple) * c.pad_multiple)
        for B in c.batch_sizes:
            _log(f"batch {B}: forward costs k = 1..{max(ks)} at context {ctx}, capacity {cap}")
            for k, v in toolkit.forward_costs(w.target, w.params, ks, ctx=ctx, capacity=cap, iters=c.cost_iters,
                                              log=log, batch=B).items():
                jl.write("forward_cost", model="target", layers=c.layers, batch=B, k=k, context=ctx, capacity=cap, **v)
            layouts = [(c.layers, w.target, w.params)] + [(n, *workload.in_layout(w.target, w.params, n))
                                                          for n in c.cost_layers if n != c.layers]
            for name, model, params in layouts[1:]:          # the same target in other layouts
                _log(f"batch {B}: forward costs k = 1..{max(ks)} of the target in layout {name}")
                for k, v in toolkit.forward_costs(model, params, ks, ctx=ctx, capacity=cap, iters=c.cost_iters,
                                                  log=log, batch=B).items():
                    jl.write("forward_cost", model=f"target_{name}", layers=name, batch=B, k=k, context=ctx,
                             capacity=cap, **v)
            if B == 1 and c.prefill_ks:                      # a prompt chunk into an empty cache, every layout
                for name, model, params in layouts:
                    _log(f"prefill chunks {tuple(c.prefill_ks)} in layout {name}")
                    for k, v in toolkit.prefill_costs(model, params, list(c.prefill_ks),
                                                      iters=max(3, c.cost_iters // 6), log=log).items():
                        jl.write("prefill_cost", layers=name, k=k, **v)
            del layouts
            if any(m.drafter == "early_exit" for m in methods):
                ee, ee_params = workload.drafter(w, "early_exit", c)
                v = toolkit.forward_costs(ee.model, ee_params, [1], ctx=ctx, capacity=cap, iters=c.cost_iters,
                                          log=log, batch=B)[1]
                jl.write("forward_cost", model=f"early_exit_{ee.model.config.num_layers}_layers", batch=B, k=1,
                         context=ctx, capacity=cap, **v)
            for temp in c.temperatures:
                for kind, g in sorted({(m.drafter, g) for m in methods if m.drafter != "none" for g in m.gammas if g}):
                    d, dp = workload.drafter(w, kind, c)
                    dp = np.zeros((B, cap), np.int32) if kind == "oracle" else dp
                    v = toolkit.propose_cost(w.target, d, dp, g, sampling.SamplingConfig.make(temperature=temp),
                                             ctx=ctx, capacity=cap, iters=c.cost_iters, log=log, batch=B, seed=c.seed)
                    jl.write("draft_cost", drafter=kind, gamma=g, temperature=float(temp), batch=B, context=ctx,
                             capacity=cap, **v)
                # adaptive gamma's round times, as a user's Generator.calibrate measures them
                for m in methods:
                    rt, box = runner.calibrate(m, temp, batches[B][0][1], repeats=c.cost_iters)
                    if rt is not None:
                        round_times[m.name, float(temp), B] = rt
                        jl.write("calibration", method=m.name, temperature=float(temp), batch=B,
                                 capacity=batches[B][0][1].capacity, gammas=list(m.gammas), round_time_s=rt,
                                 repeats=c.cost_iters, **box)

        map_peak = 0
        for temp in c.temperatures:
            for B, bs in batches.items():
                groups = collections.defaultdict(list)
                for chunk, batch in bs:
                    groups[batch.prompt_BP.shape, batch.capacity].append((chunk, batch))
                for group in groups.values():
                    map_peak = max(map_peak, _map_count())
                    jax.clear_caches()                  # drop the previous shape's programs
                    gc.collect()
                    runner.warmed.clear()
                    for chunk, batch in group:
                        ref = None
                        for m in methods:
                            oracle = jnp.asarray(ref.tokens_BS) if m.drafter == "oracle" else None
                            rec, o = runner.run(m, temp, batch, round_times.get((m.name, float(temp), B)),
                                                draft_params=oracle)
                            if m.drafter == "none":
                                ref = o
                            elif temp == 0:
                                same = [a == b for a, b in zip(o.generated(), ref.generated())]
                                rec.update(greedy_matches_target_only=all(same), greedy_rows_matching=sum(same))
                            cats = {p.category for p in chunk}
                            jl.write("generation", framework="specjax", method=m.name, drafter=m.drafter,
                                     config=m.describe(), temperature=float(temp),
                                     question_ids=[p.question_id for p in chunk],
                                     category=cats.pop() if len(cats) == 1 else "mixed",
                                     prompt_tokens=[len(p.ids) for p in chunk], **rec)
                            _log(f"T={temp:g} B={B} q{chunk[0].question_id} {m.name}: {rec['new_tokens']} tokens, "
                                 f"{rec['tokens_per_s']:.1f} tok/s, compile {rec['compile_s']:.1f} s")
        jl.write("map_count", peak=max(map_peak, _map_count()))

    if w.hf_source and c.transformers and 1 in c.batch_sizes:
        assistant = None
        if "distilled" in {m.drafter for m in methods}:
            from specjax.models import draft_artifact
            assistant = out / "_work" / "distilled_hf"
            draft_artifact.export_draft_hf(c.draft_model or build.shipped_draft(w.name), w.target, w.params, assistant)
        _log("transformers")
        measure.transformers_runs(w, c, lambda r: jl.write("generation", **r), assistant)
    try:
        peak_device = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:                     # not reported by every backend
        peak_device = None
    jl.write("run", wall_s=time.perf_counter() - t_start, loadavg_at_end=toolkit.loadavg(),
             peak_device_bytes=peak_device)
    jl.close()
    return out / "results.jsonl"


def main(c):
    path = run(c)
    print(report.write(path))


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "benchmark settings (experiments/bench_speed/config.py[:tiny|gpu])")
