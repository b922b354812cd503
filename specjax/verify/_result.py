"""The result type every verifier returns, and the pad value of unused commit slots."""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from specjax.sampling import sample

PAD_TOKEN = -1
"""Value of the slots of ``VerifyResult.committed_BG1`` after the last committed token.

Row ``b`` commits exactly ``n_accepted_B[b] + 1`` tokens (slots ``0 .. n_accepted_B[b]``);
every later slot holds ``PAD_TOKEN``. It is negative so it can never be mistaken for a
vocabulary id; callers must mask it out (e.g. scatter with ``mode="drop"`` at an out-of-range
index, or test ``committed >= 0``) and never feed it to an embedding lookup.
"""


@struct.dataclass
class VerifyResult:
    """Outcome of verifying one block of ``G`` draft tokens per row (shape-suffixed fields).

    Attributes:
      n_accepted_B: int32 in ``[0, G]``, the accepted draft prefix length of each row.
      committed_BG1: int32 ``[B, G+1]``: the accepted draft prefix, then one corrected token
        (on rejection) or bonus token (all accepted), then ``PAD_TOKEN``.
      from_draft_BG1: bool ``[B, G+1]``: True exactly at the accepted draft slots
        (``g < n_accepted_B``).
      accept_prob_BG: float32 ``[B, G]``: the acceptance probability the verifier used at each
        position. Token-level: ``min(1, p(x)/q(x))``. Greedy: ``1[x == argmax p]``.
        Block: ``h_{g+1}``, the probability that the block check for the prefix of length
        ``g+1`` passes (see ``BlockVerifier``).
      residual_BG1V: float32 ``[B, G+1, V]``: the distribution the replacement (positions
        ``< G``) or bonus (position ``G``) token at each position would be drawn from, after
        the degenerate-residual rule. Only the entry at ``n_accepted_B`` is actually used.
      degenerate_residual_B: int32 ``[B]``: how many degenerate residuals (mass below the
        verifier's tolerance, replaced by the target distribution) this call *used* in the row.
      uniforms_BG: float32 ``[B, G]``: the acceptance uniforms used (zeros for greedy, which
        draws none).
    """

    n_accepted_B: jax.Array
    committed_BG1: jax.Array
    from_draft_BG1: jax.Array
    accept_prob_BG: jax.Array
    residual_BG1V: jax.Array
    degenerate_residual_B: jax.Array
    uniforms_BG: jax.Array

    @property
    def num_committed_B(self) -> jax.Array:
        """Tokens committed per row: ``n_accepted_B + 1``."""
        return self.n_accepted_B + 1


class UniformDrivenVerifier:
    """Mixin: draw one acceptance uniform per row and position from the row's acceptance key,
    then call ``verify_with_uniforms`` (which tests can call with injected uniforms)."""

    def __call__(self, key, draft_tokens_BG, q_BGV, p_BG1V) -> "VerifyResult":
        batch, gamma = draft_tokens_BG.shape
        accept_keys_B, _ = row_keys(key, batch)
        u_BG = row_uniforms(accept_keys_B, gamma)
        return self.verify_with_uniforms(u_BG, key, draft_tokens_BG, q_BGV, p_BG1V)


class Verifier(Protocol):
    """What every verifier is: a frozen, hashable dataclass (a valid static jit argument)."""

    def __call__(self, key: jax.Array, draft_tokens_BG: jax.Array, q_BGV: jax.Array,
                 p_BG1V: jax.Array) -> VerifyResult:
        ...


def assemble_result(
    n_accepted_B: jax.Array,
    draft_tokens_BG: jax.Array,
    next_token_B: jax.Array,
    accept_prob_BG: jax.Array,
    residual_BG1V: jax.Array,
    degenerate_B: jax.Array,
    uniforms_BG: jax.Array,
) -> VerifyResult:
    """Lay out committed tokens/flags from the accepted count and the one sampled token."""
    batch, gamma = draft_tokens_BG.shape
    slot_G1 = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
    n_B1 = n_accepted_B.astype(jnp.int32)[:, None]
    draft_BG1 = jnp.concatenate(
        [draft_tokens_BG.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
    committed = jnp.where(slot_G1 < n_B1, draft_BG1,
                          jnp.where(slot_G1 == n_B1, next_token_B.astype(jnp.int32)[:, None],
                                    PAD_TOKEN))
    return VerifyResult(
        n_accepted_B=n_accepted_B.astype(jnp.int32),
        committed_BG1=committed.astype(jnp.int32),
        from_draft_BG1=slot_G1 < n_B1,
        accept_prob_BG=accept_prob_BG.astype(jnp.float32),
        residual_BG1V=residual_BG1V.astype(jnp.float32),
        degenerate_residual_B=degenerate_B.astype(jnp.int32),
        uniforms_BG=uniforms_BG.astype(jnp.float32),
    )


def row_keys(key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
    """Explicit key split: one key per row and purpose -> (accept_keys_B, replace_keys_B)."""
    keys_B2 = jax.random.split(key, (batch, 2))
    return keys_B2[:, 0], keys_B2[:, 1]


def row_uniforms(accept_keys_B: jax.Array, gamma: int) -> jax.Array:
    """Acceptance uniforms in [0, 1), one independent stream per row."""
    return jax.vmap(lambda k: jax.random.uniform(k, (gamma,), jnp.float32))(accept_keys_B)


def sample_rows(replace_keys_B: jax.Array, dist_BV: jax.Array) -> jax.Array:
    """One token per row from ``dist_BV`` with that row's replacement key."""
    return jax.vmap(sample)(replace_keys_B, dist_BV)


def gather_position(x_BGV: jax.Array, pos_B: jax.Array) -> jax.Array:
    """``x_BGV[b, pos_B[b]]`` for every row -> ``[B, V]``."""
    return jnp.take_along_axis(x_BGV, pos_B.astype(jnp.int32)[:, None, None], axis=1)[:, 0]


def token_probs(dist_BGV: jax.Array, tokens_BG: jax.Array) -> jax.Array:
    """``dist_BGV[b, g, tokens_BG[b, g]]`` -> ``[B, G]``."""
    return jnp.take_along_axis(dist_BGV, tokens_BG.astype(jnp.int32)[..., None], axis=-1)[..., 0]
