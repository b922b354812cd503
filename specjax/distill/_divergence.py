"""Divergences between the teacher's (target's) and the student's (draft's) token distributions.

All four take full logits ``[..., V]`` of the teacher (p) and the student (q), apply the same
temperature to both, and return one value per position ``[...]``; `masked_mean` averages over
the loss positions. Following DistillSpec (Zhou et al., ICLR 2024, Sec. 3 and Table 1):

    FKL  KL(p || q) = sum_x p log(p / q)
    RKL  KL(q || p) = sum_x q log(q / p)
    JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q
    TVD  = 1/2 sum_x |p - q|          (and 1 - TVD = sum_x min(p, q) is the acceptance rate)

Tokens with probability zero (logit -inf, e.g. outside a reduced draft head) contribute
0 log 0 = 0; FKL is +inf when q = 0 where p > 0, as it should be (the trainer compares a
reduced head with p restricted to the head's tokens, see `specjax.distill._train`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _xlogy_ratio(p, logp, logq):
    """p * (log p - log q), 0 where p = 0 (gradient-safe: no inf - inf or 0 * inf)."""
    pos = p > 0
    diff = jnp.where(pos, logp, 0.0) - jnp.where(pos, logq, 0.0)
    return jnp.where(pos, p * diff, 0.0)


def _log_softmax(logits, temperature):
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def forward_kl(p_logits, q_logits, temperature=1.0):
    logp, logq = _log_softmax(p_logits, temperature), _log_softmax(q_logits, temperature)
    return jnp.sum(_xlogy_ratio(jnp.exp(logp), logp, logq), axis=-1)


def reverse_kl(p_logits, q_logits, temperature=1.0):
    return forward_kl(q_logits, p_logits, temperature)


def generalized_jsd(p_logits, q_logits, temperature=1.0, beta=0.5):
    """beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q, for 0 < beta < 1."""
    logp, logq = _log_softmax(p_logits, temperature), _log_softmax(q_logits, temperature)
    beta = jnp.asarray(beta, jnp.float32)
    # log m = logaddexp(log beta + log p, log(1 - beta) + log q), finite wherever p or q > 0;
    # tokens with p = q = 0 get a placeholder (their terms are 0) so no NaN reaches the gradient.
    neither = jnp.isneginf(logp) & jnp.isneginf(logq)
    logm = jnp.logaddexp(jnp.log(beta) + jnp.where(neither, 0.0, logp),
                         jnp.log1p(-beta) + jnp.where(neither, 0.0, logq))
    p, q = jnp.exp(logp), jnp.exp(logq)
    return (beta * jnp.sum(_xlogy_ratio(p, logp, logm), axis=-1)
            + (1.0 - beta) * jnp.sum(_xlogy_ratio(q, logq, logm), axis=-1))


def total_variation(p_logits, q_logits, temperature=1.0):
    p = jax.nn.softmax(p_logits.astype(jnp.float32) / temperature, axis=-1)
    q = jax.nn.softmax(q_logits.astype(jnp.float32) / temperature, axis=-1)
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


def divergence(name: str, p_logits, q_logits, temperature=1.0, beta=0.5):
    """Per-position divergence by name: 'fkl', 'rkl', 'jsd' (generalized, beta) or 'tvd'."""
    if name == "fkl":
        return forward_kl(p_logits, q_logits, temperature)
    if name == "rkl":
        return reverse_kl(p_logits, q_logits, temperature)
    if name == "jsd":
        return generalized_jsd(p_logits, q_logits, temperature, beta)
    if name == "tvd":
        return total_variation(p_logits, q_logits, temperature)
    raise ValueError(f"unknown divergence {name!r}: expected one of {DIVERGENCES}")


def masked_mean(values, mask):
    """Mean of `values` over positions where mask > 0 (0 if there are none)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)
