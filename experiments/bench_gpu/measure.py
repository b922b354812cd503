"""Device-side measurements: memory bandwidth, generation, k-token forward and draft costs.

Everything is timed with `experiments.bench_speed.common.timed` (which waits for the result with
`jax.block_until_ready`); compile time is collected by `CompileLog` around each first (warm-up)
call and reported separately; timed calls are checked to compile nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import decoding
from specjax import sampling as sampling_lib

from experiments.bench_speed.common import CompileLog, median, timed


# ----------------------------------------------------------------------------- device

def device_info() -> dict:
    devs = jax.devices()
    d = devs[0]
    info = {
        "backend": jax.default_backend(),
        "platform": d.platform,
        "device_kind": getattr(d, "device_kind", ""),
        "num_devices": len(devs),
        "devices": [str(x) for x in devs],
        "description": f"{len(devs)} x {getattr(d, 'device_kind', d.platform)} ({d.platform})",
    }
    try:
        stats = d.memory_stats() or {}
    except Exception:   # not implemented on every backend
        stats = {}
    if stats.get("bytes_limit"):
        info["memory_bytes_limit"] = int(stats["bytes_limit"])
    return info


def peak_memory_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        return None
    v = stats.get("peak_bytes_in_use")
    return int(v) if v is not None else None


# ----------------------------------------------------------------------------- bandwidth

BANDWIDTH_METHOD = ("on-device float32 array of {gib:g} GiB: copy = jitted x * s (s a traced scalar, so XLA "
                    "cannot elide it), bytes = read + written = 2 x array; read = jitted jnp.sum(x), bytes = "
                    "array; median and best of {repeats} calls after a warm-up")


def device_bandwidth(gib: float, repeats: int = 10) -> dict:
    n = max(1024, int(gib * 2 ** 30) // 4)
    x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
    scale = jnp.asarray(1.0, jnp.float32)
    nbytes = n * 4
    copy = jax.jit(lambda a, s: a * s)
    read = jax.jit(lambda a: jnp.sum(a))
    out = {"array_bytes": nbytes, "method": BANDWIDTH_METHOD.format(gib=nbytes / 2 ** 30, repeats=repeats)}
    for name, fn, args, moved in (("copy", copy, (x, scale), 2 * nbytes), ("read", read, (x,), nbytes)):
        timed(fn, *args)                      # compile + warm-up
        ts = []
        for _ in range(repeats):
            t, y = timed(fn, *args)
            ts.append(t)
            del y
        out[name] = {"bytes_moved": moved, "median_s": median(ts), "best_s": float(min(ts)),
                     "gb_per_s": moved / median(ts) / 1e9, "best_gb_per_s": moved / min(ts) / 1e9}
    del x
    out["gb_per_s"] = max(out["copy"]["best_gb_per_s"], out["read"]["best_gb_per_s"])
    return out


# ----------------------------------------------------------------------------- oracle drafter

@struct.dataclass
class OracleState:
    pass


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Proposes the next gamma tokens of a reference sequence (its `params`: a [B, capacity]
    token array, e.g. target-only greedy output with the same prompts and capacity); one-hot q;
    no forward pass (model-free). With greedy decoding every proposal is accepted until the
    first float near-tie divergence, so a round measures the target's (gamma + 1)-token
    verification plus the loop's own overhead with a draft that costs nothing: the per-round
    cost of speculative decoding independent of what random weights do to acceptance."""
    vocab_size: int
    model_free = True

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return OracleState()

    def propose(self, ref_BL, state, tokens_BL, lengths_B, key_B, gamma, cfg):
        idx_BG = lengths_B[:, None] + jnp.arange(gamma)[None, :]
        toks_BG = jnp.take_along_axis(ref_BL, jnp.clip(idx_BG, 0, ref_BL.shape[1] - 1), axis=1).astype(jnp.int32)
        return toks_BG, jax.nn.one_hot(toks_BG, self.vocab_size, dtype=jnp.float32), state

    def commit(self, state, new_lengths_B):
        return state


# ----------------------------------------------------------------------------- generation

@dataclasses.dataclass
class Batch:
    prompt_BP: jax.Array
    plens_B: jax.Array
    key_B: jax.Array
    capacity: int

    @property
    def size(self) -> int:
        return int(self.prompt_BP.shape[0])


def make_batch(vocab_size: int, batch: int, prompt_len: int, capacity: int, seed: int) -> Batch:
    rng = np.random.default_rng([seed, batch, prompt_len])
    ids = rng.integers(3, vocab_size, size=(batch, prompt_len))
    prompt_BP, plens_B = decoding.pad_prompts(ids.tolist(), vocab_size)
    keys = decoding.request_keys(jax.random.key(seed), list(range(batch)))
    return Batch(prompt_BP, plens_B, keys, capacity)


def time_prefill(target, params, batch: Batch, max_new_tokens: int, repeats: int, log: CompileLog) -> dict:
    """The jitted prefill (`decoding.init_state`: cache allocation + prompt forward) of the target
    alone, warm-up excluded, median of `repeats`. The early-exit and oracle drafters have no
    prefill of their own, so this is the prefill of every configuration run here."""
    gen = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=0)

    def prefill():
        return decoding.init_state(target, params, None, None, gen, batch.prompt_BP, batch.plens_B, batch.key_B,
                                   batch.capacity)

    with log.section() as warm:
        t0, s = timed(prefill)
        del s
    ts = []
    for _ in range(repeats):
        t, s = timed(prefill)
        del s
        ts.append(t)
    return {"median_s": median(ts), "all_s": ts, "compile_s": warm["compile_s"], "first_call_s": t0}


def run_generation(target, params, drafter, dparams, gamma: int, batch: Batch, temperature: float,
                   max_new_tokens: int, repeats: int, log: CompileLog, prefill: dict) -> tuple[dict, object]:
    """One configuration at one batch size: a warm-up (its compile time recorded), then `repeats`
    timed full generations; median. decode = median full - median prefill (`time_prefill`).
    Returns (record, the last output)."""
    gen = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
    samp = sampling_lib.SamplingConfig.make(temperature=temperature)

    if gamma == 0:
        def full():
            return decoding.autoregressive_generate(target, params, batch.prompt_BP, batch.plens_B, batch.key_B,
                                                    samp, max_new_tokens, capacity=batch.capacity)
    else:
        def full():
            return decoding.speculative_generate(target, params, drafter, dparams, batch.prompt_BP, batch.plens_B,
                                                 batch.key_B, samp, gen, capacity=batch.capacity)

    with log.section() as warm:
        t_first, out = timed(full)
        del out
    full_s, out = [], None
    with log.section() as box:
        for _ in range(repeats):
            out = None                       # free the previous output first
            t, out = timed(full)
            full_s.append(t)
    out = jax.device_get(out)
    m = out.metrics
    total, pre = median(full_s), prefill["median_s"]
    decode = total - pre if total > pre else float("nan")   # <= 0: lost in timing noise
    new_B = (np.asarray(out.lengths_B) - np.asarray(out.prompt_lengths_B)).astype(int)
    new = int(new_B.sum())
    loop_rounds = int(np.asarray(m.rounds_B).max())          # iterations of the batch-wide while_loop
    proposed, accepted = int(np.asarray(m.proposed_B).sum()), int(np.asarray(m.accepted_B).sum())
    rec = {
        "batch": batch.size,
        "gamma": gamma,
        "temperature": float(temperature),
        "prompt_tokens": int(batch.prompt_BP.shape[1]),
        "capacity": batch.capacity,
        "new_tokens": new,
        "new_tokens_per_row": new_B.tolist(),
        "total_s": total, "prefill_s": pre, "decode_s": decode,
        "total_s_all": full_s, "prefill_s_all": prefill["all_s"],
        "tokens_per_s": new / decode if decode > 0 else float("nan"),
        "e2e_tokens_per_s": new / total,
        "loop_rounds": loop_rounds,
        "seconds_per_round": decode / loop_rounds if decode > 0 and loop_rounds else float("nan"),
        "tokens_per_round_per_row": float(new_B.mean()) / max(loop_rounds, 1),
        "proposed": proposed, "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted_at": np.asarray(m.accepted_at_BG).sum(0).tolist(),
        "tested_at": np.asarray(m.tested_at_BG).sum(0).tolist(),
        "compile_s": warm["compile_s"], "compiles": warm["compiles"], "first_call_s": t_first,
        "prefill_compile_s": prefill["compile_s"],
        "compiles_during_timing": box["compiles"],
    }
    return rec, out


# ----------------------------------------------------------------------------- forward / draft costs

def _times(fn, args, iters):
    return [timed(fn, *args)[0] for _ in range(iters)]


def forward_costs(model, params, ks, batch: int, ctx: int, capacity: int, iters: int, log: CompileLog) -> dict:
    """Median seconds of one jitted `model.apply` of k tokens per row, `batch` rows, against a
    cache of `capacity` slots holding `ctx` tokens (only the logits are returned, so the
    non-donated cache is not copied), for each k.

    The k programs are lowered one by one and compiled (concurrently on CPU, where XLA compiles
    outside the GIL), then timed one at a time; `compile_s` of each k is the sum of all k's
    compile seconds divided evenly."""
    if ctx + max(ks) > capacity:
        raise ValueError(f"context {ctx} + k {max(ks)} exceeds capacity {capacity}")
    cache = model.init_cache(batch, capacity)
    cache = cache.replace(lengths_B=jnp.full((batch,), ctx, jnp.int32))
    fn = jax.jit(lambda p, t, c: model.apply(p, t, c)[0])
    toks = {int(k): (jnp.arange(batch * k, dtype=jnp.int32).reshape(batch, k) * 7 + 3) % model.vocab_size
            for k in ks}
    with log.section() as box:
        lowered = {k: fn.lower(params, t, cache) for k, t in toks.items()}
        # Concurrent compiles on CPU only: on a GPU, autotuning measures candidate kernels on the
        # device, and concurrent autotuning could skew which kernels get picked.
        workers = max(1, min(len(lowered), os.cpu_count() or 1, 8)) if jax.default_backend() == "cpu" else 1
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))
    out = {}
    for k, f in compiled.items():
        timed(f, params, toks[k], cache)      # warm-up
        ts = _times(f, (params, toks[k], cache), iters)
        out[k] = {"median_s": median(ts), "min_s": float(min(ts)), "compile_s": box["compile_s"] / len(compiled)}
    return out
