"""Token-level speculative verification (Leviathan et al., 2023, Alg. 1; Chen et al., 2023)."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class TokenVerifier(UniformDrivenVerifier):
    """Standard token-by-token rejection sampling; exact for any ``q``.

    Position g's draft token ``x`` is accepted iff ``u_g * q(x) < p(x)`` (``u_g ~ U[0, 1)``;
    no division, so a rejection implies ``p(x) < q(x)``); the first rejection stops the row.
    On rejection at g the replacement is drawn from ``norm(max(0, p_g - q_g))`` (with the
    degenerate rule of ``normalize_residual``), otherwise the bonus from ``p_G``.

    Pure and jittable; vectorized over batch and positions (first rejection via cumprod).
    Keys: ``key`` is split into one key per row, and each row key into an acceptance key
    (the G uniforms) and a replacement key (the one corrected/bonus token).

    Attributes:
      residual_tol: tolerance tau on the residual mass (see ``RESIDUAL_TOL``).
    """

    residual_tol: float = RESIDUAL_TOL

    def verify_with_uniforms(self, u_BG, key, draft_tokens_BG, q_BGV, p_BG1V) -> VerifyResult:
        """Same as calling the verifier, with the acceptance uniforms injected.

        ``key`` still provides the replacement-sampling keys (the same per-row keys
        ``__call__`` uses), so ``__call__(key, ...)`` equals
        ``verify_with_uniforms(<uniforms drawn from key>, key, ...)``.
        """
        batch, gamma = draft_tokens_BG.shape
        _, replace_keys_B = row_keys(key, batch)
        p_BG1V = p_BG1V.astype(jnp.float32)
        q_BGV = q_BGV.astype(jnp.float32)
        p_BGV = p_BG1V[:, :gamma]

        qx_BG = token_probs(q_BGV, draft_tokens_BG)
        px_BG = token_probs(p_BGV, draft_tokens_BG)
        accepted_BG = u_BG * qx_BG < px_BG
        ratio_BG = px_BG / jnp.where(qx_BG > 0, qx_BG, 1.0)
        accept_prob_BG = jnp.where(qx_BG > 0, jnp.minimum(1.0, ratio_BG),
                                   (px_BG > 0).astype(jnp.float32))
        n_accepted_B = jnp.sum(jnp.cumprod(accepted_BG.astype(jnp.int32), axis=1), axis=1)

        residual_BGV, degenerate_BG = normalize_residual(
            jnp.maximum(p_BGV - q_BGV, 0.0), p_BGV, self.residual_tol)
        residual_BG1V = jnp.concatenate([residual_BGV, p_BG1V[:, gamma:]], axis=1)
        # A degenerate residual counts only if it is the one sampled (a rejection at n < G).
        degenerate_BG1 = jnp.concatenate(
            [degenerate_BG, jnp.zeros((batch, 1), bool)], axis=1)
        degenerate_B = jnp.take_along_axis(degenerate_BG1, n_accepted_B[:, None], axis=1)[:, 0]

        next_token_B = sample_rows(replace_keys_B, gather_position(residual_BG1V, n_accepted_B))
        return assemble_result(n_accepted_B, draft_tokens_BG, next_token_B, accept_prob_BG,
                               residual_BG1V, degenerate_B, u_BG)
