"""bfloat16 and the model-parallel CPU mesh against the float32 one-device path, in one run.

    python -m experiments.cpu_levers.run --config=experiments/cpu_levers/config.py
    python -m experiments.cpu_levers.run --config=experiments/cpu_levers/config.py:tiny   # CI size

Each variant (dtype, CPU kernel on/off, 1 or 2 host devices) runs in its own child process
(`--xla_force_host_platform_device_count=2` must be set before JAX starts); the parent writes
the JSONL and renders `results.md` from it (`report`). Per variant:

* the cost of one target forward of k tokens (k = 1..16) at batch 1 against a cache holding
  `ctx` tokens, median of `cost_iters` calls (on the mesh: weights and cache placed by
  `specjax.sharding`'s rules, heads / MLP / vocabulary over "model");
* greedy decoding of the shortest held-out Spec-Bench prompt of the first `num_prompts`
  categories, `max_new_tokens` each: target-only and prompt lookup at fixed gamma, both from
  the same prefill, each run twice and the second run timed (decode tokens/s, prefill
  excluded); whether the speculative tokens equal target-only's (exactness with respect to
  the target that is run: a bfloat16 target is its own reference; recorded, not asserted:
  float near-ties, see `specjax.decoding.greedy_check`);
* the greedy exactness check (`decoding.greedy_check`) of prompt lookup against the target that
  is run, in its own dtype, with the near-tie bound eps = max(1e-3, 2 x the largest logit
  difference between a block forward and incremental one-token forwards of this target at 16
  positions): near-ties found, and hard mismatches (must be none).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.lib import toolkit
from experiments.cpu_levers import config as config_lib
from experiments.cpu_levers import report


def _log(msg: str):
    print(f"[cpu_levers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _target(c, dtype: str, cpu_kernel: str):
    """(generation config, target, params, tokenizer or None)."""
    from specjax import build, models
    gc = toolkit.load_config(c.generate_config)
    gc.update(dtype=dtype, cpu_kernel=cpu_kernel, drafter="ngram", adaptive_gamma=False, gamma=int(c.gamma),
              max_new_tokens=int(c.max_new_tokens), calibration_cache="", compilation_cache_dir="")
    if c.target and c.target != "tiny":
        gc.target = c.target
    gc = build.generate_settings(gc)
    if c.target == "tiny":
        import jax
        cfg = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                 head_dim=16, ffn_size=128, max_position=512, scan_layers=False, dtype=dtype,
                                 fuse_projections=True)
        model = models.Llama(cfg)
        return gc, model, model.prepare_params(model.init_params(jax.random.key(c.seed))), None
    build.check_config(gc)
    return (gc, *build.load_target_with_tokenizer(gc))


def child(c, name: str) -> dict:
    """One variant, in this process (its device count already set)."""
    import jax
    import numpy as np
    from specjax import build, decoding, sampling, sharding, specbench
    dtype, kernel, devices = config_lib.VARIANTS[name]
    assert jax.device_count() == devices, (jax.devices(), devices)
    gc, target, params, tok = _target(c, dtype, kernel)
    if tok is None:                     # tiny: a random target, random prompts, no tokenizer
        rng = np.random.default_rng(c.seed)
        prompts = [list(rng.integers(0, target.vocab_size, int(n))) for n in rng.integers(8, 24, c.num_prompts)]
        from specjax import drafters
        mesh = build.generation_mesh(gc)
        engine = decoding.Engine(target, drafters.NGramDrafter(vocab_size=target.vocab_size),
                                 build.generation_config(gc, ()), mesh=mesh)
        ep = decoding.EngineParams(target=params)
        gen = decoding.Generator(engine, engine.place_params(ep) if mesh is not None else ep, None, pad_multiple=32)
    else:
        qs = sorted(specbench.load(split="held_out"), key=lambda q: len(q.turns[0]))
        first = {}
        for q in qs:
            first.setdefault(q.category, q)
        prompts = [first[k].turns[0] for k in specbench.CATEGORIES if k in first][: c.num_prompts]
        gen = build.generator_for(gc, target, params, tok)
        mesh = gen.engine.mesh
    placed = gen.params.target
    rec = {"variant": name, "dtype": dtype, "cpu_kernel": target.config.linear_op == "panels",
           "devices": devices, "mesh": dict(mesh.shape) if mesh is not None else None}
    # k-token forward costs
    log = toolkit.CompileLog()
    capacity = c.ctx + max(c.ks) + 8
    cache = target.init_cache(1, capacity).rollback(c.ctx)
    if mesh is not None:
        cache = sharding.shard_cache(cache, mesh)
    fn = jax.jit(lambda p, t, cc: target.apply(p, t, cc)[0])
    with log:
        costs = {int(k): toolkit.time_calls(fn, placed, toolkit.probe_tokens(1, k, target.vocab_size), cache,
                                            iters=c.cost_iters, log=log) for k in c.ks}
    rec["forward_ms"] = {k: 1e3 * v["median_s"] for k, v in costs.items()}
    rec["forward_rel"] = {k: v["median_s"] / costs[1]["median_s"] for k, v in costs.items()}
    # greedy decoding: target-only and prompt lookup from the same prefill
    greedy = sampling.SamplingConfig.make(0.0)
    base = gen.target_only()
    rows = []
    for i, p in enumerate(prompts):
        batch = gen.batch([p], jax.random.key(c.seed + i))
        pre = gen.prefill(batch)
        row = {}
        for label, g in (("target_only", base), ("ngram", gen)):
            g.run(batch, greedy, prefill=pre).tokens_BS.block_until_ready()
            t0 = time.perf_counter()
            out = g.run(batch, greedy, prefill=pre)
            toks = np.asarray(sharding.to_host(out.tokens_BS))
            dt = time.perf_counter() - t0
            row[label] = {"tokens": len(out.generated()[0]), "seconds": dt,
                          "passes": int(np.asarray(sharding.to_host(out.metrics.rounds_B))[0]), "ids": toks[0].tolist()}
        row["equal"] = row["ngram"]["ids"] == row["target_only"]["ids"]
        for label in ("target_only", "ngram"):
            row[label].pop("ids")
        rows.append(row)
    for label in ("target_only", "ngram"):
        n = sum(r[label]["tokens"] for r in rows)
        s = sum(r[label]["seconds"] for r in rows)
        rec[f"{label}_tokens_per_s"] = n / s
        rec[f"{label}_tokens"] = n
    rec["speedup_ngram"] = rec["ngram_tokens_per_s"] / rec["target_only_tokens_per_s"]
    rec["greedy_equal_rows"] = sum(r["equal"] for r in rows)
    rec["rows"] = len(rows)
    rec.update(exactness(c, gen, prompts))
    rec["mean_accepted_tokens_per_pass"] = sum(r["ngram"]["tokens"] for r in rows) / max(
        sum(r["ngram"]["passes"] for r in rows), 1)
    rec["compile_s"] = log.seconds
    return rec


def logit_rounding(target, params, seq: list[int], steps: int) -> float:
    """The largest |logit difference| between one forward of the whole sequence and the same
    last `steps` positions computed one token at a time against the cache: how far a block
    forward and incremental decoding round apart in this dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    fn = jax.jit(lambda p, t, cc: target.apply(p, t, cc))
    toks = jnp.asarray([seq], jnp.int32)
    full, _ = fn(params, toks, target.init_cache(1, len(seq) + 8))
    logits, cache = fn(params, toks[:, :len(seq) - steps], target.init_cache(1, len(seq) + 8))
    worst = 0.0
    for i in range(len(seq) - steps, len(seq)):
        one, cache = fn(params, toks[:, i:i + 1], cache)
        worst = max(worst, float(np.abs(np.asarray(one[0, 0]) - np.asarray(full[0, i])).max()))
    return worst


def exactness(c, gen, prompts) -> dict:
    """Greedy exactness of prompt lookup against the target that is run (its own dtype), by
    `decoding.greedy_check`; the near-tie bound of that rule, eps, is max(1e-3, 2 x the
    measured block-vs-incremental logit rounding of this target) (float32: 1e-3)."""
    from specjax import decoding
    ids = [gen.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    seq = ids[0] + list(range(1, 17))                   # any tokens: rounding, not content
    delta = logit_rounding(gen.engine.target, gen.params.target, seq, 16)
    eps = max(decoding.NEAR_TIE_EPS, 2 * delta)
    reps = decoding.greedy_check(gen.engine.target, gen.engine.drafter, gen.params, ids, int(c.max_new_tokens),
                                 int(c.gamma), eps=eps, pad_multiple=64)
    return {"logit_rounding": delta, "near_tie_eps": eps, "greedy_rows_ok": sum(r.ok for r in reps),
            "near_ties": sum(len(r.near_ties) for r in reps),
            "near_tie_gaps": sorted(g for r in reps for _, g in r.near_ties),
            "hard_mismatches": [list(r.hard_mismatch) for r in reps if r.hard_mismatch is not None],
            "tokens_compared": sum(r.tokens_compared for r in reps)}


def run(c) -> pathlib.Path:
    prov = toolkit.provenance("experiments.cpu_levers.run",
                              config=json.loads(c.to_json_best_effort()))
    out = toolkit.Jsonl(c.out, prov)
    for name in c.variants:
        dtype, kernel, devices = config_lib.VARIANTS[name]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        if devices > 1:
            flags.append(f"--xla_force_host_platform_device_count={devices}")
        env["XLA_FLAGS"] = " ".join(flags)
        _log(f"{name}: starting")
        r = subprocess.run([sys.executable, "-m", "experiments.cpu_levers.run", "--child", name,
                            "--config_json", c.to_json_best_effort()], env=env, capture_output=True, text=True,
                           cwd=toolkit.REPO)
        if r.returncode != 0:
            out.close()
            raise RuntimeError(f"variant {name!r} failed:\n{r.stderr[-4000:]}")
        rec = json.loads(r.stdout.strip().splitlines()[-1])
        _log(f"{name}: k=2 {rec['forward_rel'].get('2', rec['forward_rel'].get(2, float('nan'))):.2f}x one token, "
             f"target-only {rec['target_only_tokens_per_s']:.1f} tokens/s, prompt lookup {rec['speedup_ngram']:.2f}x")
        out.write("variant", **rec)
    out.close()
    md = report.render(toolkit.read_jsonl(c.out))
    path = pathlib.Path(c.out).with_name("results.md")
    path.write_text(md)
    _log(f"wrote {c.out} and {path}")
    return path


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        import ml_collections
        from specjax import build
        build.tune_xla_cpu()
        c = ml_collections.ConfigDict(json.loads(argv[3]))
        c.ks, c.variants = tuple(c.ks), tuple(c.variants)
        print(json.dumps(toolkit._clean(child(c, argv[1]))), flush=True)
        return
    toolkit.main_with_config(run, "experiments/cpu_levers/config.py", __doc__)


if __name__ == "__main__":
    main()
