"""Adaptive draft length: pick gamma per round from recent acceptance and a cost model.

The policy lives inside the jitted loop. Each gamma in the configured set (0 = plain target
decoding included) has its own compiled branch, chosen per round with `lax.switch`; all
branches return the same shapes (buffers sized for the largest gamma), so the loop state is
unchanged across branches.

Decision rule (Leviathan et al. 2023, §3.3, with measured instead of modelled costs): with an
acceptance estimate a, the expected committed tokens of a gamma-round are
(1 - a^(gamma+1)) / (1 - a), and its time is round_time_s[gamma], calibrated on the host
once per model pair and carried in the policy state. The policy picks the gamma with the least predicted time per token.
Hysteresis: it moves away from the current gamma only when the best one is predicted at
least `hysteresis` (relative) cheaper. The estimate a is an exponential moving average of the
mean acceptance probability min(1, p/q) at the draft positions actually tested this round,
averaged over active rows; while at gamma = 0 nothing is tested, so every `probe_every`
rounds the smallest positive gamma is tried once to refresh it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class AdaptiveGamma:
    gammas: tuple[int, ...] = (0, 1, 2, 3, 4, 6)
    ema: float = 0.7              # weight of the old estimate
    hysteresis: float = 0.05
    probe_every: int = 16
    initial_alpha: float = 0.5

    def __post_init__(self):
        if not self.gammas or any(g < 0 for g in self.gammas) or list(self.gammas) != sorted(set(self.gammas)):
            raise ValueError(f"gammas must be distinct, sorted and >= 0, got {self.gammas}")


@struct.dataclass
class PolicyState:
    alpha: jnp.ndarray             # float32 scalar: acceptance estimate
    index: jnp.ndarray             # int32 scalar: the current gamma's index in `gammas`
    since_probe: jnp.ndarray       # int32 scalar: rounds spent at gamma = 0 since last probe
    round_time_G: jnp.ndarray      # float32 [len(gammas)]: seconds (or relative cost) of a round


def init_policy(policy: AdaptiveGamma, round_time_G) -> PolicyState:
    """Start at the largest gamma with the prior acceptance estimate."""
    return PolicyState(alpha=jnp.float32(policy.initial_alpha), index=jnp.int32(len(policy.gammas) - 1),
                       since_probe=jnp.int32(0), round_time_G=jnp.asarray(round_time_G, jnp.float32))


def expected_tokens(alpha, gamma_G):
    """(1 - a^(g+1)) / (1 - a), with the a -> 1 limit g + 1."""
    alpha = jnp.clip(alpha, 0.0, 1.0)
    near_one = alpha > 1.0 - 1e-6
    safe = jnp.where(near_one, 0.5, alpha)
    val = (1.0 - safe ** (gamma_G + 1)) / (1.0 - safe)
    return jnp.where(near_one, gamma_G + 1.0, val)


def choose(policy: AdaptiveGamma, state: PolicyState):
    """(index of the gamma to run this round, whether it is a probe out of gamma = 0)."""
    gammas_G = jnp.asarray(policy.gammas, jnp.float32)
    per_token_G = state.round_time_G / expected_tokens(state.alpha, gammas_G)
    best = jnp.argmin(per_token_G).astype(jnp.int32)
    keep = per_token_G[best] > (1.0 - policy.hysteresis) * per_token_G[state.index]
    chosen = jnp.where(keep, state.index, best)
    positive = [i for i, g in enumerate(policy.gammas) if g > 0]
    probe = jnp.zeros((), bool)
    if policy.gammas[0] == 0 and positive:
        probe = (chosen == 0) & (state.since_probe >= policy.probe_every)
        chosen = jnp.where(probe, jnp.int32(positive[0]), chosen)
    return chosen, probe


def update(policy: AdaptiveGamma, state: PolicyState, chosen, probe, tested_mean_accept, any_tested):
    """Fold this round's mean tested acceptance into the estimate and remember the choice.

    A probe round does not become the current gamma unless the policy would choose it anyway.
    """
    alpha = jnp.where(any_tested, policy.ema * state.alpha + (1 - policy.ema) * tested_mean_accept,
                      state.alpha)
    at_zero = jnp.asarray(policy.gammas, jnp.int32)[chosen] == 0
    since = jnp.where(at_zero, state.since_probe + 1, 0)
    index = jnp.where(probe, state.index, chosen)
    return state.replace(alpha=alpha, index=index.astype(jnp.int32), since_probe=since.astype(jnp.int32))
