"""The degenerate-residual rule, in one place, shared by the token-level and block verifiers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

RESIDUAL_TOL = 1e-6
"""Default tolerance tau on the (unnormalized) residual mass, for float32 probabilities.

Why 1e-6: for the token-level verifier a rejection implies ``p(x) < q(x)``, so in exact
arithmetic the residual mass ``sum(max(0, p - q)) >= q(x) - p(x) > 0``; a mass at or below
tau can only come from float32 rounding, e.g. draft and target computing the same
distribution along different reduction orders, where every entry differs by a few ulps
(relative ~6e-8) and the total positive difference is a few times 2**-24. tau = 1e-6 is
~8 ulps of 1.0: above that rounding floor, yet small enough that the rule's bias is
negligible. Token-level: the rejection branch has probability ``sum(max(0, q - p)) = m``
(for normalized p, q), so replacing a residual of mass ``m <= tau`` by p changes the law
of the committed token by at most ``m <= tau`` in total variation. The block verifier uses
the same rule on its residual ``max(0, w p - q)``, whose mass can only fall to ``tau`` when
``w p`` and ``q`` agree up to rounding.
"""


def normalize_residual(
    unnormalized_V: jax.Array, fallback_V: jax.Array, tol: float
) -> tuple[jax.Array, jax.Array]:
    """Normalize a residual ``max(0, .)`` measure, or fall back when its mass is degenerate.

    THE degenerate-residual rule (the only place it is implemented): let
    ``m = sum(unnormalized_V)``. If ``m > tol`` return ``unnormalized_V / m``. Otherwise the
    residual is numerically empty (possible only through rounding, see ``RESIDUAL_TOL``) and
    the token is drawn from ``fallback_V`` -- the target distribution ``p`` at that position --
    instead; this biases the output by at most ``tol`` in total variation and never emits a
    token outside ``p``'s support. The boolean flag is returned so callers count every use
    in ``VerifyResult.degenerate_residual_B``.

    Args:
      unnormalized_V: nonnegative ``[..., V]`` residual measure.
      fallback_V: ``[..., V]`` target distribution at the same positions.
      tol: the tolerance tau.
    Returns:
      (distribution ``[..., V]``, degenerate flag ``[...]`` bool).
    """
    mass = jnp.sum(unnormalized_V, axis=-1, keepdims=True)
    degenerate = mass <= tol
    dist = jnp.where(degenerate, fallback_V, unnormalized_V / jnp.where(degenerate, 1.0, mass))
    return dist.astype(jnp.float32), degenerate[..., 0]
