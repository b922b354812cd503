"""The model `apply` protocol: the one interface the engine, drafters and trainer call.

A *model* is a frozen, hashable object (it is passed to `jax.jit` as a static argument) with:

* ``vocab_size: int``
* ``apply(params, tokens_BT, cache, num_valid_B=None) -> (logits_BTV, cache)``
  - ``params`` is a pytree, in the layout the model's config prescribes (for `Llama`, see
    `Llama.prepare_params`).
  - ``cache`` is a pytree with a field ``lengths_B`` (int32 [B]): the committed length of
    every row. ``apply`` writes the T new tokens of row b at slots ``lengths_B[b] + t`` and
    advances ``lengths_B[b]`` by ``num_valid_B[b]`` (default T). Positions are the slots:
    rows are right-padded, so the position of a token is the number of tokens before it,
    which is exactly its slot; the model derives positions from the cache instead of taking
    them as an argument, which removes a whole class of position/slot mismatch bugs.
    Query t of row b attends to slots ``< lengths_B[b] + t + 1``; slots at or beyond that
    are never read, so rollback is ``cache.replace(lengths_B=shorter)`` and never a copy.
  - ``cache=None`` means a plain causal forward from position 0 (training, scoring).
  - One call serves prefill (T = padded prompt length with ``num_valid_B``), one-token
    decode (T = 1) and the verification block (T = gamma + 1).
* ``init_cache(batch_size, capacity) -> cache`` with ``lengths_B`` zeros.

Capacity is the caller's to check on the host *before* the loop (see
``specjax.decoding.Engine``, which checks every batch): XLA clamps out-of-range dynamic writes silently.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

PyTree = Any


@runtime_checkable
class DecoderModel(Protocol):
    vocab_size: int

    def apply(
        self,
        params: PyTree,
        tokens_BT: jax.Array,
        cache: PyTree | None,
        num_valid_B: jax.Array | None = None,
    ) -> tuple[jax.Array, PyTree]:
        ...

    def init_cache(self, batch_size: int, capacity: int) -> PyTree:
        ...


class CacheCapacityError(ValueError):
    """A write would run past the cache's last slot (XLA would clamp it silently)."""
