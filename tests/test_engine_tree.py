"""Tree speculation through the engine: greedy equality, distribution exactness, cache state.

Toy setup as in test_engine_distribution: V = 3, a peaked prefix-dependent `TabularModel`
target (its logits depend on the previous and the current token, so a cache holding a wrong
history changes the output) and a perturbed draft table, both with tree attention
(`_toy.TabularModel._apply_tree`: a node's previous token is its parent).

Distribution tests: every configuration generates N_NEW = 6 tokens (more than the tree
depth + 1, so each sequence spans several rounds) for BATCH = 20 000 independent rows in one
batched call; the law of the whole continuation (3^6 cells) is compared with the exact
target-only law by a pooled chi-square test. Family: the EXACT cases; family-wise false-alarm
rate 1e-4, Bonferroni over the family. Seeds fixed, so outcomes are deterministic.
Negative control (must FAIL at the same per-test level): a target cache whose `commit_path`
keeps the first block entries instead of the accepted path (a rejected branch's K/V stays).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import struct

from specjax import decoding, drafters, sampling, trees

from _toy import TabularModel, ToyCache, random_table, sequence_probs

V = 3
N_NEW = 6
BATCH = 20_000
PROMPT = (2, 1)
FAMILY_WISE_ALPHA = 1e-4

BRANCHING = trees.TreeShape.from_branching((2, 2))
UNEVEN = trees.TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)])
DYNAMIC = trees.DynamicTree(depth=3, topk=2, node_budget=5)

# (label, tree, children, tree_verifier)
EXACT_CASES = [
    ("iid-traversal", BRANCHING, "iid", "traversal"),
    ("iid-recursive", BRANCHING, "iid", "recursive"),
    ("iid-recursive-uneven", UNEVEN, "iid", "recursive"),
    ("without-replacement-recursive", BRANCHING, "without_replacement", "recursive"),
    ("deterministic-recursive", UNEVEN, "deterministic", "recursive"),
    ("dynamic-recursive", DYNAMIC, "deterministic", "recursive"),
]
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / len(EXACT_CASES)


def _tables():
    target = random_table(jax.random.key(1), V)
    draft = target + 1.2 * jax.random.normal(jax.random.key(2), target.shape)
    return target, draft


def _engine(tree, children="iid", tree_verifier="traversal", max_new=N_NEW, target=None, drafter=None):
    config = decoding.GenerationConfig(max_new_tokens=max_new, gamma=tree, tree_children=children,
                                       tree_verifier=tree_verifier)
    return decoding.Engine(target or TabularModel(V), drafter or drafters.ModelDrafter(TabularModel(V)), config)


def _run(engine, prompts, sampling_cfg, draft_table=None, seed=0):
    target_t, draft_t = _tables()
    batch = decoding.make_batch(prompts, engine.config, jax.random.key(seed))
    params = decoding.EngineParams(target=target_t, draft=draft_t if draft_table is None else draft_table)
    return engine.run(params, sampling_cfg, batch)


# ----------------------------------------------------------------------------- greedy

# (the last two repetitive, so that the n-gram drafter finds several earlier matches; one batch
# shape for every greedy test, so one target-only reference program)
GREEDY_PROMPTS = [[2, 1], [0, 1, 2, 2], [1], [2, 2, 0, 1, 0], [1, 2, 0, 1, 2, 1, 1, 2, 0, 1], [0, 0, 1, 0, 0, 2, 0, 0]]


def _greedy_reference(prompts, max_new):
    target_t, _ = _tables()
    engine = decoding.Engine(TabularModel(V), None, decoding.GenerationConfig(max_new_tokens=max_new, gamma=0))
    batch = decoding.make_batch(prompts, engine.config, jax.random.key(0))
    return engine.run(decoding.EngineParams(target=target_t), sampling.SamplingConfig.greedy_config(),
                      batch).generated()


@pytest.mark.parametrize("tree", [BRANCHING, UNEVEN, DYNAMIC, trees.TreeShape.chain(3)],
                         ids=["branching", "uneven", "dynamic", "chain"])
def test_greedy_tree_equals_target_only(tree):
    """Greedy tree decoding commits target-only greedy decoding's tokens, and no round of this
    sound drafter is discarded: the q rows verification reads are distributions under greedy
    decoding (at T = 1: `test_tree_sampling_is_exact`; greedy rounds draft deterministic children
    and verify with the greedy verifier whatever `tree_children` and `tree_verifier` say, so the
    static and the dynamic trees here are every greedy case)."""
    ref = _greedy_reference(GREEDY_PROMPTS, 12)
    out = _run(_engine(tree, max_new=12), GREEDY_PROMPTS, sampling.SamplingConfig.greedy_config())
    assert out.generated() == ref
    m = out.metrics.summary()
    assert m["committed"] == sum(len(r) for r in ref)
    assert m["accepted"] > 0 and m["accepted"] < m["proposed"]
    assert m["invalid_draft_rounds"] == 0, m
    assert m["tokens_scored_per_pass"] == tree.num_nodes + 1


def test_greedy_ngram_tree_equals_target_only():
    ref = _greedy_reference(GREEDY_PROMPTS, 12)
    tree = trees.TreeShape.from_branching((3, 1, 1))
    engine = _engine(tree, max_new=12, drafter=drafters.NGramDrafter(V))
    out = _run(engine, GREEDY_PROMPTS, sampling.SamplingConfig.greedy_config())
    assert out.generated() == ref
    assert out.metrics.summary()["accepted"] > 0        # the repetitive prompts' matches were drafted


def test_ngram_rejects_trees_it_cannot_draft():
    with pytest.raises(ValueError, match="n-gram drafter drafts k chains"):
        _engine(BRANCHING, drafter=drafters.NGramDrafter(V))


def test_adaptive_among_chains_and_trees_is_exact_and_uses_trees():
    adaptive = decoding.AdaptiveGamma(gammas=(0, 2, BRANCHING), initial_alpha=0.9)
    config = decoding.GenerationConfig(max_new_tokens=12, gamma=adaptive)
    engine = decoding.Engine(TabularModel(V), drafters.ModelDrafter(TabularModel(V)), config)
    target_t, draft_t = _tables()
    batch = decoding.make_batch(GREEDY_PROMPTS, config, jax.random.key(0))
    # Round times that make the tree the cheapest per expected token at a high acceptance.
    out = engine.run(decoding.EngineParams(target=target_t, draft=target_t), sampling.SamplingConfig.greedy_config(),
                     batch, round_time_s=[1.0, 1.05, 1.1])
    assert out.generated() == _greedy_reference(GREEDY_PROMPTS, 12)
    rounds = out.metrics.summary()["rounds_per_gamma"]
    assert rounds[2] > 0, rounds


def test_adaptive_rejects_dynamic_trees():
    with pytest.raises(ValueError, match="dynamic tree"):
        decoding.AdaptiveGamma(gammas=(0, 2, DYNAMIC))


# ----------------------------------------------------------------------------- distribution

def _chisquare_pvalue(out, cfg):
    target_t, _ = _tables()
    exact = sequence_probs(target_t, PROMPT, N_NEW, lambda t: sampling.probabilities(t, cfg))
    gen = out.generated()
    assert all(len(g) == N_NEW for g in gen)
    index = {seq: i for i, seq in enumerate(exact)}
    counts = np.bincount([index[tuple(g)] for g in gen], minlength=len(exact)).astype(float)
    probs = np.asarray([exact[s] for s in exact], np.float64)
    probs = probs / probs.sum()         # float32 tables: renormalise the rounding away
    assert counts[probs == 0].sum() == 0, "a sequence of target probability 0 was generated"
    expected = probs * len(gen)
    order = np.argsort(expected)
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for i in order:           # pool the smallest cells until each pooled cell expects >= 5
        acc_o += counts[i]
        acc_e += expected[i]
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    return scipy.stats.chisquare(obs, exp).pvalue


CFG = sampling.SamplingConfig.make(temperature=1.0)


@dataclasses.dataclass(frozen=True)
class _HalfMassTreeDrafter(drafters.ModelDrafter):
    """Batch row 0's q rows carry half the probability mass (a repeated vocabulary-map id); the
    other rows' are the model drafter's."""

    def propose_tree(self, params, state, context, key_B, tree, cfg, children):
        draft, q_BN1V, state = super().propose_tree(params, state, context, key_B, tree, cfg, children)
        return draft, q_BN1V.at[0].multiply(0.5), state


@pytest.mark.parametrize("label,tree,children,tree_verifier", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_tree_sampling_is_exact(label, tree, children, tree_verifier):
    """The law of the continuation is the target's (chi-square), and verification reads only
    distributions: every tree drafter's q rows that verification reads (children drawn from q:
    the root's, and those of nodes with a child; a leaf's row may be zeros) are distributions, so
    no round of the sound rows (1 and up, the model drafter's q) is discarded. Row 0's q rows sum
    to 0.5 (`_HalfMassTreeDrafter`): every round of that row is discarded (gamma = 0, counted),
    never verified, and its tokens are still target samples (the round commits one token from
    p_0); with deterministic children the rows are not read (each child carries its own one-hot
    q), so nothing is discarded. (Greedy rounds: `test_greedy_tree_equals_target_only`.)"""
    engine = _engine(tree, children, tree_verifier, drafter=_HalfMassTreeDrafter(TabularModel(V)))
    out = _run(engine, [list(PROMPT)] * BATCH, CFG)
    m = out.metrics.summary()
    assert m["accepted"] > 0.2 * m["target_passes"], m     # the trees really are used
    b = jax.device_get(out.metrics)
    assert b.invalid_draft_rounds_B[1:].sum() == 0, label
    if children == "deterministic":
        assert b.invalid_draft_rounds_B[0] == 0, label
    else:
        assert b.invalid_draft_rounds_B[0] == b.rounds_B[0] > 0 and b.accepted_B[0] == 0, label
    p = _chisquare_pvalue(out, CFG)
    assert p > PER_TEST_ALPHA, f"{label}: chi-square p = {p:.2e}"


@dataclasses.dataclass(frozen=True)
class WrongCommitTarget(TabularModel):
    """BROKEN target: its cache commits the first block entries (root, then nodes 0, 1, ...)
    instead of the accepted path, so K/V of rejected branches stay in the committed prefix."""

    def apply(self, table_VVV, tokens_BT, cache, num_valid_B=None, tree=None):
        logits, cache = super().apply(table_VVV, tokens_BT, cache, num_valid_B, tree)
        return logits, _WrongCommitCache(cache.hist_BS, cache.lengths_B)

    def init_cache(self, batch_size, capacity):
        c = super().init_cache(batch_size, capacity)
        return _WrongCommitCache(c.hist_BS, c.lengths_B)


@struct.dataclass
class _WrongCommitCache(ToyCache):
    def commit_path(self, offsets_BA, num_B):
        return _WrongCommitCache(self.hist_BS, self.lengths_B + num_B.astype(jnp.int32))

    def truncate(self, max_lengths_B):
        c = super().truncate(max_lengths_B)
        return _WrongCommitCache(c.hist_BS, c.lengths_B)


def test_negative_control_cache_keeping_a_rejected_branch_is_detected():
    engine = _engine(BRANCHING, "iid", "recursive", target=WrongCommitTarget(V))
    out = _run(engine, [list(PROMPT)] * BATCH, CFG)
    p = _chisquare_pvalue(out, CFG)
    assert p < PER_TEST_ALPHA, f"the broken cache was not detected (p = {p:.2e})"


# ----------------------------------------------------------------------------- real decoder: caches

from specjax import models  # noqa: E402

LLAMA = models.ModelConfig(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                           head_dim=8, ffn_size=48, rope_theta=10000.0, rms_eps=1e-5)
LLAMA_PROMPTS = [[5, 9, 3, 7, 1], [2, 4], [8, 8, 1, 30, 12, 7, 22]]


def _llama(scan_layers, seed=0):
    model = models.Llama(LLAMA.replace(scan_layers=scan_layers))
    params = models.canonical_params(model.init_params(jax.random.key(seed)), model.config)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)   # non-trivial attention
    return model, model.prepare_params(params)


def _drafter(kind, target, tparams):
    if kind == "early_exit":
        return drafters.EarlyExitDrafter.from_target(target, tparams, 1)
    draft, dparams = _llama(target.config.scan_layers, seed=3)
    return drafters.ModelDrafter(draft), dparams


_FRESH_WIDTH = 32


@functools.lru_cache(maxsize=None)
def _fresh_prefill(model):
    """Jitted causal prefill of one row padded to _FRESH_WIDTH (the padding comes after the
    compared slots, so it cannot change them)."""
    return jax.jit(lambda p, t: model.apply(p, t, model.init_cache(1, _FRESH_WIDTH + 1))[1])


def _fresh_kv(model, params, tokens):
    """K/V of a fresh causal prefill of `tokens` (one row): per layer (k [K, n, H], v [K, H, n])."""
    n = len(tokens)
    padded = jnp.asarray([list(tokens) + [0] * (_FRESH_WIDTH - n)], jnp.int32)
    cache = jax.device_get(_fresh_prefill(model)(params, padded))     # sliced on the host (no compiles)
    return [(cache.layer(l)[0][0, :, :n, :], cache.layer(l)[1][0, :, :, :n]) for l in range(model.config.num_layers)]


@functools.lru_cache(maxsize=None)
def _llama_greedy_reference(scan_layers):
    """Target-only greedy decoding of LLAMA_PROMPTS (10 tokens) on `_llama(scan_layers)`: one
    compiled run per layout, shared by the cases below (lists of ints, no device arrays kept)."""
    target, tparams = _llama(scan_layers)
    engine = decoding.Engine(target, None, decoding.GenerationConfig(max_new_tokens=10, gamma=0))
    return engine.run(decoding.EngineParams(target=tparams), sampling.SamplingConfig.greedy_config(),
                      decoding.make_batch(LLAMA_PROMPTS, engine.config, jax.random.key(0))).generated()


# Both cache layouts (per-layer and stacked) for the shared-cache drafter; the model drafter's
# static tree on one layout and its dynamic tree on the other.
@pytest.mark.parametrize("scan_layers,kind,tree", [
    (False, "early_exit", BRANCHING), (False, "model", UNEVEN),
    (True, "early_exit", BRANCHING), (True, "model", DYNAMIC)],
    ids=["unrolled-early_exit-branching", "unrolled-model-uneven", "scan-early_exit-branching", "scan-model-dynamic"])
def test_caches_hold_exactly_the_committed_prefix_after_every_round(scan_layers, kind, tree):
    """Greedy tree rounds on a random tiny Llama, rows of different lengths: after every round the
    target's cache (and a model draft's) holds exactly the committed prefix minus its last token,
    equal to a fresh prefill of it; the output of these rounds equals target-only greedy decoding.
    (The output is read from the stepped state, not from a second generation by `Engine.run`,
    which compiled the whole loop again around the same round: `run`'s loop runs `step`'s round,
    tests/test_engine_edges.py::test_step_by_hand_equals_run, and `run` with trees equals
    target-only greedy in `test_greedy_tree_equals_target_only`.)"""
    target, tparams = _llama(scan_layers)
    drafter, dparams = _drafter(kind, target, tparams)
    config = decoding.GenerationConfig(max_new_tokens=10, gamma=tree)
    engine = decoding.Engine(target, drafter, config)
    params = decoding.EngineParams(target=tparams, draft=dparams)
    greedy = sampling.SamplingConfig.greedy_config()
    batch = decoding.make_batch(LLAMA_PROMPTS, config, jax.random.key(0))
    state = engine.init(params, batch)
    depths = set()
    for _ in range(12):
        before = np.asarray(state.lengths_B)
        state, commit = engine.step(params, greedy, state)
        depths |= set((np.asarray(commit.n_B) - 1).tolist())
        lengths = np.asarray(state.lengths_B)
        tokens = np.asarray(state.tokens_BS)
        # (on the host: slicing device arrays row by row and layer by layer compiled each slice)
        caches = [("target", target, tparams, jax.device_get(state.target_cache))]
        if kind == "model":
            caches.append(("draft", drafter.model, dparams, jax.device_get(state.draft_state.cache)))
        for b in range(len(LLAMA_PROMPTS)):
            committed = tokens[b, :lengths[b]].tolist()
            for name, model, mparams, cache in caches:
                n = int(np.asarray(cache.lengths_B)[b])
                if name == "draft":   # the draft may lag (it ingests what it has not seen next round)
                    assert n <= lengths[b] - 1
                else:
                    assert n == lengths[b] - 1, (name, b, n, lengths[b], before[b])
                fresh = _fresh_kv(model, mparams, committed[:n])
                for l, (k_ref, v_ref) in enumerate(fresh):
                    k, v = (np.asarray(x[b]) for x in cache.layer(l))
                    np.testing.assert_allclose(k[:, :n, :], k_ref, atol=2e-5, err_msg=f"{name} layer {l} row {b}")
                    np.testing.assert_allclose(v[:, :, :n], v_ref, atol=2e-5, err_msg=f"{name} layer {l} row {b}")
        if bool(np.all(np.asarray(commit.done_B))):
            break
    # every round commits at least one token per row: 10 new tokens take at most 10 rounds
    assert bool(np.all(np.asarray(commit.done_B))), "the rows did not finish in 12 rounds"
    assert len(depths) > 1, f"rows accepted the same depth every round: {depths}"
    assert decoding.GenerateOutput.from_state(state).generated() == _llama_greedy_reference(scan_layers)


def test_sampled_tree_on_llama_commits_only_in_support_tokens_with_top_k():
    """T = 1 with top-k = 3 on the tiny Llama: every committed token is among the target's top 3
    at its position (a fresh teacher-forced forward), for every verifier and children mode.
    In the stacked (`lax.scan`) layout, whose three engine programs compile in about two thirds
    of the unrolled ones' time (the cases above: 3.7 and 4.5 s against 5.3 and 6.6 s): which
    tokens verification may commit is the sampler's and verifier's, the same in either layout,
    and tree rounds in both layouts are checked against fresh prefills above."""
    target, tparams = _llama(True)
    drafter, dparams = _drafter("model", target, tparams)
    cfg = sampling.SamplingConfig.make(temperature=1.0, top_k=3)
    # the teacher-forced forward of every row at once, right-padded to one width (causal: the
    # padding comes after the positions read), one compiled program
    forward = jax.jit(lambda p, t: target.apply(p, t, None)[0])
    for children, verifier in [("iid", "traversal"), ("without_replacement", "recursive"),
                               ("deterministic", "traversal")]:
        config = decoding.GenerationConfig(max_new_tokens=8, gamma=BRANCHING, tree_children=children,
                                           tree_verifier=verifier)
        engine = decoding.Engine(target, drafter, config)
        out = engine.run(decoding.EngineParams(target=tparams, draft=dparams), cfg,
                         decoding.make_batch(LLAMA_PROMPTS, config, jax.random.key(7)))
        seqs = [prompt + gen for prompt, gen in zip(LLAMA_PROMPTS, out.generated())]
        all_logits = np.asarray(forward(tparams, jnp.asarray([s + [0] * (_FRESH_WIDTH - len(s)) for s in seqs])))
        for prompt, gen, logits in zip(LLAMA_PROMPTS, out.generated(), all_logits):
            for i, tok in enumerate(gen):
                pos = len(prompt) + i - 1
                top3 = np.argsort(-logits[pos])[:3]
                assert tok in top3, (children, verifier, i, tok, top3)
