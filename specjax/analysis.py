"""Speculative decoding analytics (Leviathan, Kalman, Matias, ICML 2023, Sec. 3).

Notation: ``alpha`` is the expected acceptance rate of one draft token,
``alpha = E[sum_x min(p(x), q(x))]``; ``gamma`` the number of draft tokens per round;
``c`` the cost of one draft step relative to one target step.

* expected tokens per round (their Eq. 1): ``(1 - alpha^(gamma+1)) / (1 - alpha)``
  (``gamma + 1`` in the limit alpha -> 1);
* expected walltime improvement (their Thm 3.8):
  ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``.

:class:`RoundCost` replaces the idealized ``gamma c + 1`` by measured per-round costs.
Pure Python / numpy, host side.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

__all__ = [
    "RoundCost",
    "acceptance_rate",
    "best_gamma",
    "expected_tokens_per_round",
    "walltime_improvement",
]

def _check_alpha_gamma(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0 or int(gamma) != gamma:
        raise ValueError(f"gamma must be a nonnegative integer, got {gamma}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """``E[#tokens per round] = (1 - alpha^(gamma+1)) / (1 - alpha)``; ``gamma+1`` at alpha=1.

    Computed as the finite geometric sum ``sum_{i=0}^{gamma} alpha^i`` near alpha = 1, which is
    the same quantity without the 0/0.
    """
    _check_alpha_gamma(alpha, gamma)
    if abs(1.0 - alpha) < 1e-6:
        return float(sum(alpha ** i for i in range(int(gamma) + 1)))
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0)


def best_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The gamma in ``0..max_gamma`` maximizing :func:`walltime_improvement`.

    gamma = 0 (plain target decoding, improvement exactly 1) is a candidate, so 0 is returned
    when speculation does not pay. Ties go to the smallest gamma.
    """
    scores = [walltime_improvement(alpha, g, c) for g in range(int(max_gamma) + 1)]
    return int(np.argmax(np.asarray(scores) - 1e-12 * np.arange(len(scores))))


def acceptance_rate(p, q) -> float:
    """``alpha = mean over positions of sum_x min(p(x), q(x))`` for arrays ``[..., V]``.

    ``sum_x min(p, q) = 1 - TV(p, q)`` is the token-level acceptance probability of a draft
    token sampled from q at that position.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"p and q shapes differ: {p.shape} vs {q.shape}")
    return float(np.mean(np.sum(np.minimum(p, q), axis=-1)))


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """Measured cost of one speculative round.

    Attributes:
      draft_s: seconds per draft step (one proposed token).
      verify_s: seconds of the target forward over k tokens, keyed by k. A round with gamma
        proposals verifies ``k = gamma + 1`` tokens (the proposals and the next distribution);
        ``k = 1`` is a plain one-token target step. Accepts a mapping ``{k: seconds}`` or a
        sequence of ``(k, seconds)`` pairs; stored as a sorted tuple of pairs (hashable).
      overhead_s: fixed per-round cost of the speculative machinery (verification, cache
        rollback, host sync), charged for gamma >= 1 only.

    ``gamma = 0`` means plain target decoding: one 1-token target pass per token, costing
    ``verify_s[1]``.
    """

    draft_s: float
    verify_s: tuple
    overhead_s: float = 0.0

    def __post_init__(self):
        items = self.verify_s.items() if isinstance(self.verify_s, Mapping) else self.verify_s
        pairs = tuple(sorted((int(k), float(v)) for k, v in items))
        if any(k < 1 for k, _ in pairs):
            raise ValueError(f"verify_s keys are token counts k >= 1, got {[k for k, _ in pairs]}")
        object.__setattr__(self, "verify_s", pairs)

    def _verify_time(self, k: int) -> float:
        table = dict(self.verify_s)
        if k not in table:
            raise ValueError(f"no calibrated verification time for k={k} tokens "
                             f"(calibrated: {sorted(table)})")
        return table[k]

    @property
    def gammas(self) -> tuple[int, ...]:
        """The gammas this cost model can price: ``k - 1`` for every calibrated k."""
        return tuple(k - 1 for k, _ in self.verify_s)

    def round_time(self, gamma: int) -> float:
        """Seconds per round: ``gamma * draft_s + verify_s[gamma + 1] + overhead_s``
        (``verify_s[1]`` alone for gamma = 0)."""
        if gamma == 0:
            return self._verify_time(1)
        return gamma * self.draft_s + self._verify_time(gamma + 1) + self.overhead_s

    def predicted_speedup(self, alpha: float, gamma: int, target_token_s: float) -> float:
        """``expected_tokens_per_round(alpha, gamma) * target_token_s / round_time(gamma)``:
        speedup over plain decoding at ``target_token_s`` seconds per token."""
        return expected_tokens_per_round(alpha, gamma) * target_token_s / self.round_time(gamma)

    def seconds_per_token(self, alpha: float, gamma: int) -> float:
        """Expected wall time per committed token."""
        return self.round_time(gamma) / expected_tokens_per_round(alpha, gamma)

    def best_gamma(self, alpha: float) -> int:
        """The calibrated gamma (0 included, if ``verify_s[1]`` is known) with the least
        expected time per token; ties go to the smallest gamma."""
        gammas = self.gammas
        if not gammas:
            raise ValueError("verify_s is empty: nothing calibrated")
        return min(gammas, key=lambda g: (self.seconds_per_token(alpha, g) * (1 + 1e-12 * g), g))
