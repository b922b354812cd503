"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh:
"Block Verification Accelerates Speculative Decoding", ICLR 2025, arXiv:2403.10444)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.verify._residual import RESIDUAL_TOL, normalize_residual
from specjax.verify._result import (
    UniformDrivenVerifier,
    VerifyResult,
    assemble_result,
    gather_position,
    row_keys,
    sample_rows,
    token_probs,
)


def _block_weights(px_BG: jax.Array, qx_BG: jax.Array) -> jax.Array:
    """``w_0 = 1``, ``w_i = min(1, w_{i-1} * p(X_i) / q(X_i))`` for ``i = 1..G`` -> ``[B, G+1]``.

    Computed as ``w * p <= 0 ? 0 : (w * p < q ? w * p / q : 1)``, the same rule as
    `TraversalVerifier`'s weights: a draft token outside p's support (``p(X_i) = 0``) yields 0,
    and 0 stays 0 for the rest of the block, whatever q is -- also when ``q(X_i)`` is 0 or
    subnormal (XLA flushes subnormals to 0 on CPU/GPU), where ``w * p < q`` alone is False and
    would have given 1, accepting a token the target cannot emit. ``q(X_i) = 0`` with
    ``p(X_i) > 0`` yields 1 (the ``q -> 0`` limit of ``min(1, w p / q)``), as the token-level
    rule accepts such a token surely.
    """
    def step(w_B, pq):
        px_B, qx_B = pq
        wp_B = w_B * px_B
        w_next = jnp.where(wp_B <= 0, 0.0,
                           jnp.where(wp_B < qx_B, wp_B / jnp.where(qx_B > 0, qx_B, 1.0), 1.0))
        return w_next, w_next

    w0_B = jnp.ones(px_BG.shape[:1], jnp.float32)
    _, w_GB = jax.lax.scan(step, w0_B, (px_BG.T, qx_BG.T))
    return jnp.concatenate([w0_B[:, None], w_GB.T], axis=1)


@dataclasses.dataclass(frozen=True)
class BlockVerifier(UniformDrivenVerifier):
    """Block verification: exact, and optimal in expected accepted length among valid
    verifiers given the same draft block (hence never worse than ``TokenVerifier``).

    Sun et al., ICLR 2025 (arXiv:2403.10444), Alg. 2, in this codebase's indexing. For a row
    with draft ``X_1..X_G`` (0-based position ``i`` holds the distributions of ``X_{i+1}``
    given ``X_1..X_i``: ``q_i = q_BGV[:, i]``, ``p_i = p_BG1V[:, i]``):

    * weights ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_{i-1}(X_i))``: the
      "surviving" probability of the prefix of length i;
    * residual mass ``m_i = sum_x max(0, w_i p_i(x) - q_i(x))`` for ``i < G``;
    * block-check probability ``h_i = m_i / (m_i + 1 - w_i)`` for ``1 <= i < G``, and
      ``h_G = w_G``; when ``m_i + 1 - w_i = 0`` (``w_i = 1`` and ``p_i = q_i``: the residual
      would be empty and, in exact arithmetic, some later check passes surely) ``h_i = 0``;
    * independent ``eta_i ~ U[0,1)``; the accepted length is ``tau = max{i >= 1: eta_i < h_i}``
      (0 if none passes) -- equivalently a backward scan that stops at the first passing i;
    * the next token is drawn from ``norm(max(0, w_tau p_tau - q_tau))`` if ``tau < G`` (the
      degenerate-residual rule applies), else from ``p_G`` (bonus).

    Unlike token-level verification, a prefix may be accepted even when a token in it would
    have been rejected individually: acceptance is decided on the whole block jointly.
    ``accept_prob_BG[:, g]`` reports ``h_{g+1}`` and ``uniforms_BG[:, g]`` the ``eta_{g+1}``,
    so ``P(tau = i | X) = h_i prod_{j > i} (1 - h_j)`` (with ``h_0 = 1``).
    Exactness is checked in the tests by exact enumeration over all draft blocks.
    """

    residual_tol: float = RESIDUAL_TOL

    def verify_with_uniforms(self, u_BG, key, draft_tokens_BG, q_BGV, p_BG1V) -> VerifyResult:
        """``__call__`` with the uniforms ``eta_1..eta_G`` injected (``u_BG[:, g] = eta_{g+1}``);
        ``key`` supplies the per-row replacement keys exactly as in ``__call__``."""
        batch, gamma = draft_tokens_BG.shape
        _, replace_keys_B = row_keys(key, batch)
        p_BG1V = p_BG1V.astype(jnp.float32)
        q_BGV = q_BGV.astype(jnp.float32)
        p_BGV = p_BG1V[:, :gamma]

        w_BG1 = _block_weights(token_probs(p_BGV, draft_tokens_BG),
                               token_probs(q_BGV, draft_tokens_BG))
        w_BG = w_BG1[:, :gamma]
        unnorm_BGV = jnp.maximum(w_BG[..., None] * p_BGV - q_BGV, 0.0)
        mass_BG = jnp.sum(unnorm_BGV, axis=-1)
        denom_BG = mass_BG + (1.0 - w_BG)
        h_BG = jnp.where(denom_BG > 0, mass_BG / jnp.where(denom_BG > 0, denom_BG, 1.0), 0.0)
        # h_i for i = 1..G: positions 1..G-1 from the residual masses, h_G = w_G.
        h_1toG = jnp.concatenate([h_BG[:, 1:], w_BG1[:, -1:]], axis=1)[:, :gamma]
        passed_BG = u_BG < h_1toG
        idx_G = jnp.arange(1, gamma + 1, dtype=jnp.int32)
        n_accepted_B = jnp.max(jnp.where(passed_BG, idx_G[None, :], 0), axis=1,
                               initial=0).astype(jnp.int32)

        residual_BGV, degenerate_BG = normalize_residual(unnorm_BGV, p_BGV, self.residual_tol)
        residual_BG1V = jnp.concatenate([residual_BGV, p_BG1V[:, gamma:]], axis=1)
        degenerate_BG1 = jnp.concatenate([degenerate_BG, jnp.zeros((batch, 1), bool)], axis=1)
        degenerate_B = jnp.take_along_axis(degenerate_BG1, n_accepted_B[:, None], axis=1)[:, 0]

        next_token_B = sample_rows(replace_keys_B, gather_position(residual_BG1V, n_accepted_B))
        return assemble_result(n_accepted_B, draft_tokens_BG, next_token_B, h_1toG,
                               residual_BG1V, degenerate_B, u_BG)
