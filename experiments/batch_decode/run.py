"""Batched target-only generation throughput (issue 38 item 0); see config.py.

    python -m experiments.batch_decode.run --config=experiments/batch_decode/config.py

One process, one draw of prompts. For each path and batch size: every prompt generated through
`specjax.decoding.generate_batched` (T = 1, top-p 0.95 by default), each batch's prefill and
decode timed apart. Compilation is left out: the seconds jax spends compiling inside a timed
call (`toolkit.CompileLog`) are subtracted from it and reported as ``compile_s``. Against the
CPU's practical FLOP rate, a float32 product of the model's own shapes timed in the same run:
``flop_bound_tokens_per_s`` is the generated tokens per second if every FLOP of the run
(prefill, decode, LM head of the generated tokens, attention over the filled cache) ran at that
rate. Writes one record per (path, batch size) and a table (`report.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time

import numpy as np

from experiments.lib import toolkit


def _model(c):
    import jax

    from configs import generate
    from specjax import build, models

    build.tune_xla_cpu()
    build.limit_heap_retention()
    if c.target == "preset:tiny":
        cfg = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                                 ffn_size=128, rope_theta=10000.0, max_position=2048, scan_layers=False,
                                 fuse_projections=True)
        model = models.Llama(cfg)
        rng = np.random.default_rng(c.seed)
        n = max(n for _, _, n in c.runs)
        prompts = [[int(t) for t in rng.integers(3, 500, int(rng.integers(4, 90)))] for _ in range(n)]
        return model, model.init_params(jax.random.key(0)), prompts, ()
    g = generate.get_config()
    g.target, g.drafter = c.target, "none"
    gen = build.load_generator(build.generate_settings(g))
    from specjax import specbench
    train = specbench.load(split="train")
    rng = np.random.default_rng(c.seed)
    n = max(n for _, _, n in c.runs)
    pick = rng.choice(len(train), size=n, replace=False)
    prompts = [gen.encode(train[i].prompt) for i in pick]
    target = gen.engine.target
    return type(target)(target.config.replace(cpu_attention=False)), gen.params.target, prompts, tuple(gen.config.eos_ids)


def gemm_gflops(shape, iters: int = 20) -> float:
    """The median float32 rate of an [M, K] x [K, N] product (jnp.dot, XLA's own library)."""
    import jax
    import jax.numpy as jnp
    m, k, n = shape
    a = jax.random.normal(jax.random.key(0), (m, k))
    b = jax.random.normal(jax.random.key(1), (k, n))
    f = jax.jit(jnp.dot)
    ts = [toolkit.timed(f, a, b)[0] for _ in range(iters + 1)][1:]
    return 2 * m * k * n / toolkit.median(ts) / 1e9


def request_flops(cfg, prompt_len: int, new_tokens: int) -> float:
    """FLOPs of one request: every prompt and generated token through the layers' projections,
    the LM head for the generated tokens, and attention (q.k and p.v) over the positions before it."""
    per_layer = 2 * cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + 2 * cfg.q_size * cfg.hidden_size \
        + 2 * 3 * cfg.hidden_size * cfg.ffn_size
    n = prompt_len + new_tokens
    attn = 4 * cfg.num_layers * cfg.q_size * (n * (n - 1) / 2)
    return cfg.num_layers * per_layer * n + 2 * cfg.hidden_size * cfg.vocab_size * new_tokens + attn


def measure(engine, params, prompts, sampling, key, *, batch_size: int, sort: bool, pad_multiple: int, log) -> dict:
    from specjax import decoding
    compile_s = {"prefill": 0.0, "decode": 0.0}

    @contextlib.contextmanager
    def section(name):
        with log.section() as box:
            yield
        compile_s[name] += box["compile_s"]

    reports, lengths = [], {}
    for results, rep in decoding.generate_batched(engine, params, prompts, sampling, key, batch_size=batch_size,
                                                  pad_multiple=pad_multiple, sort_by_length=sort, section=section):
        reports.append(rep)
        lengths.update((r.index, len(r.tokens)) for r in results)
    return {"batches": [dataclasses.asdict(r) for r in reports], "new_tokens": sum(r.new_tokens for r in reports),
            "prompt_tokens": sum(r.prompt_tokens for r in reports),
            "padded_prompt_tokens": sum(r.rows * r.width for r in reports),
            "prefill_s": sum(r.prefill_s for r in reports) - compile_s["prefill"],
            "decode_s": sum(r.decode_s for r in reports) - compile_s["decode"],
            "compile_s": compile_s, "new_lengths": [lengths[i] for i in sorted(lengths)]}


def main(c):
    import jax

    from specjax import decoding, sampling as sampling_lib

    out = pathlib.Path(c.out)
    prov = toolkit.provenance("experiments.batch_decode.run", exclude=[out], config=c.to_dict())
    jl = toolkit.Jsonl(out, prov)
    model, params, prompts, eos = _model(c)
    rate = gemm_gflops(tuple(c.gemm))
    print(f"float32 GEMM {tuple(c.gemm)}: {rate:.0f} GFLOP/s", flush=True)
    jl.write("gemm", shape=list(c.gemm), gflops=rate)
    sampling = sampling_lib.SamplingConfig.make(temperature=c.temperature, top_p=c.top_p)
    eparams = decoding.EngineParams(target=params)
    with toolkit.CompileLog() as log:
        for path, b, n in c.runs:
            order, chunk, *attn = path.split(":")
            cfg = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=0, eos_ids=eos,
                                            prefill_chunk=int(chunk) or None)
            target = type(model)(model.config.replace(cpu_attention=True)) if attn == ["attn"] else model
            engine = decoding.Engine(target, None, cfg)
            ps = prompts[:int(n)]
            t0 = time.perf_counter()
            m = measure(engine, eparams, ps, sampling, jax.random.key(c.seed), batch_size=int(b),
                        sort=order == "sorted", pad_multiple=c.pad_multiple, log=log)
            wall = time.perf_counter() - t0
            seconds = m["prefill_s"] + m["decode_s"]
            flops = sum(request_flops(model.config, len(p), n) for p, n in zip(ps, m["new_lengths"]))
            rec = jl.write("throughput", path=path, batch_size=int(b), prompts=len(ps), **m, wall_s=wall,
                           tokens_per_s=m["new_tokens"] / seconds,
                           prefill_tokens_per_s=m["prompt_tokens"] / m["prefill_s"],
                           decode_tokens_per_s=m["new_tokens"] / m["decode_s"],
                           flops=flops, gemm_gflops=rate, achieved_gflops=flops / seconds / 1e9,
                           flop_bound_tokens_per_s=m["new_tokens"] / (flops / (rate * 1e9)))
            print(f"{path:>13} B={b:<4} {len(ps)} prompts: {rec['tokens_per_s']:.1f} tok/s generated "
                  f"(prefill {rec['prefill_tokens_per_s']:.0f} tok/s, decode {rec['decode_tokens_per_s']:.0f} tok/s, "
                  f"{rec['achieved_gflops']:.0f} GFLOP/s = {rec['achieved_gflops'] / rate:.0%} of the GEMM rate; "
                  f"compile {sum(m['compile_s'].values()):.0f} s left out)", flush=True)
    jl.close()


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/batch_decode/config.py[:tiny]")
