"""The model `apply` protocol: the one interface the engine, drafters and trainer call.

A *model* is a frozen, hashable object (it is passed to `jax.jit` as a static argument) with:

* ``vocab_size: int``
* ``apply(params, tokens_BT, cache, num_valid_B=None, tree=None) -> (logits_BTV, cache)``
  - ``params`` is a pytree, in the layout the model's config prescribes (for `Llama`, see
    `Llama.prepare_params`).
  - ``cache`` is a pytree with a field ``lengths_B`` (int32 [B]): the committed length of
    every row. Without ``tree``, ``apply`` writes the T new tokens of row b at slots
    ``lengths_B[b] + t`` and advances ``lengths_B[b]`` by ``num_valid_B[b]`` (default T).
    Positions are the slots: rows are right-padded, so the position of a token is the number
    of tokens before it, which is exactly its slot; the model derives positions from the
    cache instead of taking them as an argument, which removes a whole class of position/slot
    mismatch bugs.
    Query t of row b attends to slots ``< lengths_B[b] + t + 1``; slots at or beyond that
    are never read, so rollback is ``cache.replace(lengths_B=shorter)`` and never a copy.
  - ``cache=None`` means a plain causal forward from position 0 (training, scoring).
  - One call serves prefill (T = padded prompt length with ``num_valid_B``), one-token
    decode (T = 1) and the verification block (T = gamma + 1).
  - ``tree`` (a `specjax.models.TreeBlock`; needs a cache, and ``num_valid_B`` must be None,
    else ValueError): the T tokens are a flattened token tree, not a chain. Token t has
    position ``lengths_B[b] + tree.rel_positions_BT[b, t]``, is written at slot
    ``lengths_B[b] + offset + t`` (``offset = W - T``, static) and sees the committed slots
    ``< lengths_B[b]`` plus the slots ``lengths_B[b] + w`` (w < W) with
    ``tree.visible_BTW[b, t, w]``: columns ``offset ..`` are the block itself (they replace the
    causal mask; a node sees its ancestors and itself), columns ``< offset`` a window over the
    tentative entries earlier tree calls of the same round wrote there (a drafter expanding
    one depth per call). The entries are *tentative*: ``lengths_B`` is returned unchanged, so
    a node's slot is not its position until it is committed. Capacity: the block's last slot,
    ``lengths_B + W - 1``, must fit.
  - ``rows`` (optional; a `specjax.models.PackedRows`, chains only): compute only the listed
    positions of the block, each row's first ones (row-budget rounds, a gamma per row); the
    others' logits are zeros and their entries garbage past the row's used positions. A model
    whose ``apply`` takes no ``rows`` serves every round but row budgets (the engine says so).
* ``init_cache(batch_size, capacity) -> cache`` with ``lengths_B`` zeros.

The cache of a tree-capable model also has ``commit_path(offsets_BA, num_B) -> cache``: slot
``lengths_B[b] + j`` receives the K/V of slot ``lengths_B[b] + offsets_BA[b, j]`` for
``j < num_B[b]`` (the accepted path's entries, root first: for a verification block of
root + nodes, ``offsets = [0, 1 + n_1, 1 + n_2, ..]`` for the path's nodes n_1, n_2, ..;
callers guarantee ``offsets_BA[b, j] >= j``, strictly increasing), then ``lengths_B += num_B``.
Rejected branches stay past the new length as garbage, which no later call reads (a tree call
sees only committed slots, its window and itself), so a rejected node never influences the
next round.
A model without ``tree`` (e.g. `ReducedHeadLlama` today) serves chain drafting and verification
only.

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
        tree: Any = None,
    ) -> tuple[jax.Array, PyTree]:
        ...

    def init_cache(self, batch_size: int, capacity: int) -> PyTree:
        ...


class CacheCapacityError(ValueError):
    """A write would run past the cache's last slot (XLA would clamp it silently)."""
