"""The drafter protocol: how the engine asks for proposals and reports what was kept.

A drafter is a frozen, hashable object (a static argument of the jitted loop); its weights,
if any, travel separately as ``params`` so they are loop invariants, not loop carry.

Cache convention shared with the engine: a committed sequence of length L is "seen" by a
model cache when the cache holds the first L - 1 tokens; the last committed token is always
the first input of the next forward. So every round feeds the target ``[last, d_1 .. d_G]``.

* ``init(params, tokens_BL, prompt_lengths_B, capacity) -> state``: prefill on the prompts.
* ``propose(params, state, tokens_BL, lengths_B, key_B, gamma, sampling)
  -> (draft_tokens_BG, q_BGV, state)``: G = gamma proposals per row, each sampled from
  ``q`` with the row's own key; ``q`` must be exactly the distribution the token was drawn
  from, after the same logits processing (``sampling``) the target uses. A deterministic
  proposer reports one-hot ``q``.
* Optional ``reads_target_cache = True``: the engine then also passes the target's cache
  (holding the committed prefix minus the last token) as ``propose(..., target_cache=...)``,
  read-only; the early-exit drafter runs on its first layers instead of keeping its own.
* ``commit(state, new_lengths_B) -> state``: the round's committed lengths (accepted
  proposals plus one target token, after EOS / max-token truncation); roll any cache back
  to the new committed prefix. Rounds without drafting (gamma = 0) call neither ``propose``
  nor ``commit``: a stateful drafter catches up on the unseen tokens in its next ``propose``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

PyTree = Any


@runtime_checkable
class Drafter(Protocol):
    vocab_size: int

    def init(self, params: PyTree, tokens_BL: jax.Array, prompt_lengths_B: jax.Array,
             capacity: int) -> PyTree:
        ...

    def propose(self, params: PyTree, state: PyTree, tokens_BL: jax.Array, lengths_B: jax.Array,
                key_B: jax.Array, gamma: int, sampling: Any) -> tuple[jax.Array, jax.Array, PyTree]:
        ...

    def commit(self, state: PyTree, new_lengths_B: jax.Array) -> PyTree:
        ...
