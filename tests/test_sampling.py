"""Logits processing: greedy, temperature, top-k, top-p, sampling, and static/traced split."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specjax.sampling import SamplingConfig, argmax, categorical, log_probabilities, probabilities, sample


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Straightforward numpy reference for one row (float64)."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(z, bool)
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        keep &= z >= kth
    if top_p < 1.0:
        e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        pr = e / e.sum()
        order = np.argsort(-pr, kind="stable")
        before = np.cumsum(pr[order]) - pr[order]
        n_keep = max(1, int(np.sum(before < top_p)))
        keep &= pr >= pr[order][n_keep - 1]
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return e / e.sum()


def test_make_sets_static_flags():
    c = SamplingConfig.make()
    assert (c.greedy, c.use_top_k, c.use_top_p) == (False, False, False)
    c = SamplingConfig.make(temperature=0.7, top_k=5, top_p=0.9)
    assert (c.greedy, c.use_top_k, c.use_top_p) == (False, True, True)
    c = SamplingConfig.make(temperature=0.0, top_k=5, top_p=0.9)
    assert (c.greedy, c.use_top_k, c.use_top_p) == (True, False, False)
    assert SamplingConfig.greedy_config().greedy
    assert c.temperature.dtype == jnp.float32 and c.top_k.dtype == jnp.int32


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_make_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig.make(**kwargs)


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    probs = probabilities(logits, SamplingConfig.greedy_config())
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])
    assert probs.dtype == jnp.float32


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (0.8, 10, 1.0),
    (1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 5, 0.8), (1.0, 1, 1.0), (1.0, 0, 1e-6),
    (1.0, 100, 1.0)])
def test_matches_reference(temperature, top_k, top_p):
    logits = jax.random.normal(jax.random.key(0), (4, 2, 37)) * 3
    cfg = SamplingConfig.make(temperature, top_k, top_p)
    got = np.asarray(probabilities(logits, cfg))
    assert got.shape == logits.shape  # any leading batch shape
    for idx in np.ndindex(*logits.shape[:-1]):
        want = reference_probs(np.asarray(logits[idx]), temperature, top_k, top_p)
        np.testing.assert_allclose(got[idx], want, atol=1e-6)
        np.testing.assert_array_equal(got[idx] > 0, want > 0)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(
            np.asarray(log_probabilities(logits, cfg)), np.log(got), atol=1e-5)


def test_top_k_keeps_ties_at_threshold():
    logits = jnp.array([3.0, 2.0, 2.0, 1.0, 2.0])
    probs = probabilities(logits, SamplingConfig.make(top_k=2))
    np.testing.assert_array_equal(np.asarray(probs) > 0, [True, True, True, False, True])


def test_top_p_smallest_prefix_and_top_token_always_kept():
    probs0 = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(probs0))
    # 0.5 < 0.6 -> need the second token too (mass 0.8 reaches 0.6); the third is excluded.
    got = probabilities(logits, SamplingConfig.make(top_p=0.6))
    np.testing.assert_allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-6)
    got = probabilities(logits, SamplingConfig.make(top_p=0.01))
    np.testing.assert_allclose(got, [1, 0, 0, 0], atol=1e-6)
    got = probabilities(logits, SamplingConfig.make(top_p=0.5))  # exactly reached by token 0
    np.testing.assert_allclose(got, [1, 0, 0, 0], atol=1e-6)


def test_filters_traced_only_when_flags_on_and_never_sort():
    """The top-k / top-p thresholds come from a binary search (one loop per filter), never from
    a sort of the vocabulary (XLA:CPU's sort of 49k values cost ~10 ms per row)."""
    logits = jnp.zeros((2, 16))
    plain = str(jax.make_jaxpr(probabilities)(logits, SamplingConfig.make(temperature=0.7)))
    assert "sort" not in plain and "scan" not in plain
    topk = str(jax.make_jaxpr(probabilities)(logits, SamplingConfig.make(top_k=3)))
    topp = str(jax.make_jaxpr(probabilities)(logits, SamplingConfig.make(top_p=0.9)))
    both = str(jax.make_jaxpr(probabilities)(logits, SamplingConfig.make(top_k=3, top_p=0.9)))
    assert "sort" not in topk + topp + both
    assert (topk.count("scan["), topp.count("scan["), both.count("scan[")) == (1, 1, 2)


def _sorted_nucleus_margin(z, keep_k, top_p):
    """|mass before the boundary token - top_p| of the sorted definition, float64 (one row)."""
    e = np.where(keep_k, np.exp(z - z[keep_k].max()), 0.0)
    pr = np.sort(e / e.sum())[::-1]
    before = np.cumsum(pr) - pr
    return np.min(np.abs(before - top_p))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_search_thresholds_equal_the_sorted_definition_at_full_vocabulary(scale):
    """Kept sets of `probabilities` equal the sort-based numpy reference on SmolLM2-sized rows
    (V = 49,152), with repeated values (ties) and -inf entries mixed in. Rule: a row may differ
    only where the reference's mass before some token is within 1e-5 of top_p (float32 sums
    in another order); such rows are counted and must be rare."""
    rng = np.random.default_rng(int(scale * 10))
    V, rows = 49152, 12
    z = (rng.normal(size=(rows, V)) * scale).astype(np.float32)
    z[:, :64] = np.round(z[:, :64])                  # ties among high values
    z[:, 64:96] = -np.inf
    borderline = 0
    for temperature, top_k, top_p in [(1.0, 0, 0.9), (1.0, 0, 0.5), (0.7, 0, 0.99), (1.0, 50, 1.0),
                                      (1.0, 1, 1.0), (1.3, 1000, 0.95), (1.0, 3, 0.2), (1.0, 0, 1e-3)]:
        cfg = SamplingConfig.make(temperature=temperature, top_k=top_k, top_p=top_p)
        got = np.asarray(jax.jit(probabilities)(jnp.asarray(z), cfg)) > 0
        for r in range(rows):
            want = reference_probs(z[r], temperature, top_k, top_p) > 0
            if (got[r] != want).any():
                zz = np.asarray(z[r], np.float64) / temperature
                keep_k = np.ones(V, bool) if top_k == 0 else zz >= np.sort(zz)[::-1][top_k - 1]
                assert _sorted_nucleus_margin(zz, keep_k, top_p) < 1e-5, (temperature, top_k, top_p, r)
                borderline += 1
    assert borderline <= 2


def test_changing_values_does_not_recompile():
    chex.clear_trace_counter()
    fn = jax.jit(chex.assert_max_traces(probabilities, n=1))
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    outs = [fn(logits, SamplingConfig.make(t, k, p))
            for t, k, p in [(1.0, 5, 0.9), (0.3, 20, 0.5), (2.0, 1, 0.99), (0.9, 50, 0.1)]]
    assert not np.allclose(outs[0], outs[1])
    # Changing the *strategy* (a static flag) is a different program: it retraces.
    with pytest.raises(AssertionError):
        fn(logits, SamplingConfig.make(1.0, 0, 0.9))


def test_sample_never_emits_zero_probability_tokens():
    probs = jnp.array([[0.0, 0.5, 0.0, 0.5], [1e-30, 0.0, 0.0, 1.0 - 1e-30],
                       [0.0, 0.0, 1.0, 0.0]])
    toks = np.asarray(sample(jax.random.key(0), jnp.broadcast_to(probs, (20000, 3, 4))))
    assert toks.dtype == np.int32 and toks.shape == (20000, 3)
    assert set(np.unique(toks[:, 0])) <= {1, 3}
    assert set(np.unique(toks[:, 1])) <= {0, 3}
    assert (toks[:, 2] == 2).all()


def test_sample_frequencies_match_probs():
    probs = jnp.array([0.1, 0.2, 0.3, 0.4, 0.0])
    toks = np.asarray(sample(jax.random.key(5), jnp.broadcast_to(probs, (50000, 5))))
    counts = np.bincount(toks, minlength=5)
    assert counts[4] == 0
    pvalue = scipy.stats.chisquare(counts[:4], 50000 * np.array([0.1, 0.2, 0.3, 0.4])).pvalue
    assert pvalue > 1e-4


def _argmax_cases():
    """Float rows that probe every rule of ``jnp.argmax``: ties (first index), NaN (first NaN
    wins over any number, +inf included), all -inf, +inf, signed zeros, subnormals, a
    49,152-wide vocabulary row and several leading dims."""
    rng = np.random.default_rng(0)
    inf, nan = np.inf, np.nan
    small = [[1.0, 3.0, 3.0, 2.0], [3.0, 1.0, 3.0, 3.0], [-inf, -inf, -inf, -inf], [0.0, inf, 1.0, inf],
             [1.0, nan, 3.0, nan], [inf, 2.0, nan, inf], [nan, nan, nan, nan], [-0.0, 0.0, -0.0, 0.0],
             [0.0, -0.0, 0.0, -0.0], [1e-45, 0.0, 2e-45, 2e-45], [-1.0, -2.0, -1.0, -3.0], [-inf, nan, inf, 0.0]]
    wide = rng.standard_normal((3, 49152)).astype(np.float32)
    wide[1, [7, 40000]] = wide[1].max() + 1.0            # a tie far apart
    wide[2, 12345] = np.nan
    batched = rng.integers(-3, 3, size=(2, 5, 17)).astype(np.float32)   # many ties
    return [np.asarray(small, np.float32), wide, batched, batched.astype(jnp.bfloat16)]


@pytest.mark.parametrize("case", range(4))
def test_argmax_is_jnp_argmax_bit_for_bit(case):
    x = jnp.asarray(_argmax_cases()[case])
    want = jnp.argmax(x, axis=-1)
    for got in (argmax(x), jax.jit(argmax)(x)):
        assert got.dtype == jnp.int32 and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_argmax_of_integers_and_booleans_is_jnp_argmax():
    b = jnp.asarray([[False, True, True], [False, False, False]])
    np.testing.assert_array_equal(np.asarray(argmax(b)), [1, 0])
    i = jnp.asarray([[3, 7, 7, -1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(argmax(i)), [1])


@pytest.mark.parametrize("shape", [(5,), (4, 49152), (2, 3, 64)])
def test_categorical_is_jax_random_categorical_bit_for_bit(shape):
    """Same key, same token: the sampler swaps only the argmax (the Gumbel noise is jax's), so
    every seeded run of specjax draws exactly what it drew with ``jax.random.categorical``.
    Log-probabilities with -inf entries included (top-k/top-p zeros)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(shape).astype(np.float32)
    logits[..., ::3] = -np.inf
    logits = jnp.asarray(logits)
    for seed in range(20):
        key = jax.random.key(seed)
        want = jax.random.categorical(key, logits, axis=-1)
        got = jax.jit(categorical)(key, logits)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert not np.isin(np.asarray(got), np.arange(0, shape[-1], 3)).any()

