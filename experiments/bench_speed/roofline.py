"""Memory roofline of one target decode step.

Bandwidth: a streaming read of a large float32 array (`gib` GiB, filled with ones first so
every page is resident), summed with `numpy.sum`; bytes / seconds, best of `repeats` runs.
With t threads the array is split into t contiguous chunks summed concurrently in a thread
pool (numpy releases the GIL inside the reduction). The best over the thread counts tried is
what the roofline uses (XLA's CPU backend runs a decode step on all cores).

Bytes of one decode step at batch 1: every weight once (the tied embedding / LM head
counted once: the head reads the whole matrix, the embedding lookup one row), plus the K and
V entries of every layer for the tokens in context: 2 * layers * kv_heads * head_dim * ctx *
itemsize. Roofline tokens/s = bandwidth / bytes-per-step; a decoder at batch 1 cannot beat it
without reading fewer bytes per token.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

METHOD = ("numpy.sum over a float32 array of {gib:g} GiB (pages touched first), split into t contiguous "
          "chunks summed by t threads; best of {repeats} runs per t; bandwidth = array bytes / seconds")


def stream_bandwidth(gib: float = 1.0, threads=(1, 2), repeats: int = 5) -> dict:
    n = max(1, int(gib * 2 ** 30) // 4)
    arr = np.ones(n, np.float32)
    nbytes = arr.nbytes
    out = {}
    for t in threads:
        t = int(t)
        chunks = np.array_split(arr, t)
        best = float("inf")
        with concurrent.futures.ThreadPoolExecutor(max_workers=t) as pool:
            list(pool.map(np.sum, chunks))          # warm-up
            for _ in range(repeats):
                t0 = time.perf_counter()
                total = sum(pool.map(np.sum, chunks))
                best = min(best, time.perf_counter() - t0)
        if not np.isfinite(total):
            raise RuntimeError("bandwidth probe produced a non-finite sum")
        out[t] = {"best_s": best, "gb_per_s": nbytes / best / 1e9}
    del arr
    return {"bytes": nbytes, "threads": out, "method": METHOD.format(gib=gib, repeats=repeats)}


def param_bytes(params) -> int:
    """Bytes of every leaf of the params pytree (a tied head is one leaf: counted once)."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))


def kv_bytes_per_token(config) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * np.dtype(config.dtype).itemsize


def roofline(params, config, ctx_mean: float, bandwidth_gb_s: float, capacity_mean: float | None = None) -> dict:
    w = param_bytes(params)
    kv_tok = kv_bytes_per_token(config)
    step = w + kv_tok * ctx_mean
    out = {
        "weight_bytes": w,
        "kv_bytes_per_context_token": kv_tok,
        "mean_context_tokens": ctx_mean,
        "kv_bytes_at_mean_context": kv_tok * ctx_mean,
        "bytes_per_decode_step": step,
        "bandwidth_gb_per_s": bandwidth_gb_s,
        "roofline_tokens_per_s": bandwidth_gb_s * 1e9 / step,
    }
    if capacity_mean is not None:
        # specjax's attention reads all capacity slots (masked), not only the committed ones.
        touched = w + kv_tok * capacity_mean
        out.update(mean_capacity_slots=capacity_mean, bytes_per_step_full_cache=touched,
                   roofline_tokens_per_s_full_cache=bandwidth_gb_s * 1e9 / touched)
    return out
