"""Distribution exactness of feature-level draft heads at T = 1 (tiny random Llamas).

Medusa with top-k + top-p, a reduced EAGLE head and the parallel block drafter, each by chi-square against the exact target
law, with negative controls (a drafter that misreports q) that must fail.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from _heads_common import (DV, D_EXACT, D_NEGATIVE, D_NEW, PER_TEST_ALPHA, T1, T1_FILTERED, _dist_run, _dist_setup,
                           _jit_apply, _law, _pvalue)


@pytest.mark.parametrize("name", list(D_EXACT))
def test_head_sampling_matches_target_law(name):
    """Distribution exactness of head drafters at T = 1: a Medusa head with top-k 3 + top-p 0.9,
    an EAGLE head with a reduced vocabulary (3 of the 5 tokens: its q is 0 on the others,
    which the target may still emit) without filters, that head drafting a sampled token
    tree (2 iid children of the root, one child each; top-k 3) through the tree verifier, and
    the hybrid of prompt lookup (bigrams; used where the last token occurred before, one-hot
    q) and that head (elsewhere), rows mixing both within and across rounds, and the parallel
    block drafter (a block of 2 from one call) as a chain with top-k 3 + top-p 0.9 and as a
    sampled tree (2 iid children of the root, one child each) through the tree verifier.

    A tiny Llama target (V = 5, 2 layers, weights scaled so that its distributions are peaked
    and prefix dependent); every row generates N = 4 tokens after the prompt (1, 4, 2) with
    gamma = 2 (several rounds per row, including the catch-up after a fully accepted round).
    Sample size: B = 10 000 rows per configuration in one batched `Engine.run`, one key per
    row (`make_batch` folds the request ids 0..B-1 into key 2025; all seeds are fixed, so the
    outcome is deterministic). The empirical law of the N-token continuation (5^4 = 625 cells)
    is compared with the exact target-only law (enumerated with `apply` and
    `sampling.probabilities` under the same `SamplingConfig`) by a pooled chi-square test
    (cells with expected count < 5 pooled; cells of exact probability 0 must stay empty).
    Family: the 6 configurations in D_EXACT, family-wise false-alarm rate 1e-4, so each test
    uses alpha = 1e-4 / 6 ~ 1.7e-5 (Bonferroni). Power at B = 10 000 (computed: noncentral
    chi-square with lambda = B w^2, w^2 = sum (q - p)^2 / p over the tested cells of the sampled
    law q against the target law p, df = cells - 1; the test prints its cell count): q is
    detected with probability >= 0.9 once w^2 >= 0.012 at 150 cells or w^2 >= 0.0065 at 30
    cells (critical values ~232 and ~72), three times the w^2 that 30 000 rows detected. The
    negative controls below (Medusa sampling at T/2, the hybrid's misreported q) must fail the
    same test."""
    samp_kw = D_EXACT[name][0]
    gen, rejection = _dist_run(name)
    p, impossible, n_cells = _pvalue(gen, _law(samp_kw))
    print(f"\n[{name}] p={p:.3g} rejection={rejection:.3f} cells={n_cells} (alpha per test {PER_TEST_ALPHA:.2g})")
    assert impossible == 0, f"{impossible} samples have target probability 0"
    # (A tree proposes 3 nodes and accepts at most 2: its rate is at least 1/3 by construction.)
    assert 0.1 < rejection < 0.95, f"rejection rate {rejection:.3f}: drafts should be both accepted and rejected"
    assert n_cells > 20
    assert p > PER_TEST_ALPHA, f"{name}: chi-square p={p:.3g} rejects exactness"


@pytest.mark.parametrize("name", list(D_NEGATIVE))
def test_head_sampling_negative_control_is_detected(name):
    """Broken drafters must fail the same test (p < the per-test alpha): a Medusa drafter that
    samples at T/2 but reports the T = 1 q, and a hybrid that reports the head's q for its
    prompt-lookup drafts (whose true q is one-hot): the test has power against a misreported q."""
    samp_kw = D_NEGATIVE[name][0]
    gen, rejection = _dist_run(name)
    p, _, n_cells = _pvalue(gen, _law(samp_kw))
    print(f"\n[{name}] p={p:.3g} rejection={rejection:.3f} cells={n_cells} (must be below alpha)")
    assert p < PER_TEST_ALPHA, f"negative control not detected (p={p:.3g})"


def test_distribution_target_is_peaked_and_prefix_dependent():
    """Guards the distribution tests: the target law is far from uniform, the filters cut
    many cells, and the next-token distribution depends on more than the current token (so a
    rollback that kept wrong history would change the law)."""
    law = _law(T1)
    assert law.max() > 20 / DV ** D_NEW
    filtered = _law(T1_FILTERED)
    assert (filtered == 0).sum() > 0.3 * len(filtered)
    model, tp, _ = _dist_setup()
    toks = np.random.default_rng(0).integers(0, DV, (64, 6)).astype(np.int32)
    toks[:, -1] = 2                                           # same current token, other prefixes
    p = np.asarray(jax.nn.softmax(_jit_apply(model)(tp, toks, None)[0][:, -1]))
    assert np.abs(p[:32] - p[32:]).sum(-1).mean() > 0.3
