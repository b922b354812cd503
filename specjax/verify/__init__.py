"""Exact verification of draft blocks.

Every verifier is a small frozen (hashable) dataclass, usable as a static ``jax.jit``
argument, and callable as::

    verifier(key, draft_tokens_BG, q_BGV, p_BG1V) -> VerifyResult

``q_BGV``: the distributions the draft actually sampled ``draft_tokens_BG`` from;
``p_BG1V``: the target's distributions at the G+1 positions (position G: bonus). G may be 0.
Use the same ``specjax.sampling.probabilities`` (same ``SamplingConfig``) for both.
Inputs are checked on the host, outside jit, by ``validate_verify_inputs``.

* ``TokenVerifier``: Leviathan et al. 2023 / Chen et al. 2023 token-level rejection sampling.
* ``BlockVerifier``: Sun et al. 2025 block verification (never fewer accepted tokens).
* ``GreedyVerifier``: temperature 0, accept while the draft equals the target argmax.

Tree verifiers take a flattened draft tree instead (``specjax.trees.DraftTree``)::

    verifier(key, tree, q_BN1V, p_BN1V) -> TreeVerifyResult

* ``GreedyTreeVerifier``: follow the target's argmax down the tree.
* ``RecursiveRejectionVerifier``: SpecInfer / RSD recursive rejection sampling (all modes).
* ``TraversalVerifier``: Weng et al. 2025 leaf-to-root traversal verification (block
  verification on a chain).

The engine picks them by draft kind and name from one registry (`get_verifier`;
`register_verifier` adds one).
"""

from specjax.verify._block import BlockVerifier
from specjax.verify._greedy import GreedyVerifier
from specjax.verify._residual import RESIDUAL_TOL, normalize_residual
from specjax.verify._registry import DRAFT_KINDS, get_verifier, register_verifier, verifier_names
from specjax.verify._result import PAD_TOKEN, Verifier, VerifyResult
from specjax.verify._token import TokenVerifier
from specjax.verify._traversal import TraversalVerifier
from specjax.verify._tree import (
    GreedyTreeVerifier,
    RecursiveRejectionVerifier,
    TreeVerifyResult,
    TreeWalk,
    TreeWalkVerifier,
)
from specjax.verify._validate import validate_verify_inputs

__all__ = [
    "DRAFT_KINDS", "get_verifier", "register_verifier", "verifier_names",
    "BlockVerifier",
    "GreedyTreeVerifier",
    "GreedyVerifier",
    "PAD_TOKEN",
    "RESIDUAL_TOL",
    "RecursiveRejectionVerifier",
    "TokenVerifier",
    "TraversalVerifier",
    "TreeVerifyResult",
    "TreeWalk",
    "TreeWalkVerifier",
    "Verifier",
    "VerifyResult",
    "normalize_residual",
    "validate_verify_inputs",
]
