"""Repetition, presence and frequency penalties, exact under speculation (`specjax.sampling`,
"Penalties").

* `probabilities` with penalties against a NumPy transcription of the definitions (per-row and
  scalar configs, a support of token ids, greedy rows);
* the token history: `with_history`, `advance` and `at_block` (`at_paths`) against counting by
  hand, for a chain and a tree;
* end to end on the tabular toy pair (`_toy.TabularModel`, V = 3, prompt (2, 1), N = 6 new
  tokens): the exact law of the 6-token continuation under penalized target-only sampling is
  enumerated (729 sequences, each position's distribution from the NumPy penalties at its own
  history); GROUP = 8 000 rows per setting, five settings (each penalty alone, a negative
  presence penalty with min-p, and a mix of every control), through a chain (gamma 3) and a
  static token tree ((2, 2), i.i.d. children, traversal verifier): 10 chi-square tests (cells
  below 5 expected pooled), family-wise false-alarm rate 1e-4, Bonferroni, so 1e-5 per test;
  fixed seeds, a deterministic outcome. Power: the repetition group against the unpenalized
  law is rejected;
* greedy rows with penalties equal a NumPy greedy decode with the same penalties, token for
  token, for a chain, a static and a dynamic tree and target-only;
* the draft applies the same transform on its own path: with the draft equal to the target
  every proposal of a chain and the first child at every depth of an i.i.d. tree is accepted
  (q = p at every position, up to float rounding; 64 rows x 12 tokens, the greedy test's prompts);
  a control drafter that drops the penalties loses acceptance;
* feature heads (Medusa, a reduced-vocabulary EAGLE-3 head): greedy rows with penalties commit
  what target-only decoding commits.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, sampling, trees

from _tabular import continuation_pvalue, memoised_by_settings
from _toy import StrippedConfigDrafter, TabularModel, random_table

V = 3
N_NEW = 6
GROUP = 8_000
PROMPT = (2, 1)
GROUPS = (dict(repetition_penalty=1.6), dict(presence_penalty=0.9), dict(frequency_penalty=0.7),
          dict(presence_penalty=-1.0, min_p=0.1),
          dict(temperature=0.8, top_p=0.9, logit_bias={0: -0.5}, repetition_penalty=1.2, presence_penalty=0.3,
               frequency_penalty=0.4))
SPECULATION = {"chain": 3, "tree": trees.TreeShape.from_branching((2, 2))}
FAMILY_WISE_ALPHA = 1e-4
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / (len(GROUPS) * len(SPECULATION))


def _settings(kw: dict) -> dict:
    return dict(temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0),
                min_p=kw.get("min_p", 0.0), logit_bias=kw.get("logit_bias"),
                repetition_penalty=kw.get("repetition_penalty", 1.0),
                presence_penalty=kw.get("presence_penalty", 0.0), frequency_penalty=kw.get("frequency_penalty", 0.0))


def _rows(settings: list[dict]) -> sampling.SamplingConfig:
    cols = {k: [s[k] for s in settings] for k in settings[0]}
    return sampling.SamplingConfig.rows(**cols)


def _penalize_np(logits, prompt, generated, s: dict):
    """The definitions: bias, then repetition (prompt and generated), frequency and presence
    (generated only), in float64."""
    x = np.asarray(logits, np.float64).copy()
    for t, v in (s["logit_bias"] or {}).items():
        x[..., t] += v
    counts = np.bincount(np.asarray(generated, int), minlength=x.shape[-1]).astype(np.float64)
    seen = np.zeros(x.shape[-1], bool)
    seen[list(prompt)] = True
    hit = seen | (counts > 0)
    r = s["repetition_penalty"]
    x = np.where(hit, np.where(x > 0, x / r, x * r), x)
    return x - s["frequency_penalty"] * counts - s["presence_penalty"] * (counts > 0)


def _filters_only(s: dict) -> sampling.SamplingConfig:
    """The row's temperature and filters, without bias or penalties (applied by `_penalize_np`)."""
    return sampling.SamplingConfig.rows([s["temperature"]], [s["top_k"]], [s["top_p"]], [s["min_p"]])


# ----------------------------------------------------------------------------- the transform

@functools.partial(jax.jit, static_argnames="vocab")
def _transforms(cfg, scalar, filters, tokens_BS, prompt_lengths_B, lengths_B, logits_BV, penalized_BV, ids, vocab):
    """Everything `test_probabilities_with_penalties_match_the_definitions` compares, in one
    compiled program (op by op, each operation of each shape compiled on its own)."""
    h = cfg.with_history(tokens_BS, prompt_lengths_B, lengths_B, vocab)
    hs = scalar.with_history(tokens_BS[:1], prompt_lengths_B[:1], lengths_B[:1], vocab)
    return dict(got=sampling.probabilities(logits_BV, h), want=sampling.probabilities(penalized_BV, filters),
                scalar=sampling.probabilities(logits_BV[:1], hs),
                sub=sampling.probabilities(logits_BV[:, ids], h, ids),
                full=sampling.adjusted_logits(logits_BV, h)[:, ids],
                sub_adjusted=sampling.adjusted_logits(logits_BV[:, ids], h, ids))


def test_probabilities_with_penalties_match_the_definitions():
    """Per-row penalties (and a bias, filters, a greedy row) against `_penalize_np` then each row's
    temperature and filters alone; a scalar config (`make`) with row 0's penalties; over a support
    of token ids, the support's entries of the full-vocabulary result."""
    rng = np.random.default_rng(0)
    B, Vb = 4, 11
    logits = rng.normal(size=(B, Vb)).astype(np.float32) * 3
    prompts = [[1, 2, 2], [0], [5, 6, 7, 8], [3]]
    generated = [[2, 4, 4, 4], [], [9, 9, 1], [3, 3]]
    settings = [_settings(dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)),
                _settings(dict(temperature=0.0, repetition_penalty=0.5)),
                _settings(dict(temperature=0.7, top_k=4, presence_penalty=-1.5, logit_bias={9: 2.0})),
                _settings(dict(temperature=1.3, frequency_penalty=2.0, top_p=0.8))]
    S = 12
    tokens = np.zeros((B, S), np.int32)
    for b, (p, g) in enumerate(zip(prompts, generated)):
        tokens[b, :len(p) + len(g)] = p + g
    penalized = np.stack([_penalize_np(logits[b], prompts[b], generated[b], settings[b]) for b in range(B)])
    # each row's temperature and filters without bias or penalties (`_filters_only`, the rows at once)
    filters = sampling.SamplingConfig.rows(*([s[k] for s in settings] for k in ("temperature", "top_k", "top_p",
                                                                                 "min_p")))
    # a scalar config (`make`) with the same penalties as row 0
    scalar = sampling.SamplingConfig.make(1.0, repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
    ids = jnp.asarray([1, 2, 4, 9], jnp.int32)
    out = jax.device_get(_transforms(_rows(settings), scalar, filters, jnp.asarray(tokens),
                                     jnp.asarray([len(p) for p in prompts]),
                                     jnp.asarray([len(p) + len(g) for p, g in zip(prompts, generated)]),
                                     jnp.asarray(logits), jnp.asarray(penalized.astype(np.float32)), ids, vocab=Vb))
    got = out["got"]
    for b in range(B):
        np.testing.assert_allclose(got[b], out["want"][b], atol=2e-6, err_msg=f"row {b}")
    assert got[1].tolist() == np.eye(Vb)[np.argmax(_penalize_np(logits[1], prompts[1], [], settings[1]))].tolist()
    np.testing.assert_allclose(out["scalar"][0], got[0], atol=1e-6)
    # over a support of token ids: the support's entries of the full-vocabulary result
    np.testing.assert_allclose(out["sub_adjusted"], out["full"], atol=1e-6)
    assert out["sub"].shape == (B, 4) and np.allclose(out["sub"].sum(-1), 1.0, atol=1e-5)


def test_a_config_without_penalties_is_unchanged():
    cfg = sampling.SamplingConfig.rows([1.0, 0.5])
    assert not cfg.penalized and cfg.with_history(jnp.zeros((2, 4), jnp.int32), jnp.ones(2, jnp.int32),
                                                  jnp.ones(2, jnp.int32), 5) is cfg
    assert not sampling.SamplingConfig.make(0.7, repetition_penalty=1.0).penalized
    assert sampling.SamplingConfig.make(0.7, frequency_penalty=0.1).penalized


@functools.partial(jax.jit, static_argnames="vocab")
def _histories(cfg, tokens_BS, prompt_lengths_B, lengths_B, drafted_BX, nodes_BN, parents_BN, vocab):
    """`with_history`, `advance` and `at_block` (chain and tree) of one config, in one compiled
    program (op by op, each operation of each shape compiled on its own)."""
    h = cfg.with_history(tokens_BS, prompt_lengths_B, lengths_B, vocab)
    step = h.advance(jnp.asarray([5, 0]), jnp.asarray([True, False]))
    return dict(counts=h.counts, seen=h.seen, step=step.counts, chain=h.at_block(drafted_BX).counts,
                tree=h.at_block(nodes_BN, parents_BN).counts)


def test_history_along_a_chain_and_a_tree():
    B, S, Vb = 2, 10, 6
    tokens = jnp.asarray([[1, 2, 3, 3, 5, 0, 0, 0, 0, 0], [4, 4, 1, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
    cfg = _rows([_settings(dict(presence_penalty=0.1))] * B)
    drafted = jnp.asarray([[0, 0, 3], [2, 5, 2]], jnp.int32)
    # a tree: node 0 and 1 children of the root, node 2 child of node 0, node 3 child of node 2
    parents = jnp.asarray([[-1, -1, 0, 2]] * B, jnp.int32)
    nodes = jnp.asarray([[1, 3, 3, 5], [0, 2, 2, 2]], jnp.int32)
    h = jax.device_get(_histories(cfg, tokens, jnp.asarray([2, 1]), jnp.asarray([5, 3]), drafted, nodes, parents,
                                  vocab=Vb))
    assert h["counts"].tolist() == [[0, 0, 0, 2, 0, 1], [0, 1, 0, 0, 1, 0]]
    assert h["seen"].tolist() == [[False, True, True, False, False, False],
                                  [False, False, False, False, True, False]]
    assert h["step"].tolist() == [[0, 0, 0, 2, 0, 2], [0, 1, 0, 0, 1, 0]]          # `advance` by [5, 0]
    chain = h["chain"]                                                                # [B, 4, V]
    for b in range(B):
        for t in range(4):
            want = h["counts"][b] + np.bincount(np.asarray(drafted[b, :t]), minlength=Vb)
            assert chain[b, t].tolist() == want.tolist(), (b, t)
    tree = h["tree"]
    paths = {0: [], 1: [0], 2: [1], 3: [0, 2], 4: [0, 2, 3]}          # block row -> nodes on its path
    for b in range(B):
        for t, path in paths.items():
            want = h["counts"][b] + np.bincount(np.asarray(nodes[b])[path].astype(int), minlength=Vb)
            assert tree[b, t].tolist() == want.tolist(), (b, t)


def test_penalties_are_checked_by_name():
    for kw, match in ((dict(repetition_penalty=[-1.0]), "repetition_penalty must be a number in"),
                      (dict(repetition_penalty=[0.0]), "repetition_penalty"),
                      (dict(presence_penalty=[2.5]), "presence_penalty must be a number in \\[-2, 2\\]"),
                      (dict(frequency_penalty=[float("nan")]), "frequency_penalty"),
                      (dict(frequency_penalty=[True]), "frequency_penalty")):
        with pytest.raises(ValueError, match="row 0: " + match):
            sampling.SamplingConfig.rows([1.0], **kw)
    with pytest.raises(ValueError, match="presence_penalty"):
        sampling.SamplingConfig.make(1.0, presence_penalty=-3)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tables():
    target = random_table(jax.random.key(10), V, peak=2.0)
    return target, target + random_table(jax.random.key(11), V, peak=1.0)


def _engine(gamma, drafter=None, max_new=N_NEW, children="iid"):
    config = decoding.GenerationConfig(max_new_tokens=max_new, gamma=gamma, tree_children=children,
                                       tree_verifier="traversal")
    if gamma == 0:
        return decoding.Engine(TabularModel(V), None, config)
    return decoding.Engine(TabularModel(V), drafter or drafters.ModelDrafter(TabularModel(V)), config)


def _generate(engine, params, cfg, prompts, seed=2024):
    batch = decoding.make_batch(prompts, engine.config, jax.random.key(seed))
    out = engine.run(params, cfg, batch)
    assert (np.asarray(out.status_B) == decoding.MAX_TOKENS).all()
    return out


_PROBS = jax.jit(sampling.probabilities)      # one compiled program for every law below


def _exact_law(target, s: dict) -> np.ndarray:
    """P(continuation) of every 6-token sequence (base-V index, first token most significant)
    under target-only sampling with the penalties of ``s``."""
    table = np.asarray(target)
    seqs = list(itertools.product(range(V), repeat=N_NEW))
    rows = []
    for seq in seqs:
        full = list(PROMPT) + list(seq)
        for i in range(len(PROMPT), len(full)):
            rows.append(_penalize_np(table[full[i - 2], full[i - 1]], PROMPT, full[len(PROMPT):i], s))
    probs = np.asarray(_PROBS(jnp.asarray(np.stack(rows), jnp.float32)[None], _filters_only(s)))[0]
    law = np.ones(len(seqs))
    for j, seq in enumerate(seqs):
        for i, y in enumerate(seq):
            law[j] *= probs[j * N_NEW + i, y]
    return law


@pytest.fixture(scope="module")
def exact_law(tables):
    """`_exact_law` on the target table, memoised per group: a group's law serves its chain and
    its tree test (and the repetition group's the negative control's)."""
    return memoised_by_settings(lambda s: _exact_law(tables[0], s))


@pytest.fixture(scope="module")
def generated(tables):
    """For each speculation kind, the groups' GROUP rows each, interleaved (row i in group
    i % len(GROUPS)) -> [rows, N_NEW]."""
    out = {}
    params = decoding.EngineParams(target=tables[0], draft=tables[1])
    settings = [_settings(GROUPS[i % len(GROUPS)]) for i in range(len(GROUPS) * GROUP)]
    for name, gamma in SPECULATION.items():
        res = _generate(_engine(gamma), params, _rows(settings), [list(PROMPT)] * len(settings))
        out[name] = np.asarray(res.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]
    return out


def _pvalue(law, gen_BN):
    return continuation_pvalue(law, gen_BN, V)


@pytest.mark.parametrize("kind", list(SPECULATION))
@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_each_penalized_group_follows_its_own_law(exact_law, generated, kind, group):
    gen = generated[kind][group::len(GROUPS)]
    p, impossible, cells = _pvalue(exact_law(_settings(GROUPS[group])), gen)
    print(f"\n[{kind} {GROUPS[group]}] p={p:.3g} (alpha per test {PER_TEST_ALPHA:.2g}) cells={cells}")
    assert impossible == 0 and cells > 20
    assert p > PER_TEST_ALPHA, f"{kind} {GROUPS[group]}: chi-square p={p:.3g} rejects exactness"


def test_the_test_tells_a_penalty_apart(exact_law, generated):
    """Power: the repetition group's tokens against the unpenalized law are rejected."""
    p, _, _ = _pvalue(exact_law(_settings({})), generated["chain"][0::len(GROUPS)])
    assert p < PER_TEST_ALPHA


def test_a_block_scored_without_its_path_is_detected(tables, exact_law, monkeypatch):
    """Negative control: a round that scores every block position at the committed history
    (the drafted tokens before a position left out of its penalties) fails the same test."""
    monkeypatch.setattr(sampling.SamplingConfig, "at_block", lambda self, tokens_BX, parents_BX=None: self)
    rows = GROUP + 1            # a shape of its own: the broken round is traced, not a cached program
    params = decoding.EngineParams(target=tables[0], draft=tables[1])
    res = _generate(_engine(3), params, _rows([_settings(GROUPS[0])] * rows), [list(PROMPT)] * rows)
    gen = np.asarray(res.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]
    p, _, _ = _pvalue(exact_law(_settings(GROUPS[0])), gen)
    assert p < PER_TEST_ALPHA, p


GREEDY = (dict(temperature=0.0, repetition_penalty=1.8), dict(temperature=0.0, frequency_penalty=1.1),
          dict(temperature=0.0, presence_penalty=0.9, repetition_penalty=1.3, logit_bias={2: 0.4}))
GREEDY_PROMPTS = ([2, 1], [0, 1, 2, 2], [1])
# The rows of the greedy and the draft tests: one batch shape (64 rows, GREEDY_PROMPTS in turn), so a
# chain's and a static tree's program serve both tests.
ROWS = 64
ROW_PROMPTS = [list(GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)]) for i in range(ROWS)]


def _greedy_np(target, prompt, s, n):
    table = np.asarray(target)
    full = list(prompt)
    for _ in range(n):
        prev = full[-2] if len(full) >= 2 else 0
        x = _penalize_np(table[prev, full[-1]], prompt, full[len(prompt):], s)
        full.append(int(np.argmax(x)))
    return full[len(prompt):]


@pytest.mark.parametrize("gamma", [0, 3, trees.TreeShape.from_branching((2, 2)),
                                   trees.DynamicTree(depth=3, topk=2, node_budget=5)],
                         ids=["target-only", "chain", "tree", "dynamic-tree"])
def test_greedy_rows_with_penalties_equal_the_penalized_greedy_decode(tables, gamma):
    """Every greedy setting with every prompt (rows in turn over the ROWS rows)."""
    n = 12
    combos = [(s, p) for s in GREEDY for p in GREEDY_PROMPTS]        # each prompt with each setting
    settings = [_settings(combos[i % len(combos)][0]) for i in range(ROWS)]
    prompts = [list(combos[i % len(combos)][1]) for i in range(ROWS)]
    engine = _engine(gamma, max_new=n)
    out = _generate(engine, decoding.EngineParams(target=tables[0], draft=tables[1]), _rows(settings), prompts)
    got = out.generated()
    want = [_greedy_np(tables[0], p, _settings(s), n) for s, p in combos]
    for i in range(ROWS):
        assert got[i] == want[i % len(combos)], (i, settings[i], prompts[i])
    plain = [_greedy_np(tables[0], p, _settings(dict(temperature=0.0)), n) for p in prompts]
    assert got != plain, "the penalties changed no greedy continuation: the test would not see them ignored"


@pytest.mark.parametrize("gamma", [3, trees.TreeShape.from_branching((2, 2))], ids=["chain", "tree"])
def test_the_draft_applies_the_same_penalties_on_its_path(tables, gamma):
    rows, n = ROWS, 12
    settings = [_settings(dict(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.8))] * rows
    params = decoding.EngineParams(target=tables[0], draft=tables[0])
    depth = gamma if isinstance(gamma, int) else gamma.max_depth
    same = _generate(_engine(gamma, max_new=n), params, _rows(settings), ROW_PROMPTS).metrics.summary()
    assert same["accepted"] == depth * same["target_passes"], same
    inner = drafters.ModelDrafter(TabularModel(V))
    control = _generate(_engine(gamma, drafter=StrippedConfigDrafter(inner, ("repetition", "presence", "frequency", "counts", "seen")), max_new=n), params, _rows(settings),
                        ROW_PROMPTS).metrics.summary()
    assert control["accepted"] < 0.9 * depth * control["target_passes"], control


@pytest.mark.parametrize("kind,gamma", [("medusa", 3), ("eagle3_reduced", 3)],
                         ids=["medusa", "eagle3-reduced-chain"])
def test_heads_with_penalties_keep_greedy_rows_target_only(kind, gamma):
    """Feature heads (Medusa: one draw per head, each seeing the earlier heads' tokens; an
    EAGLE-3 head over a reduced vocabulary) on the tiny Llama of `_heads_common`: greedy rows
    with penalties commit what target-only decoding with the same rows commits. Both on the
    stacked (`lax.scan`) layout, so the two cases' target-only run is one compiled program."""
    from _heads_common import PROMPTS, _gen, _head, _target
    model, tp = _target(True)
    dr, hp = _head(kind, "good" if kind != "medusa" else "random", True)
    settings = [_settings(dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.02, presence_penalty=0.01))
                ] * len(PROMPTS)
    outs = []
    for g in (0, gamma):
        eng = decoding.Engine(model, dr if g else None, _gen(g))
        batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
        outs.append(eng.run(decoding.EngineParams(target=tp, draft=hp if g else None), _rows(settings), batch))
    assert outs[1].generated() == outs[0].generated()
    assert outs[1].metrics.summary()["accepted"] > 0
