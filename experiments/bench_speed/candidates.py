"""The candidates of issue 17 for a k-token verification forward, measured side by side in one run.

    python -m experiments.bench_speed.candidates --config=experiments/bench_speed/candidates.py \
        --config.out=experiments/bench_speed/results/<dir>/candidates.jsonl

Each candidate computes the weight products of one SmolLM2-135M forward (30 layers of q|k|v,
o, gate|up and down projections, then the tied 49152-token head; random float32 weights: the
cost does not depend on the values) for k rows, chained so that every product depends on the
previous layer's output as in the model (attention and norms left out: they are the same in
every candidate). Median of `iters` jitted calls after a warm-up, per k. Candidates:

* ``xla``: weights [in, out], ``x @ w`` (the `fused` layout before the kernel);
* ``xla_transposed``: weights stored [out, in], contracted on their last axis (the small k
  operand is then the one a matrix kernel would pack);
* ``xla_bf16``: bfloat16 weights, bfloat16 activations, float32 accumulation
  (``preferred_element_type``); half the bytes, another target model;
* ``panels_einsum``: the "panels" linear op's stored form through an einsum (the kernel's
  fallback off CPU);
* ``kernel``: the "panels" linear op (`specjax.kernels.get_linear_op("panels")`: the CPU
  kernel's matmul; what the main command runs);
* ``two_devices``: ``xla`` with every weight's output columns split over a 2-device mesh axis
  (each core streams half of every matrix; the activations are gathered after each product).
  Needs ``--config.devices=2`` (`--xla_force_host_platform_device_count=2`, set before the
  backend starts), so it runs in its own invocation; the others run with ``devices=1``.
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import build, kernels

from experiments.lib import toolkit

PANELS = kernels.get_linear_op("panels")
CANDIDATES = ("xla", "xla_transposed", "xla_bf16", "panels_einsum", "kernel", "two_devices")


def get_config():
    c = ml_collections.ConfigDict()
    c.out = "/tmp/candidates.jsonl"
    c.candidates = CANDIDATES[:-1]
    c.devices = 1                 # host devices (2 for the two_devices candidate)
    c.ks = (1, 2, 3, 4, 5, 8, 9, 16)
    c.iters = 20
    c.layers = 30                 # SmolLM2-135M's shapes
    c.hidden, c.qkv, c.ffn, c.vocab = 576, 960, 1536, 49152
    c.seed = 0
    return c


def _weights(c, candidate: str, key) -> list:
    """Per layer (qkv, o, gate|up, down) and the head, in the candidate's storage."""
    shapes = [(c.hidden, c.qkv), (c.hidden, c.hidden), (c.hidden, 2 * c.ffn), (c.ffn, c.hidden)] * c.layers
    shapes.append((c.hidden, c.vocab))
    out = []
    for i, (d, n) in enumerate(shapes):
        w = 0.02 * jax.random.normal(jax.random.fold_in(key, i), (d, n), jnp.float32)
        if candidate == "xla_transposed":
            w = w.T.copy()
        elif candidate == "xla_bf16":
            w = w.astype(jnp.bfloat16)
        elif candidate in ("panels_einsum", "kernel"):
            w = PANELS.store(w)
        elif candidate == "two_devices":
            w = jax.device_put(w, _column_split())
        out.append(jax.block_until_ready(w))
    return out


def _column_split():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    return NamedSharding(Mesh(np.array(jax.devices()), ("model",)), PartitionSpec(None, "model"))


def _product(candidate: str, x, w, n: int):
    if candidate == "xla":
        return x @ w
    if candidate == "two_devices":
        from jax.sharding import NamedSharding, PartitionSpec
        y = x @ w
        return jax.lax.with_sharding_constraint(y, NamedSharding(_column_split().mesh, PartitionSpec()))
    if candidate == "xla_transposed":
        return jnp.einsum("td,nd->tn", x, w)
    if candidate == "xla_bf16":
        return jnp.einsum("td,dn->tn", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    if candidate == "kernel":
        return PANELS.apply(x, w, n)
    return kernels.matmul(x, w, n, use_kernel=False)          # the panels op's einsum fallback


def forward(candidate: str, c, ws, x_TD):
    widths = [c.qkv, c.hidden, 2 * c.ffn, c.hidden] * c.layers + [c.vocab]
    h = x_TD
    for i in range(c.layers):
        qkv = _product(candidate, h, ws[4 * i], widths[4 * i])
        o = _product(candidate, qkv[:, :c.hidden], ws[4 * i + 1], widths[4 * i + 1])
        gu = _product(candidate, h + o, ws[4 * i + 2], widths[4 * i + 2])
        down = _product(candidate, jax.nn.silu(gu[:, :c.ffn]) * gu[:, c.ffn:], ws[4 * i + 3], widths[4 * i + 3])
        h = h + o + down
    return _product(candidate, h, ws[-1], widths[-1])


def run(c) -> pathlib.Path:
    for name in c.candidates:
        if name not in CANDIDATES:
            raise ValueError(f"config.candidates: {name!r} is not allowed; choose from {list(CANDIDATES)}")
    if ("two_devices" in c.candidates) != (len(jax.devices()) > 1):
        raise ValueError("config.candidates: two_devices runs alone with --config.devices=2; the others with devices=1")
    prov = toolkit.provenance("experiments.bench_speed.candidates", config=c.to_dict())
    jl = toolkit.Jsonl(c.out, {**prov, "kernel_isa": kernels.isa()})
    log = toolkit.CompileLog()
    with log:
        for name in c.candidates:
            ws = _weights(c, name, jax.random.key(c.seed))
            fn = jax.jit(lambda ws, x, name=name: forward(name, c, ws, x))
            for k in c.ks:
                x = jax.random.normal(jax.random.key(k), (k, c.hidden), jnp.float32)
                v = toolkit.time_calls(fn, ws, x, iters=c.iters, log=log)
                jl.write("candidate_cost", candidate=name, k=int(k), weight_bytes=sum(w.nbytes for w in ws), **v)
                print(f"[candidates {time.strftime('%H:%M:%S')}] {name} k={k}: {1e3 * v['median_s']:.2f} ms",
                      file=sys.stderr, flush=True)
            del ws
            jax.clear_caches()
    jl.close()
    return pathlib.Path(c.out)


def table(path) -> str:
    recs = [r for r in toolkit.read_jsonl(path) if r["kind"] == "candidate_cost"]
    names = list(dict.fromkeys(r["candidate"] for r in recs))
    ks = sorted({r["k"] for r in recs})
    t = {(r["candidate"], r["k"]): r["median_s"] for r in recs}
    return toolkit.table(["candidate"] + [f"k={k}" for k in ks],
                         [[f"`{n}`"] + [f"{toolkit.fmt(1e3 * t[n, k])} ({toolkit.fmt(t[n, k] / t[n, 1])})"
                                        if (n, k) in t else "–" for k in ks] for n in names])


def main(c):
    import os
    if c.devices > 1:                 # before the backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={c.devices}").strip()
    build.tune_xla_cpu()
    path = run(c)
    print(table(path))


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__), "settings (this file's get_config)")
