"""Analytics of Leviathan et al. 2023, Sec. 3, and the measured per-round cost model."""

import numpy as np
import pytest

from specjax.analysis import (
    RoundCost,
    acceptance_rate,
    best_gamma,
    expected_tokens_per_round,
    walltime_improvement,
)


def test_expected_tokens_alpha_08_gamma_4():
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616, abs=1e-12)


def test_expected_tokens_limits():
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(1.0 - 1e-9, 4) == pytest.approx(5.0, abs=1e-6)
    assert expected_tokens_per_round(0.0, 7) == 1.0
    assert expected_tokens_per_round(0.6, 0) == 1.0
    for a in [0.1, 0.5, 0.9, 0.99999]:  # the closed form equals the geometric sum
        assert expected_tokens_per_round(a, 6) == pytest.approx(sum(a ** i for i in range(7)))


def test_walltime_improvement_formula():
    a, g, c = 0.8, 4, 0.05
    assert walltime_improvement(a, g, c) == pytest.approx((1 - a ** 5) / ((1 - a) * (g * c + 1)))
    assert walltime_improvement(0.3, 0, 0.5) == 1.0


def test_best_gamma():
    assert best_gamma(0.8, 0.05) == int(np.argmax([walltime_improvement(0.8, g, 0.05)
                                                   for g in range(17)]))
    assert best_gamma(0.8, 0.05) > 2
    assert best_gamma(0.1, 0.5) == 0  # speculation does not pay
    assert best_gamma(0.99, 0.0, max_gamma=10) == 10


def test_round_cost_example():
    """Target token 10 ms, draft token 1 ms, verifying 4 proposals + the next distribution
    (5 tokens) 12 ms: a round takes 16 ms, ~4.76 ms/token at alpha=0.8, speedup ~2.1x."""
    cost = RoundCost(draft_s=1e-3, verify_s={1: 10e-3, 5: 12e-3})
    assert cost.round_time(4) == pytest.approx(16e-3)
    assert cost.seconds_per_token(0.8, 4) == pytest.approx(16e-3 / 3.3616)
    assert cost.seconds_per_token(0.8, 4) == pytest.approx(4.76e-3, abs=0.01e-3)
    assert cost.predicted_speedup(0.8, 4, 10e-3) == pytest.approx(2.1, abs=0.01)
    assert cost.round_time(0) == pytest.approx(10e-3)
    assert cost.predicted_speedup(0.8, 0, 10e-3) == pytest.approx(1.0)
    assert cost.best_gamma(0.8) == 4
    assert cost.best_gamma(0.05) == 0  # plain decoding wins when nothing is accepted


def test_round_cost_overhead_and_errors():
    cost = RoundCost(draft_s=1e-3, verify_s=[(3, 11e-3), (1, 10e-3)], overhead_s=2e-3)
    assert cost.verify_s == ((1, 10e-3), (3, 11e-3))
    assert cost.gammas == (0, 2)
    assert cost.round_time(2) == pytest.approx(15e-3)
    assert cost.round_time(0) == pytest.approx(10e-3)
    hash(cost)
    with pytest.raises(ValueError, match="k=5"):
        cost.round_time(4)
    with pytest.raises(ValueError):
        RoundCost(draft_s=1e-3, verify_s={0: 1.0})


def test_acceptance_rate():
    p = np.array([[0.5, 0.3, 0.2], [0.8, 0.2, 0.0]])
    q = np.array([[0.6, 0.1, 0.3], [0.5, 0.5, 0.0]])
    assert acceptance_rate(p, q) == pytest.approx((0.8 + 0.7) / 2)
    assert acceptance_rate(p, p) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        acceptance_rate(p, q[:, :2])


def test_bad_arguments():
    with pytest.raises(ValueError):
        expected_tokens_per_round(1.5, 2)
    with pytest.raises(ValueError):
        expected_tokens_per_round(0.5, -1)
    with pytest.raises(ValueError):
        walltime_improvement(0.5, 2, -0.1)
