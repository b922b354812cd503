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
"""

from specjax.verify._block import BlockVerifier
from specjax.verify._greedy import GreedyVerifier
from specjax.verify._residual import RESIDUAL_TOL, normalize_residual
from specjax.verify._result import PAD_TOKEN, Verifier, VerifyResult
from specjax.verify._token import TokenVerifier
from specjax.verify._validate import validate_verify_inputs

__all__ = [
    "BlockVerifier",
    "GreedyVerifier",
    "PAD_TOKEN",
    "RESIDUAL_TOL",
    "TokenVerifier",
    "Verifier",
    "VerifyResult",
    "normalize_residual",
    "validate_verify_inputs",
]
