"""Per-row sampling settings in one batch (`SamplingConfig.rows`): each row decodes with its own
temperature, top-k, top-p, min-p and logit bias, in one compiled program for every mix.

* `probabilities` of a per-row config equals, bit for bit, the scalar config of each row's own
  settings (greedy rows included), at any leading shape;
* one trace serves every mix of the same batch size;
* end to end on the tabular toy pair (`_toy.TabularModel`, V = 3, gamma = 3, token verifier):
  B = 70 000 rows in seven groups of 10 000 with different settings (min-p, a logit bias and a
  mix of every control among them), N = 6 new tokens each; each group's empirical law of the
  6-token continuation (729 cells, pooled below 5 expected) against the exact target law under
  its own settings, by chi-square. Family: the 7 groups, family-wise false-alarm rate 1e-4, so
  1.4e-5 per test (Bonferroni); fixed seeds, a deterministic outcome.
  Power: the top-k group against the temperature-1 group's law must be rejected. Greedy rows
  (an eighth group) equal the target's greedy continuation (the table's argmax chain) on every token;
* a row of the mixed batch above (one of each group and a greedy one) commits the tokens it
  commits decoded alone with its own settings and key (a fixed gamma; the tabular models compute
  each row on its own).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, sampling

from _tabular import support_chisquare
from _toy import TabularModel, random_table, sequence_probs

V = 3
N_NEW = 6
GROUP = 10_000
PROMPT = (2, 1)
GROUPS = (dict(temperature=1.0), dict(temperature=0.7, top_k=2), dict(temperature=0.7, top_p=0.8),
          dict(temperature=1.3), dict(temperature=1.0, min_p=0.3), dict(temperature=1.0, logit_bias={1: 1.5}),
          dict(temperature=0.8, top_p=0.9, min_p=0.1, logit_bias={0: -1.0, 2: 0.5}))
FAMILY_WISE_ALPHA = 1e-4
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / len(GROUPS)


def _row(kw: dict) -> tuple:
    return kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0), kw.get("logit_bias")


def _rows(settings) -> sampling.SamplingConfig:
    """`SamplingConfig.rows` of (T, k, p[, min_p, logit bias]) per row."""
    settings = [tuple(r) + (0.0, None)[len(r) - 3:] for r in settings]
    return sampling.SamplingConfig.rows(*zip(*settings))


@pytest.mark.parametrize("shape", [(5, 17), (5, 3, 17)])
def test_rows_equal_each_rows_own_config(shape):
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.5, 3, 0.6)]
    cfg = sampling.SamplingConfig.rows(*zip(*settings))
    logits = jax.random.normal(jax.random.key(0), shape) * 3.0
    got = jax.jit(sampling.probabilities)(logits, cfg)
    got_log = jax.jit(sampling.log_probabilities)(logits, cfg)
    for i, (t, k, p) in enumerate(settings):
        own = sampling.SamplingConfig.make(t, k, p)
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(sampling.probabilities(logits[i], own)))
        np.testing.assert_array_equal(np.asarray(got_log[i]), np.asarray(sampling.log_probabilities(logits[i], own)))


def test_a_per_row_config_needs_the_batch_first():
    cfg = sampling.SamplingConfig.rows([1.0, 0.5, 0.0])
    logits = jax.random.normal(jax.random.key(3), (3, 6))
    with pytest.raises(ValueError, match="the batch must be the logits' leading axis"):
        jax.vmap(lambda x: sampling.probabilities(x, cfg))(logits)


def test_one_trace_serves_every_mix():
    traces = []

    @jax.jit
    def probs(logits, cfg):
        traces.append(1)
        return sampling.probabilities(logits, cfg)

    logits = jax.random.normal(jax.random.key(1), (3, 11))
    for mix in ([0.0, 0.0, 0.0], [1.0, 0.5, 0.0], [2.0, 1.0, 1.0]):
        for top_k in ([0, 0, 0], [2, 0, 5]):
            probs(logits, sampling.SamplingConfig.rows(mix, top_k, [1.0, 0.9, 1.0]))
    assert len(traces) == 1


def test_min_p_and_logit_bias_against_numpy():
    """min-p keeps p(x) >= min_p max p of the temperature-scaled law; the bias adds to the logits
    first; over a support (a reduced-vocabulary draft) the bias lands on the support's token ids."""
    logits = 2.0 * np.random.default_rng(2).standard_normal((3, 4, 12)).astype(np.float32).astype(np.float64)
    rows = [(0.7, 0, 1.0, 0.25, {3: 4.0, 11: -1.0}), (1.2, 0, 1.0, 0.0, {5: 100.0}), (0.0, 0, 1.0, 0.0, {2: 50.0})]
    cfg = _rows(rows)
    ids = np.asarray([1, 3, 4, 8, 11])
    full = np.full(logits.shape, -np.inf)
    full[:, :, ids] = logits[:, :, ids]
    # one program: the config on the logits, on a support's columns, and on the logits masked to it
    got, on_support, masked = jax.device_get(jax.jit(lambda x, sub, full, cfg, ids: (
        sampling.probabilities(x, cfg), sampling.probabilities(sub, cfg, ids), sampling.probabilities(full, cfg)))(
        jnp.asarray(logits, jnp.float32), jnp.asarray(logits[:, :, ids], jnp.float32), jnp.asarray(full, jnp.float32),
        cfg, jnp.asarray(ids)))
    for i, (t, _, _, min_p, bias) in enumerate(rows):
        x = logits[i].copy()
        for tok, v in bias.items():
            x[..., tok] += v
        if t == 0:
            want = np.eye(12)[np.argmax(x, axis=-1)]
        else:
            p = np.exp((x - x.max(-1, keepdims=True)) / t)
            p /= p.sum(-1, keepdims=True)
            p = np.where(p >= min_p * p.max(-1, keepdims=True), p, 0.0)
            want = p / p.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(on_support, masked[:, :, ids], rtol=1e-6, atol=1e-7)


def test_rows_refuse_bad_values_naming_the_row():
    with pytest.raises(ValueError, match="row 1: temperature"):
        sampling.SamplingConfig.rows([1.0, -0.5])
    with pytest.raises(ValueError, match="row 0: top_k"):
        sampling.SamplingConfig.rows([1.0], [1.5], [1.0])
    with pytest.raises(ValueError, match="row 2: top_p"):
        sampling.SamplingConfig.rows([1.0] * 3, [0] * 3, [1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="one temperature, top_k, top_p, min_p, logit_bias and penalty per row"):
        sampling.SamplingConfig.rows([1.0, 1.0], [0], [1.0, 1.0])
    with pytest.raises(ValueError, match="row 1: min_p must be in"):
        sampling.SamplingConfig.rows([1.0, 1.0], None, None, [0.0, 1.5])
    with pytest.raises(ValueError, match=r"row 0: logit_bias\[5\] must be a number in \[-100, 100\]"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[{5: 101}])
    with pytest.raises(ValueError, match="row 0: logit_bias: 'x' is not a token id"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[{"x": 1}])
    with pytest.raises(ValueError, match="row 0: logit_bias: ' 1' is not a token id"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[{"1": 100, " 1": 100}])
    with pytest.raises(ValueError, match="row 0: logit_bias must be a dict"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[[]])
    with pytest.raises(ValueError, match=r"row 0: logit_bias\['1'\] must be a number"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[{"1": 10 ** 400}])
    with pytest.raises(ValueError, match="row 0: top_k must be an integer"):
        sampling.SamplingConfig.rows([1.0], [float("nan")])
    with pytest.raises(ValueError, match="row 0: logit_bias: 65 entries, at most 64"):
        sampling.SamplingConfig.rows([1.0], logit_bias=[{i: 1.0 for i in range(65)}])


@pytest.fixture(scope="module")
def tables():
    target = random_table(jax.random.key(10), V, peak=2.0)
    return target, target + random_table(jax.random.key(11), V, peak=1.0)


def _engine(gamma: int):
    config = decoding.GenerationConfig(max_new_tokens=N_NEW, gamma=gamma)
    return decoding.Engine(TabularModel(V), drafters.ModelDrafter(TabularModel(V)) if gamma else None, config), config


def _generate(tables, settings, gamma=3, request_ids=None):
    """[B, N_NEW] tokens of rows with ``settings`` (one (T, k, p) per row) in one batch."""
    engine, config = _engine(gamma)
    ids = list(range(len(settings))) if request_ids is None else request_ids
    batch = decoding.make_batch([list(PROMPT)] * len(settings), config, jax.random.key(2024), request_ids=ids)
    out = engine.run(decoding.EngineParams(target=tables[0], draft=tables[1] if gamma else None), _rows(settings),
                     batch)
    assert (np.asarray(out.status_B) == decoding.MAX_TOKENS).all()
    return np.asarray(out.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]


def _mixed_settings():
    """The groups' GROUP rows each, interleaved (row i in group i % len(GROUPS)), then GROUP // 10
    greedy rows."""
    return [_row(GROUPS[i % len(GROUPS)]) for i in range(len(GROUPS) * GROUP)] + \
        [(0.0, 0, 1.0, 0.0, None)] * (GROUP // 10)


@pytest.fixture(scope="module")
def mixed(tables):
    """[B, N_NEW] tokens of the `_mixed_settings` rows in one batch (request id = row)."""
    return _generate(tables, _mixed_settings())


@jax.jit
def _table_probs(table_VVV, cfg):
    """The next-token law of every (prev, cur) pair under a one-row config: the table's [V, V, V]
    as [1, V * V, V] (one program for every group's settings: `rows` configs of one row share it)."""
    return sampling.probabilities(table_VVV.reshape(1, -1, V), cfg).reshape(table_VVV.shape)


def _pvalue(tables, gen_BN, kw):
    cfg = _rows([_row(kw)])
    exact = sequence_probs(tables[0], PROMPT, N_NEW, lambda t: _table_probs(t, cfg))
    cells = list(itertools.product(range(V), repeat=N_NEW))
    probs = np.array([exact[c] for c in cells], np.float64)
    index = gen_BN @ (V ** np.arange(N_NEW - 1, -1, -1))
    return support_chisquare(np.bincount(index, minlength=len(cells)), probs / probs.sum())


@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_each_group_follows_its_own_law(tables, mixed, group):
    gen = mixed[:len(GROUPS) * GROUP][group::len(GROUPS)]
    p, impossible, cells = _pvalue(tables, gen, GROUPS[group])
    print(f"\n[{GROUPS[group]}] p={p:.3g} (alpha per test {PER_TEST_ALPHA:.2g}) cells={cells}")
    assert impossible == 0 and cells > 20
    assert p > PER_TEST_ALPHA, f"group {GROUPS[group]}: chi-square p={p:.3g} rejects exactness"


def test_a_group_is_not_the_other_groups_law(tables, mixed):
    """Power: the top-k group's tokens against the temperature-1 law are rejected."""
    gen = mixed[:len(GROUPS) * GROUP][1::len(GROUPS)]
    p, _, _ = _pvalue(tables, gen, GROUPS[0])
    assert p < PER_TEST_ALPHA


def test_greedy_rows_are_the_greedy_continuation(tables, mixed):
    """Greedy rows of the mixed batch against the target's greedy continuation (the argmax of the
    table's logits at each (previous, current) pair, on the host)."""
    table = np.asarray(tables[0])
    seq = list(PROMPT)
    for _ in range(N_NEW):
        seq.append(int(np.argmax(table[seq[-2], seq[-1]])))
    assert (mixed[len(GROUPS) * GROUP:] == np.asarray(seq[len(PROMPT):])).all()


def test_a_row_commits_what_it_commits_alone(tables, mixed):
    """Rows of the mixed batch (one of each group, and a greedy one) against the same row decoded
    alone: its own settings and request id (so its own key), a one-row batch."""
    settings = _mixed_settings()
    for i in list(range(len(GROUPS))) + [len(GROUPS) * GROUP + 3]:
        alone = _generate(tables, [settings[i]], request_ids=[i])
        np.testing.assert_array_equal(mixed[i], alone[0], err_msg=f"row {i}: {settings[i]}")
