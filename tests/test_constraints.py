"""Structured output (`specjax.constraints`): token automata, and decoding under them exactly.

* compilation against brute force: for five patterns over a small vocabulary of multi-character
  tokens (with a special token and a stop token), along 200 random allowed token paths each, the
  automaton allows exactly the tokens after which some continuation of at most 4 tokens fully
  matches (`re.fullmatch`), and `matches` agrees with `re.fullmatch`;
* a JSON schema on the SmolLM2 vocabulary: a valid text matches, a wrong one does not; schemas
  and patterns it cannot take are refused by name; `stack` places rows' automata in one table;
* end to end on the tabular toy pair (`_toy.TabularModel`, V = 3 tokens spelling "a", "b", "c",
  prompt (2, 1), N = 6 new tokens), rows of different constraints stacked in one batch: the exact
  law of the 6-token continuation under the constrained target (each position's distribution
  masked by a hand-written automaton of the pattern) is enumerated; GROUP = 8 000 rows per
  setting, five settings (two patterns, one with top-p at T 0.8, one with penalties and a logit
  bias, and unconstrained rows in the same batch), through a chain (gamma 3) and a static token
  tree ((2, 2), i.i.d. children, traversal verifier): 10 chi-square tests (cells below 5 expected
  pooled), family-wise false-alarm rate 1e-4, Bonferroni, so 1e-5 per test; fixed seeds. Every
  constrained row's tokens match its pattern's prefix language. Power: a pattern's rows against
  the unconstrained law are rejected;
* one verification round by exact enumeration (no sampling): p and q at every position of every
  2-token block from `probabilities` under a pattern, penalties and a bias moved along the block
  (`at_block`); the law of the committed tokens equals the NumPy constrained target's within 1e-6;
* a row's automaton state survives the stacked table's layout changing between rounds;
* greedy rows under constraints equal a NumPy greedy decode with the same masks, token for
  token, for target-only, a chain, a static and a dynamic tree;
* the draft is masked along its own path: with the draft equal to the target every proposal of
  a chain and the first child at every depth of an i.i.d. tree is accepted (64 rows x 12
  tokens); a drafter that ignores the constraint loses acceptance.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import constraints, decoding, drafters, sampling, trees

from _tabular import continuation_pvalue, memoised_by_settings
from _toy import StrippedConfigDrafter, TabularModel, random_table

# ----------------------------------------------------------------------------- compilation

TOKENS = [b"a", b"b", b"c", b"ab", b"ca", b"\"", None, b"abc"]     # id 6 special, id 8 the stop
STOP = 8
PATTERNS = ["(a[bc]|c)*", "(ab|c)+", "a{2,3}b?", "\"[abc]{0,3}\"", "(a|bc)*c"]


def _texts(depth):
    spell = [t.decode() for t in TOKENS if t]
    out = {""}
    for _ in range(depth):
        out |= {s + t for s in out for t in spell}
    return out


CONTINUATIONS = sorted(_texts(4))


@functools.lru_cache(maxsize=None)
def _viable(pattern, text):
    """Some continuation of at most 4 tokens makes ``text`` a full match (memoised: the random
    paths below revisit the same short texts)."""
    return any(re.fullmatch(pattern, text + u) for u in CONTINUATIONS)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_automaton_allows_exactly_the_viable_tokens(pattern):
    auto = constraints.compile_regex(pattern, TOKENS, [STOP])
    assert auto.class_V.shape == (len(TOKENS),) and auto.start == 0
    ids = [i for i, t in enumerate(TOKENS) if t]
    for seq in itertools.product(ids, repeat=3):       # `matches` on every 3-token sequence
        spelled = "".join(TOKENS[i].decode() for i in seq)
        assert auto.matches(list(seq)) == bool(re.fullmatch(pattern, spelled)), (pattern, seq)
    rng = np.random.default_rng(0)
    for _ in range(200):
        state, text = auto.start, ""
        for _ in range(int(rng.integers(0, 6))):
            allowed = auto.allowed(state)
            want = [i for i, t in enumerate(TOKENS) if t and _viable(pattern, text + t.decode())]
            assert np.flatnonzero(allowed[:len(TOKENS)]).tolist() == sorted(want), (pattern, text)
            assert not allowed[6]
            assert allowed[STOP] == bool(re.fullmatch(pattern, text)) if STOP < len(TOKENS) else True
            choices = np.flatnonzero(allowed)
            if len(choices) == 0:
                break
            t = int(rng.choice(choices))
            text += TOKENS[t].decode()
            state = auto.step(state, t)
            assert state >= 0


def test_a_stop_token_ends_a_match_only_when_it_is_complete():
    tokens = TOKENS + [None]                # id 8: the stop token, a special token
    auto = constraints.compile_regex("(ab|c)+", tokens, [8])
    s = auto.step(auto.start, 0)             # "a": incomplete
    assert not auto.allowed(s)[8] and auto.step(s, 8) == -1
    s = auto.step(s, 1)                      # "ab": complete
    assert auto.allowed(s)[8] and auto.step(s, 8) == s and auto.matches([0, 1, 8, 2])


@pytest.fixture(scope="module")
def smollm2_tokens():
    from specjax.models import load_tokenizer
    tok = load_tokenizer()
    return tok, tok.token_bytes()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}


def test_a_json_schema_on_the_smollm2_vocabulary(smollm2_tokens):
    tok, token_bytes = smollm2_tokens
    auto = constraints.compile_json_schema(SCHEMA, token_bytes, tok.stop_token_ids)
    assert auto.num_classes < 1024 and auto.class_V.shape == (tok.vocab_size,)
    good = tok.encode('{"name": "Ada", "age": 36, "tags": ["math", "engines"]}', add_special_tokens=False)
    assert auto.matches(good) and auto.matches(good + list(tok.stop_token_ids))
    assert not auto.matches(good[:-1])
    assert not auto.matches(tok.encode('{"name": "Ada", "age": "36", "tags": []}', add_special_tokens=False))
    s = auto.start
    for t in good:
        s = auto.step(s, t)
    assert auto.allowed(s)[tok.stop_token_ids[0]] and auto.allowed(s).sum() == len(tok.stop_token_ids)
    with pytest.raises(constraints.ConstraintError, match="schema"):
        constraints.compile_json_schema("{not json", token_bytes, tok.stop_token_ids)
    with pytest.raises(constraints.ConstraintError, match="pattern"):
        constraints.compile_regex("(unclosed", token_bytes, tok.stop_token_ids)
    with pytest.raises(constraints.ConstraintError, match="max_states=10"):
        constraints.compile_json_schema(SCHEMA, token_bytes, tok.stop_token_ids, max_states=10)
    # a pattern whose character automaton has more states than max_states (1101 > 1024): refused on
    # that count, before the token walk whose tables are states x vocabulary (a larger repeat count
    # takes the same path; interegular's reduction alone grows faster than linearly in it)
    with pytest.raises(constraints.ConstraintError, match="character automaton has 1101 states, more than max_states=1024"):
        constraints.compile_regex("[a-z]{0,1100}", token_bytes, tok.stop_token_ids)


def test_stack_places_each_rows_automaton():
    a = constraints.compile_regex("(ab|c)+", TOKENS, [STOP])
    b = constraints.compile_regex("a{2,3}b?", TOKENS, [STOP])
    st = constraints.stack([a, None, b, a], len(TOKENS), max_states=16, max_classes=8)
    assert st.start_B.tolist() == [0, -1, 0, 0] and st.offset_B.tolist() == [0, 0, a.num_states, 0]
    for row, auto in ((0, a), (2, b)):
        off = st.offset_B[row]
        for s in range(auto.num_states):
            for t in range(len(TOKENS)):
                assert st.next_sc[off + s, st.class_BV[row, t]] == auto.step(s, t)
    with pytest.raises(constraints.ConstraintError, match="max_states=4"):
        constraints.stack([a, b], len(TOKENS), max_states=4, max_classes=8)
    with pytest.raises(constraints.ConstraintError, match="max_classes=2"):
        constraints.stack([a], len(TOKENS), max_states=16, max_classes=2)


# ----------------------------------------------------------------------------- end to end

V = 3
N_NEW = 6
GROUP = 8_000
PROMPT = (2, 1)
TOY_TOKENS = [b"a", b"b", b"c"]
# Hand-written automata of the toy patterns (state -> {token: next}), independent of the compiler.
TOY = {"(a[bc]|c)*": ({0: {0: 1, 2: 0}, 1: {1: 0, 2: 0}}, 0),
       "(ab|c)+": ({0: {0: 1, 2: 2}, 1: {1: 2}, 2: {0: 1, 2: 2}}, 0)}
GROUPS = (dict(pattern="(a[bc]|c)*"), dict(pattern="(ab|c)+", temperature=0.8, top_p=0.9),
          dict(pattern="(a[bc]|c)*", repetition_penalty=1.4, presence_penalty=0.3, logit_bias={2: -0.7}),
          dict(pattern="(ab|c)+"), dict())
SPECULATION = {"chain": 3, "tree": trees.TreeShape.from_branching((2, 2))}
FAMILY_WISE_ALPHA = 1e-4
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / (len(GROUPS) * len(SPECULATION))


def _automata():
    return {p: constraints.compile_regex(p, TOY_TOKENS, [V]) for p in TOY}


def _config(groups: list[dict], automata) -> sampling.SamplingConfig:
    g = lambda k, d: [x.get(k, d) for x in groups]    # noqa: E731
    stacked = constraints.stack([automata[x["pattern"]] if "pattern" in x else None for x in groups], V,
                                max_states=8, max_classes=4)
    return sampling.SamplingConfig.rows(g("temperature", 1.0), g("top_k", 0), g("top_p", 1.0), g("min_p", 0.0),
                                        g("logit_bias", None), g("repetition_penalty", 1.0),
                                        g("presence_penalty", 0.0), g("frequency_penalty", 0.0), constraint=stacked)


def _transform_np(logits, generated, s: dict):
    """Bias, penalties (prompt PROMPT), then the hand-written automaton's mask, in float64."""
    x = np.asarray(logits, np.float64).copy()
    for t, v in (s.get("logit_bias") or {}).items():
        x[t] += v
    counts = np.bincount(np.asarray(generated, int), minlength=V).astype(np.float64)
    seen = np.zeros(V, bool)
    seen[list(PROMPT)] = True
    r = s.get("repetition_penalty", 1.0)
    x = np.where(seen | (counts > 0), np.where(x > 0, x / r, x * r), x)
    x = x - s.get("frequency_penalty", 0.0) * counts - s.get("presence_penalty", 0.0) * (counts > 0)
    if "pattern" in s:
        table, state = TOY[s["pattern"]]
        for t in generated:
            state = table.get(state, {}).get(t)          # None: a prefix the pattern refuses
        x = np.where(np.isin(np.arange(V), list(table.get(state, {}))), x, -np.inf)
    return x


def _filters(s: dict) -> sampling.SamplingConfig:
    return sampling.SamplingConfig.rows([s.get("temperature", 1.0)], [s.get("top_k", 0)], [s.get("top_p", 1.0)])


_PROBS = jax.jit(sampling.probabilities)      # one compiled program for every law below


def _exact_law(target, s: dict) -> np.ndarray:
    """P(continuation) of every N_NEW-token sequence (base-V index, first token most significant)
    under the constrained target with the settings ``s`` (`_transform_np`, then `probabilities`
    with the row's temperature and filters)."""
    table = np.asarray(target)
    seqs = list(itertools.product(range(V), repeat=N_NEW))
    rows = []
    for seq in seqs:
        full = list(PROMPT) + list(seq)
        for i in range(len(PROMPT), len(full)):
            rows.append(_transform_np(table[full[i - 2], full[i - 1]], full[len(PROMPT):i], s))
    probs = np.asarray(_PROBS(jnp.asarray(np.stack(rows), jnp.float32)[None], _filters(s)))[0]
    law = np.ones(len(seqs))
    for j, seq in enumerate(seqs):
        for i, y in enumerate(seq):
            law[j] *= probs[j * N_NEW + i, y]
    return np.nan_to_num(law)


@pytest.fixture(scope="module")
def tables():
    target = random_table(jax.random.key(10), V, peak=2.0)
    return target, target + random_table(jax.random.key(11), V, peak=1.0)


@pytest.fixture(scope="module")
def exact_law(tables):
    """`_exact_law` on the target table, memoised per settings: a group's law serves its chain
    and its tree test, the unconstrained group's the power test, and the third group's the
    enumeration of one round."""
    return memoised_by_settings(lambda s: _exact_law(tables[0], s))


def _engine(gamma, drafter=None, max_new=N_NEW):
    config = decoding.GenerationConfig(max_new_tokens=max_new, gamma=gamma, tree_children="iid",
                                       tree_verifier="traversal")
    if gamma == 0:
        return decoding.Engine(TabularModel(V), None, config)
    return decoding.Engine(TabularModel(V), drafter or drafters.ModelDrafter(TabularModel(V)), config)


def _generate(engine, params, cfg, n_rows, seed=2024):
    batch = decoding.make_batch([list(PROMPT)] * n_rows, engine.config, jax.random.key(seed))
    out = engine.run(params, cfg, batch)
    assert (np.asarray(out.status_B) == decoding.MAX_TOKENS).all()
    return out


@pytest.fixture(scope="module")
def generated(tables):
    out, automata = {}, _automata()
    params = decoding.EngineParams(target=tables[0], draft=tables[1])
    groups = [GROUPS[i % len(GROUPS)] for i in range(len(GROUPS) * GROUP)]
    for name, gamma in SPECULATION.items():
        res = _generate(_engine(gamma), params, _config(groups, automata), len(groups))
        out[name] = np.asarray(res.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]
    return out


def _pvalue(law, gen_BN):
    return continuation_pvalue(law, gen_BN, V)


@pytest.mark.parametrize("kind", list(SPECULATION))
@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_each_constrained_group_follows_its_own_law(exact_law, generated, kind, group):
    gen = generated[kind][group::len(GROUPS)]
    s = GROUPS[group]
    if "pattern" in s:
        pat = s["pattern"]
        table, _ = TOY[pat]
        for row in gen:                      # every token allowed where it was committed
            state = 0
            for t in row:
                assert t in table[state], (pat, row)
                state = table[state][t]
    p, impossible, cells = _pvalue(exact_law(s), gen)
    print(f"\n[{kind} {s}] p={p:.3g} (alpha per test {PER_TEST_ALPHA:.2g}) cells={cells}")
    assert impossible == 0 and cells >= 5          # (ab|c)+ spells 21 six-token prefixes
    assert p > PER_TEST_ALPHA, f"{kind} {s}: chi-square p={p:.3g} rejects exactness"


def test_the_test_tells_a_constraint_apart(exact_law, generated):
    """Power: the first pattern's rows against the unconstrained law are rejected."""
    p, _, _ = _pvalue(exact_law({}), generated["chain"][0::len(GROUPS)])
    assert p < PER_TEST_ALPHA


DRAFT_ROWS = 64     # the rows of the greedy and the draft-masking tests (one batch shape for both)


def _greedy_np(target, s, n):
    table = np.asarray(target)
    full = list(PROMPT)
    for _ in range(n):
        full.append(int(np.argmax(_transform_np(table[full[-2], full[-1]], full[len(PROMPT):], s))))
    return full[len(PROMPT):]


@pytest.mark.parametrize("gamma", [0, 3, trees.TreeShape.from_branching((2, 2)),
                                   trees.DynamicTree(depth=3, topk=2, node_budget=5)],
                         ids=["target-only", "chain", "tree", "dynamic-tree"])
def test_greedy_rows_under_constraints_equal_the_masked_greedy_decode(tables, gamma):
    """Four greedy settings, repeated over DRAFT_ROWS rows: the batch of
    `test_the_draft_is_masked_on_its_path` (same engine, same config layout), so a chain's and a
    static tree's program serve both tests."""
    n = 12
    settings = [dict(temperature=0.0, pattern="(a[bc]|c)*"), dict(temperature=0.0, pattern="(ab|c)+"),
                dict(temperature=0.0, pattern="(ab|c)+", frequency_penalty=0.9), dict(temperature=0.0)]
    groups = [settings[i % len(settings)] for i in range(DRAFT_ROWS)]
    out = _generate(_engine(gamma, max_new=n), decoding.EngineParams(target=tables[0], draft=tables[1]),
                    _config(groups, _automata()), len(groups))
    got = out.generated()
    want = [_greedy_np(tables[0], s, n) for s in settings]
    for i in range(len(groups)):
        assert got[i] == want[i % len(settings)], (i, groups[i])
    assert got[0] != got[3] and got[1] != got[3], "the constraints changed nothing: the test would not see them"


@pytest.mark.parametrize("gamma", [3, trees.TreeShape.from_branching((2, 2))], ids=["chain", "tree"])
def test_the_draft_is_masked_on_its_path(tables, gamma):
    rows, n = DRAFT_ROWS, 12
    groups = [dict(pattern="(ab|c)+")] * rows
    params = decoding.EngineParams(target=tables[0], draft=tables[0])
    depth = gamma if isinstance(gamma, int) else gamma.max_depth
    cfg = _config(groups, _automata())
    same = _generate(_engine(gamma, max_new=n), params, cfg, rows).metrics.summary()
    assert same["accepted"] == depth * same["target_passes"], same
    inner = drafters.ModelDrafter(TabularModel(V))
    control = _generate(_engine(gamma, drafter=StrippedConfigDrafter(inner, ("fsm_next", "fsm_class", "fsm_offset", "fsm_start", "fsm_state")), max_new=n), params, cfg, rows).metrics.summary()
    assert control["accepted"] < 0.9 * depth * control["target_passes"], control


def test_a_rows_state_survives_a_new_table_layout(tables):
    """Rounds by `Engine.step` whose stacked table changes between rounds, as a server's does when
    requests come and go: row 1's automaton sits at offset > 0 in the first round and at 0 after
    (row 0's request gone). The state kept between rounds is the row's own, so every token row 1
    commits is allowed by its pattern, and its tokens equal those of a run with one layout."""
    automata = _automata()
    a, b = automata["(a[bc]|c)*"], automata["(ab|c)+"]
    engine = _engine(3, max_new=12)
    params = decoding.EngineParams(target=tables[0], draft=tables[1])

    def cfg(rows):
        return sampling.SamplingConfig.rows([1.0, 1.0], constraint=constraints.stack(rows, V, 8, 4))

    def run(layouts):
        batch = decoding.make_batch([list(PROMPT)] * 2, engine.config, jax.random.key(5))
        state = engine.init(params, batch)
        for rows in layouts:
            state, _ = engine.step(params, cfg(rows), state)
        return np.asarray(state.tokens_BS)[1, len(PROMPT):int(state.lengths_B[1])].tolist()

    moved = run([[a, b]] + [[None, b]] * 6)
    fixed = run([[None, b]] * 7)
    assert len(moved) >= 8 and moved == fixed[:len(moved)]
    table, state = TOY["(ab|c)+"]
    for t in moved:
        assert t in table[state], moved
        state = table[state][t]


@pytest.mark.parametrize("verifier", ["token"])
def test_one_round_is_exact_by_enumeration(tables, exact_law, verifier):
    """Exact enumeration (no sampling): the target's and the draft's distributions at every
    position of every 2-token draft block come from `probabilities` under one config mixing a
    pattern, penalties and a logit bias, moved along the block by `at_block`; the law of the
    3 tokens one verification round and then target-only sampling commit equals the constrained
    target's law from the NumPy transcription (the first 3 tokens' marginal of `_exact_law`),
    within 1e-6. (The token verifier; every verifier's exactness for arbitrary prefix-dependent p
    and q: tests/test_verify_exhaustive.py.)"""
    import _tabular as tab
    from specjax import verify
    s = dict(pattern="(a[bc]|c)*", repetition_penalty=1.4, presence_penalty=0.3, logit_bias={2: -0.7})
    cfg = _config([s], _automata())
    tables_np = [np.asarray(t) for t in tables]
    gamma = 2

    @jax.jit
    def block_probs(toks_1S, prefix_1X, logits_1TV):
        at = cfg.with_history(toks_1S, jnp.asarray([len(PROMPT)]), jnp.asarray([len(PROMPT)]), V)
        return sampling.probabilities(logits_1TV, at.at_block(prefix_1X))

    def tree(table):
        @functools.lru_cache(maxsize=None)
        def dist(prefix: tuple) -> np.ndarray:
            # a block of gamma drafted tokens, the prefix padded with token 0: row len(prefix) reads
            # the prefix only (one compiled program for every prefix length)
            full = list(PROMPT) + list(prefix) + [0] * (gamma - len(prefix))
            logits = np.stack([table[full[i - 2], full[i - 1]] for i in range(len(PROMPT), len(full) + 1)])
            p = block_probs(jnp.asarray([full + [0]], jnp.int32), jnp.asarray([full[len(PROMPT):]], jnp.int32),
                            jnp.asarray(logits)[None])
            return np.nan_to_num(np.asarray(p)[0, len(prefix)]).astype(np.float32)
        return dist

    ver = jax.jit(verify.get_verifier("chain", verifier, greedy=False))
    law, target, _ = tab.exact_round_then_target(ver, verifier, tree(tables_np[0]), tree(tables_np[1]), V, gamma)
    want = exact_law(s).reshape(V ** (gamma + 1), -1).sum(1)      # first token most significant
    np.testing.assert_allclose(target, want, atol=1e-6)
    np.testing.assert_allclose(law, want, atol=1e-6)
    assert np.count_nonzero(np.asarray(want) > 0) < len(want)        # the pattern rules sequences out


def test_a_refused_token_leaves_no_distribution():
    """After a token the automaton refuses (`DEAD_STATE`) a position has no distribution: NaN
    for a sampled and for a greedy row, which the engine's guard sees, never a silent token 0;
    a row without an automaton (-1) is untouched; a live state masks."""
    auto = constraints.compile_regex("(ab|c)+", TOY_TOKENS, [V])
    st = constraints.stack([auto, auto, None, auto], V, 8, 4)
    cfg = sampling.SamplingConfig.rows([1.0, 0.0, 1.0, 0.0], constraint=st)
    cfg = cfg.replace(fsm_state=jnp.asarray([sampling.DEAD_STATE, sampling.DEAD_STATE, -1, 0], jnp.int32))
    logits = np.asarray([[0.1, 0.5, 0.2]] * 4, np.float32)
    p = np.asarray(_PROBS(jnp.asarray(logits), cfg))
    assert np.isnan(p[0]).all() and np.isnan(p[1]).all()
    np.testing.assert_allclose(p[2], np.exp(logits[2]) / np.exp(logits[2]).sum(), rtol=1e-6)
    assert p[3].tolist() == [0.0, 0.0, 1.0]           # start: "a" or "c"; greedy picks c (0.2 > 0.1)


def test_a_refilled_slot_forgets_the_automaton_of_its_last_request(tables):
    """A server's slot that served a constrained request, then a plain one: once another row's
    constraint makes the rounds constrained again, the plain row is unconstrained (its state is
    "no automaton", not its slot's last request's state, which masked every token: NaN logits,
    status nan_logits). Its tokens equal those of the same request in a slot that never held a
    constrained one; `refill` clears the slot's state."""
    automata = _automata()
    a, b = automata["(a[bc]|c)*"], automata["(ab|c)+"]
    engine = _engine(3, max_new=12)
    params = decoding.EngineParams(target=tables[0], draft=tables[1])
    capacity = engine.config.slots_needed(len(PROMPT))

    def cfg(rows):
        if all(r is None for r in rows):
            return sampling.SamplingConfig.rows([1.0] * len(rows))
        return sampling.SamplingConfig.rows([1.0] * len(rows), constraint=constraints.stack(rows, V, 8, 4))

    def one(seed):
        return decoding.make_batch([list(PROMPT)], engine.config, jax.random.key(seed), capacity=capacity)

    def plain_row_after(first):
        state = engine.empty_state(params, 2, capacity, key=jax.random.key(0))
        state = engine.refill(params, state, 0, one(1))
        for _ in range(3):                                # the slot's first request, to its end
            state, _ = engine.step(params, cfg([first, None]), state)
        state = engine.refill(params, state, 0, one(2))   # a plain request in the same slot
        assert int(state.constraint_B[0]) == -1
        state, _ = engine.step(params, cfg([None, None]), state)
        state = engine.refill(params, state, 1, one(3))   # a constrained one beside it
        for _ in range(3):
            state, _ = engine.step(params, cfg([None, b]), state)
        assert int(state.status_B[0]) in (decoding.RUNNING, decoding.MAX_TOKENS), decoding.STATUS_NAMES[
            int(state.status_B[0])]
        return np.asarray(state.tokens_BS)[0, len(PROMPT):int(state.lengths_B[0])].tolist()

    after_constrained, after_plain = plain_row_after(a), plain_row_after(None)
    assert len(after_plain) >= 6 and after_constrained == after_plain
    # and a row without an automaton reads "none" whatever state the engine kept for its slot
    assert b.start == 0 and b.num_states > 2
    h = cfg([None, b]).with_history(jnp.zeros((2, 8), jnp.int32), jnp.array([2, 2]), jnp.array([5, 5]), V,
                                    jnp.array([1, 2], jnp.int32))
    assert np.asarray(h.fsm_state).tolist() == [-1, 2]      # the constrained row reads the state kept for it
