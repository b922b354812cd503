"""The drafter protocol: what a drafter reads, what it returns, and how it is told the outcome.

A drafter is a frozen, hashable object (a static argument of the jitted engine); its weights,
if any, travel separately as ``params`` (an argument of every call, never a closure constant).

Cache convention shared with the engine: a committed sequence of length L is "seen" by a
model cache when the cache holds the first L - 1 tokens; the last committed token is always
the first input of the next forward. So every round feeds the target ``[last, d_1 .. d_G]``.

Every ``propose`` gets one `DraftContext`, the same object for every kind of drafter: the
committed tokens and lengths, the target's KV cache (holding the committed prefix minus the
last token, read-only), a slot for the target's hidden features of the committed positions
(``None`` until a drafter needs them), and which rows are still generating. A drafter reads
what it needs from it; the engine never asks a drafter what kind it is.

* ``init(params, prompt_BP, prompt_lengths_B, capacity) -> state``: prefill on the prompts.
  The state is batch-major: every array leaf has the batch on axis 0, except `KVCache`s (their
  own layouts), so the engine can copy rows (`Prefill.repeat`) and refill one row with a new
  request (`Engine.refill`, the slot scheduler); a leaf of another shape is refused there.
* ``propose(params, state, context, key_B, gamma, sampling) -> (tokens_BG, q_BGV, state)``:
  G = gamma proposals per row, each sampled from ``q`` with the row's own key; ``q`` must be
  exactly the distribution the token was drawn from, after the same logits processing
  (``sampling``) the target uses. A deterministic proposer reports one-hot ``q``.
* ``commit(state, new_lengths_B) -> state``: the round's committed lengths (accepted
  proposals plus one target token, after EOS / max-token truncation); a cache is rolled back
  with its own ``truncate``. Rounds without drafting (gamma = 0) call neither ``propose``
  nor ``commit``: a stateful drafter catches up on the unseen tokens in its next ``propose``.
* ``forward_passes(gamma) -> int``: draft forward passes a round of ``gamma`` proposals
  costs (0 for model-free drafters); feeds the metrics.

Feature-level draft heads (`specjax.drafters.MedusaDrafter`, `FeatureHeadDrafter`) also have
``feature_layers`` (the target layers they read, -1 = the last before the final norm): the
engine then runs the target with ``apply_with_features``, keeps the features of the committed
positions and passes them as ``context.features`` [B, capacity, F] (positions
``< lengths_B - 1`` valid), and calls ``init(..., features_BPF=)`` with the prompt's features.

Draft sources (optional): a drafter that picks per round between sources that differ in
acceptance and cost (`HybridDrafter`: prompt lookup or a model) names ``regimes`` (their count),
``regime_B(params, context) -> [B] int32`` (the source of each row's next round, from committed
tokens and the draft params only; regime 0 is the one that runs whenever any row needs it) and ``for_regime(r)`` (the same
drafter held to source r, for timing). Adaptive gamma then keeps its estimate, current gamma and
round times per source (`specjax.decoding` adaptive module doc).

Token trees (`specjax.trees`): ``propose_tree(params, state, context, key_B, tree, sampling,
children) -> (DraftTree, q_BN1V, state)`` drafts a whole tree for a static ``tree`` setting
(`TreeShape` or `DynamicTree`); ``children`` is how each node's children are drawn
(`trees.CHILDREN_MODES`; a drafter that can only make deterministic trees reports
``"deterministic"`` in the returned tree whatever was asked). ``q_BN1V[:, 0]`` is the
distribution the root's children were drawn from, ``q_BN1V[:, n + 1]`` node n's. A drafter
that keeps tentative K/V of tree nodes records where in ``DraftTree.draft_slots_BN`` and gets
the accepted path back in ``commit(state, new_lengths_B, accepted)`` (`trees.AcceptedPath`; None
after a linear round). ``tree_forward_passes(tree)`` is the tree round's draft forward count.
A drafter that cannot draft a given tree raises ValueError from ``check_tree(tree)`` (called
when the engine is built); one with a longest chain (a parallel block, Medusa's heads) may
define ``check_gamma(gamma)``, called then for every integer gamma the engine may run.

What a drafter needs and offers (features, its own cache, trees, draft sources) it declares
as data in ``capabilities`` (`Capabilities`); the engine reads that, nothing else. A drafter
kind that `specjax generate` can build is registered with its frozen config and builder
(`specjax.drafters.register_drafter`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
from flax import struct

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a drafter needs from the engine and what it offers, declared as data (every drafter
    has ``capabilities``; the engine reads it and never probes the drafter's attributes).

    feature_layers: the target layers whose hidden features it reads (0-based, -1 = the last
      before the final norm; empty: none). The target must offer ``apply_with_features``.
    own_cache: it keeps a KV cache of its own (rolled back by ``commit``), besides the target's.
    trees: it drafts token trees (``propose_tree``, ``tree_forward_passes``; ``check_tree`` may
      still refuse a particular tree); False: chains only.
    regimes: its draft sources that adaptive gamma tells apart; > 1 needs ``regime_B`` and
      ``for_regime`` (see the module doc, "Draft sources").
    """
    feature_layers: tuple[int, ...] = ()
    own_cache: bool = False
    trees: bool = False
    regimes: int = 1

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.regimes < 1:
            raise ValueError(f"regimes must be >= 1, got {self.regimes}")


CHAIN_ONLY = Capabilities()


@struct.dataclass
class DraftContext:
    """What every drafter may read in a round (read-only).

    tokens_BS: committed tokens, ``PAD_ID`` after ``lengths_B``; lengths_B: committed lengths;
    target_cache: the target's KV cache (its rows hold ``lengths_B - 1`` tokens);
    features: the target's hidden features [B, capacity, F] of the committed positions (those
      ``< lengths_B - 1``), for feature-level draft heads (``None`` unless the drafter names
      ``feature_layers``).
    active_B: [B] bool, the rows still generating (the others' proposals are never committed);
      ``None``: all. A drafter may skip work that only finished rows would need.
    """
    tokens_BS: jax.Array
    lengths_B: jax.Array
    target_cache: PyTree
    features: PyTree = None
    active_B: PyTree = None


@runtime_checkable
class Drafter(Protocol):
    vocab_size: int
    capabilities: Capabilities

    def init(self, params: PyTree, prompt_BP: jax.Array, prompt_lengths_B: jax.Array,
             capacity: int) -> PyTree:
        ...

    def propose(self, params: PyTree, state: PyTree, context: DraftContext, key_B: jax.Array,
                gamma: int, sampling: Any) -> tuple[jax.Array, jax.Array, PyTree]:
        ...

    def commit(self, state: PyTree, new_lengths_B: jax.Array, accepted: Any = None) -> PyTree:
        ...

    def forward_passes(self, gamma: int) -> int:
        ...

    def propose_tree(self, params: PyTree, state: PyTree, context: DraftContext, key_B: jax.Array,
                     tree: Any, sampling: Any, children: str) -> tuple[Any, jax.Array, PyTree]:
        ...

    def tree_forward_passes(self, tree: Any) -> int:
        ...

    def check_tree(self, tree: Any) -> None:
        ...
