"""Prefill in chunks: a long prompt enters the cache a chunk at a time.

One call over a P-token prompt builds attention scores for every (query, cache slot) pair at
once: P x capacity per head and layer, which for a prompt near an 8k context is gigabytes of
temporaries (issue 18: a 5,332-token prompt used 11.7 GB). Chunks of at most `chunk` tokens
bound the temporaries by chunk x capacity, whatever the prompt length; the arithmetic is the
same causal attention, so the cache holds the same entries up to float rounding (the softmax
of a query is summed in pieces). A prompt no longer than `chunk` runs as one call, exactly the
program of a plain `apply`.

Works for any model of the `apply` protocol: chunk j is applied with ``num_valid_B`` clipped
to the row's remaining valid tokens, so a short row's later chunks are written past its length
(never attended, never committed) and stay inside the first P slots.
"""

from __future__ import annotations

import jax.numpy as jnp

PREFILL_CHUNK = 512


def prefill(model, params, prompt_BP, cache, num_valid_B, chunk: int | None = PREFILL_CHUNK):
    """The cache after feeding ``prompt_BP`` (right-padded; ``num_valid_B`` tokens of each row
    enter the cache) in chunks of at most ``chunk`` tokens (None: one call). Returns the cache."""
    P = prompt_BP.shape[1]
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1 (or None), got {chunk}")
    if chunk is None or P <= chunk:
        return model.apply(params, prompt_BP, cache, num_valid_B=num_valid_B)[1]
    num_valid_B = jnp.asarray(num_valid_B, jnp.int32)
    for start in range(0, P, chunk):
        block_BC = prompt_BP[:, start:start + chunk]
        n_B = jnp.clip(num_valid_B - start, 0, block_BC.shape[1])
        _, cache = model.apply(params, block_BC, cache, num_valid_B=n_B)
    return cache
