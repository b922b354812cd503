"""Prefill in chunks: a long prompt enters the cache a chunk at a time.

One call over a P-token prompt builds attention scores for every (query, cache slot) pair at
once: P x capacity per head and layer, which for a prompt near an 8k context is gigabytes of
temporaries (issue 18). Chunks of at most `chunk` tokens bound the temporaries by chunk x
capacity, whatever the prompt length, and with a fresh cache (``start_bound=0``) each chunk
reads only the slots before it, so the work is the causal triangle, not prompt x capacity;
the arithmetic is the same causal attention, so the cache holds the same entries up to float
rounding (the softmax of a query is summed in pieces). A prompt no longer than `chunk` runs as
one call, exactly the program of a plain `apply` (reading only the committed slots when the
entry lengths are bounded).

Works for any model of the `apply` protocol: chunk j is applied with ``num_valid_B`` clipped
to the row's remaining valid tokens, so a short row's later chunks are written past its length
(never attended, never committed) and stay inside the first P slots.
"""

from __future__ import annotations

import jax.numpy as jnp

PREFILL_CHUNK = 512


def prefill(model, params, prompt_BP, cache, num_valid_B, chunk: int | None = PREFILL_CHUNK,
            start_bound: int | None = None, feature_layers: tuple[int, ...] | None = None):
    """The cache after feeding ``prompt_BP`` (right-padded; ``num_valid_B`` tokens of each row
    enter the cache) in chunks of at most ``chunk`` tokens (None: one call). Returns the cache.

    ``start_bound`` (static): a bound on the cache's committed lengths on entry, e.g. 0 for a
    fresh cache. With it, and a cache that supports `limit_attention` (`KVCache`), the chunk at
    offset ``start`` attends only to the first ``start_bound + start`` slots (all a row can have
    committed before it) instead of the whole capacity: prefill time then grows with the
    prompt, not prompt x capacity, and the first chunk is a plain causal forward. None: every
    chunk reads the whole capacity (any entry state).

    ``feature_layers`` (a model with ``apply_with_features``): also return the hidden features
    of every prompt position, ``(cache, features_BPF)`` (positions past a row's valid count
    hold garbage)."""
    P = prompt_BP.shape[1]
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1 (or None), got {chunk}")
    if start_bound is not None and start_bound < 0:
        raise ValueError(f"start_bound must be >= 0 (or None), got {start_bound}")
    limited = start_bound is not None and hasattr(cache, "limit_attention")
    step = max(P, 1) if chunk is None else chunk
    num_valid_B = jnp.asarray(num_valid_B, jnp.int32)
    feats = []
    for start in range(0, max(P, 1), step):
        block_BC = prompt_BP[:, start:start + step]
        n_B = jnp.clip(num_valid_B - start, 0, block_BC.shape[1]) if P > step else num_valid_B
        if limited:
            cache = cache.limit_attention(min(start_bound + start, cache.capacity))
        if feature_layers is None:
            _, cache = model.apply(params, block_BC, cache, num_valid_B=n_B)
        else:
            _, f_BCF, cache = model.apply_with_features(params, block_BC, cache, num_valid_B=n_B,
                                                        layers=tuple(feature_layers))
            feats.append(f_BCF)
    cache = cache.limit_attention(None) if limited else cache
    if feature_layers is None:
        return cache
    return cache, jnp.concatenate(feats, axis=1)
