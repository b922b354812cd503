"""The parallel block drafter (issue 55 items 1-2): one layer call drafts the block, its
outputs equal the training forward's, its draws follow the q it reports, one verification
round with its q is exact by enumeration (chains and trees), greedy decoding equals target-only
(chains, static and dynamic trees, adaptive gamma) with the head's cache equal to a fresh
prefill after every round, and its settings are checked.

The chi-square harness at T = 1 over whole generations is in test_heads_sampling.py (cases
``parallel_*`` of `_heads_common.D_EXACT`); training and the evaluation's chain simulation
against the engine in test_heads_train.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, sampling, trees, verify
from specjax.models import llama as llama_lib

import _tabular as tab
import _tree_enum as te
from _heads_common import (CFG, D_CFG, D_PROMPT, GREEDY, MAX_NEW, PROMPTS, _assert_target_tokens, _dist_setup, _gen,
                           _jit_features, _fresh_head_init, _np_params, _own_params, _step_through, _target,
                           _target_only, _to_device, _true_features)

K = 4                                      # block size of the test heads


def _parallel_config(cfg=CFG, k=K, head_size=None):
    return drafters.HeadConfig.make("parallel", cfg, feature_layers=(0, 2, -1) if cfg is CFG else None,
                                    num_heads=k, input_norm=True, head_size=head_size)


@functools.cache
def _parallel_head(mode: str = "good"):
    """(drafter, run params, config) on the tiny target: the 'good' EAGLE-3 weights of
    `_own_params` (step 1 drafts like the target one position late) with random placeholders,
    or 'random' weights everywhere."""
    _, tp = _target()
    hc = _parallel_config()
    own = dict(_own_params(dataclasses.replace(hc, kind="eagle3", num_heads=4), mode))
    own["block_x"] = jnp.asarray(np.random.default_rng(5).standard_normal((K - 1, hc.hidden_size)), jnp.float32)
    return hc.spec.drafter(hc), drafters.head_params(hc, own, tp), hc


def test_block_outputs_equal_the_training_forward():
    """The block call (`ParallelDrafter._block`) gives, for gamma = 1, 2 and 4 and 1 to
    gamma + 4 unseen committed tokens (more than gamma + 1: ingested first in a loop), the
    outputs the training forward (`train_forward`, K steps, cache-free) has at origin L - 1,
    within float32 rounding; the features past L - 2 (never valid) are NaN and read by nothing.
    Afterwards the cache holds the L committed entries."""
    model, tp = _target()
    dr, hp, hc = _parallel_head("random")
    cap, P = 24, 6
    rng = np.random.default_rng(3)
    toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, cap)), jnp.int32)
    feats = _jit_features(model)(tp, toks, None, layers=hc.feature_layers)[1]
    state = jax.jit(lambda p, t, n, f: dr.init(p, t, n, cap, features_BPF=f))(hp, toks[:, :P], jnp.asarray([P, P - 2]),
                                                                               feats[:, :P])
    ref = jax.jit(lambda p, t, f: hc.spec.train_forward(hc, p, t, f, K, with_logits=False))(hp, toks, feats)
    for gamma in (1, 2, 4):
        block = jax.jit(lambda p, s, c, g=gamma: dr._block(p, s, c, g))
        for unseen in sorted({1, 3, gamma + 1, gamma + 4}):
            L = jnp.asarray([P - 1 + unseen, P - 3 + unseen], jnp.int32)
            f_nan = jnp.where(jnp.arange(cap)[None, :, None] < (L - 1)[:, None, None], feats, jnp.nan)
            ctx = drafters.DraftContext(tokens_BS=toks, lengths_B=L, features=f_nan, target_cache=None)
            h_BGD, st = block(hp, state, ctx)
            want = np.stack([[np.asarray(ref[j][0][b, int(L[b]) - 1]) for j in range(gamma)] for b in range(2)])
            np.testing.assert_allclose(np.asarray(h_BGD), want, rtol=2e-5, atol=2e-5,
                                       err_msg=f"gamma={gamma}, unseen={unseen}")
            np.testing.assert_array_equal(np.asarray(st.cache.kv.lengths_B), np.asarray(L))


DRAW_ROWS = 20_000


@functools.cache
def _draw_program(gamma):
    """(jitted features of the V = 5 target, jitted init + propose of the parallel drafter at
    ``gamma``, its params): the sampling settings are an argument, so every setting of one
    structure (top-k / top-p on or off) runs the same compiled program."""
    model, tp, _ = _dist_setup()
    hc = _parallel_config(D_CFG, k=3)
    own = _to_device(_random_parallel_own(hc, np.random.default_rng(40)))
    hp = drafters.head_params(hc, own, tp)
    dr = hc.spec.drafter(hc)
    P = len(D_PROMPT)
    feats = jax.jit(lambda p, t: model.apply_with_features(p, t, None, layers=hc.feature_layers)[1])

    @jax.jit
    def run(hp, toks, feats, keys, samp):
        L = jnp.full(toks.shape[:1], P, jnp.int32)
        st = dr.init(hp, toks[:, :P], L, toks.shape[1], features_BPF=feats[:, :P])
        ctx = drafters.DraftContext(tokens_BS=toks, lengths_B=L, features=feats, target_cache=None)
        return dr.propose(hp, st, ctx, keys, gamma, samp)[:2]

    return (lambda toks: feats(tp, toks)), run, hp


def _draws(samp, gamma=3, rows=DRAW_ROWS, seed=11):
    """(tokens [rows, gamma], q [gamma, V]) of the parallel drafter on the V = 5 target: one
    jitted propose on `rows` copies of one context, each with its own key."""
    feats, run, hp = _draw_program(gamma)
    toks = jnp.asarray(np.tile(np.asarray(D_PROMPT + (0,) * 5, np.int32), (rows, 1)))
    keys = decoding.request_keys(jax.random.key(seed), list(range(rows)))
    t, q = run(hp, toks, feats(toks), keys, samp)
    q = np.asarray(q, np.float64)
    np.testing.assert_allclose(q, np.broadcast_to(q[:1], q.shape), atol=1e-7)   # one context: one q per position
    return np.asarray(t), q[0]


def _random_parallel_own(hc, rng):
    """Random own weights of a parallel head (projections scaled like the target's)."""
    D, F = hc.hidden_size, hc.feature_size
    return {"fc": (0.3 * rng.standard_normal((2 * D, D))).astype(np.float32),
            "fuse": (0.3 * rng.standard_normal((F, D))).astype(np.float32),
            "layers": _np_params(llama_lib.param_specs(hc.layer_config)["layers"], rng, 10.0),
            "input_norm": np.ones((2, D), np.float32),
            "block_x": rng.standard_normal((hc.num_heads - 1, D)).astype(np.float32)}


PAIRS = ((0, 1), (1, 2), (0, 2))
DRAW_ALPHA = 1e-4 / len(PAIRS)             # family-wise false-alarm rate 1e-4 over the three pairs


def test_draws_follow_the_reported_q_independently():
    """q is what the drafter samples from: 20,000 proposals of 3 tokens (one context, one key
    per row, seed 11) at T = 1 with top-k 3 and top-p 0.9; for each pair of positions the joint
    counts against q_g x q_h by the pooled chi-square (`support_chisquare`, 25 cells),
    family-wise false-alarm rate 1e-4 over the 3 pairs (Bonferroni). No draw falls where q is 0.
    Negative control: the same counts against the law of T = 1.5 (what a drafter that samples
    at one temperature and reports another would be tested against) must fail."""
    samp = sampling.SamplingConfig.make(temperature=1.0, top_k=3, top_p=0.9)
    tokens, q = _draws(samp)
    V = q.shape[-1]
    assert (q.max(-1) < 0.99).all() and ((q > 0).sum(-1) >= 2).all(), q      # not degenerate
    wrong = sampling.SamplingConfig.make(temperature=1.5, top_k=3, top_p=0.9)
    _, q_wrong = _draws(wrong)
    for g, h in PAIRS:
        counts = np.bincount(tokens[:, g] * V + tokens[:, h], minlength=V * V)
        p, impossible, cells = tab.support_chisquare(counts, np.outer(q[g], q[h]).ravel())
        assert impossible == 0 and cells >= 4
        assert p > DRAW_ALPHA, f"positions {g}, {h}: p={p:.3g}"
        bad, _, _ = tab.support_chisquare(counts, np.outer(q_wrong[g], q_wrong[h]).ravel())
        assert bad < DRAW_ALPHA, f"the negative control passed at positions {g}, {h} (p={bad:.3g})"


@jax.jit
def _target_probs(tp, seq_1S, last, samp):
    """The V = 5 target's processed distribution after position ``last`` of a right-padded
    sequence (cache-free and causal: the padding after it is not read)."""
    model, _, _ = _dist_setup()
    return sampling.probabilities(model.apply(tp, seq_1S, None)[0][0, last], samp)


def _round_laws(samp_kw, gamma):
    """(tree_p, tree_q) of one round on the V = 5 target after D_PROMPT: p the target's
    processed distribution after each prefix (exact, cache-free), q the parallel drafter's
    reported distribution at position len(prefix) + 1 (the same for every prefix). The q comes
    from `_draws` (its rows and gamma 3: test_draws_follow_the_reported_q_independently's
    compiled program where the sampling settings have its structure; a leaf's q row is read,
    never drawn from)."""
    assert gamma + 1 == 3
    _, tp, _ = _dist_setup()
    samp = sampling.SamplingConfig.make(**samp_kw)
    _, q = _draws(samp)
    width = len(D_PROMPT) + gamma + 1          # every prefix padded to one width: one program

    @functools.cache
    def tree_p(prefix):
        seq = list(D_PROMPT) + list(prefix)
        padded = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        return np.asarray(_target_probs(tp, padded, len(seq) - 1, samp), np.float32)

    return tree_p, (lambda prefix: q[len(prefix)].astype(np.float32))


@pytest.mark.parametrize("samp_kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["T1", "T0.8_topk3_topp0.9"])
def test_one_round_with_the_drafters_q_is_exact_by_enumeration(samp_kw):
    """Exact enumeration (no sampling) of one verification round fed the parallel drafter's
    own q on the V = 5 target: every draft block with its probability, every acceptance
    branch, then target sampling to fill up. The law of the committed tokens equals the
    target's (to 1e-6) for the token and block verifiers (chain, gamma = 2) and for the
    traversal and recursive-rejection (SpecInfer) verifiers on a tree with 2 sampled children
    of the root and one child each (iid and without replacement) and with deterministic
    (top-k) children."""
    tree_p, tree_q = _round_laws(samp_kw, gamma=2)
    V = D_CFG.vocab_size
    for name, kind in (("token", "token"), ("block", "block")):
        law, target, accepted = tab.exact_round_then_target(verify.get_verifier("chain", name), kind, tree_p, tree_q,
                                                            V, 2)
        np.testing.assert_allclose(law, target, atol=1e-6, err_msg=name)
        assert 0.1 < accepted < 1.9
    shape = trees.TreeShape.from_branching((2, 1))
    for name in verify.verifier_names("tree"):
        for mode in trees.CHILDREN_MODES:
            out = te.exact_outcomes(verify.get_verifier("tree", name), shape, mode, tree_p, tree_q, V)
            law, target = out.committed_law(tree_p, V, shape.max_depth + 1)
            np.testing.assert_allclose(law, target, atol=1e-6, err_msg=f"{name} {mode}")


ADAPTIVE = decoding.AdaptiveGamma(gammas=(0, 1, 4), probe_every=2)
GREEDY_RUNS = {"adaptive": ADAPTIVE, "dynamic-k2-d4-n8": trees.DynamicTree(depth=4, topk=2, node_budget=8)}


@pytest.mark.parametrize("name", list(GREEDY_RUNS))
def test_greedy_equals_target_only(name):
    """Greedy decoding with the parallel drafter on the tiny target (4 prompts, 16 tokens,
    chunked prefill) gives target-only's tokens: adaptive gamma (0, 1, 4; round times that
    switch between them) and an EAGLE-2 dynamic tree over its block. Proposals are accepted
    somewhere and rejected somewhere. (Chains of the whole block, 4, and a static tree: round
    by round in test_cache_holds_the_committed_prefix_after_every_round.)"""
    model, tp = _target()
    dr, hp, _ = _parallel_head()
    eng = decoding.Engine(model, dr, _gen(GREEDY_RUNS[name]))
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    out = eng.run(decoding.EngineParams(target=tp, draft=hp), GREEDY, batch,
                  round_time_s=(1.0, 1.4, 2.0) if name == "adaptive" else None)
    _assert_target_tokens(out)
    m = out.metrics
    assert 0 < int(np.sum(m.accepted_B)) < int(np.sum(m.proposed_B)), name


@pytest.mark.parametrize("gamma", [4, trees.TreeShape.from_branching((2, 1, 1))], ids=["chain4", "tree-2x1x1"])
def test_cache_holds_the_committed_prefix_after_every_round(gamma):
    """Round by round (greedy, 4 prompts, 16 tokens, chunked prefill; chains of the whole block
    and a static tree): after every commit the drafter's cache holds the entries of the tokens
    committed before the round (min(L_before, L - 1); the tokens this round committed are
    ingested, with their true features, next round) and they equal (K/V, to 1e-5) a fresh
    prefill over the committed tokens with the target's true features; the placeholders'
    entries are gone. The tokens are target-only's, and proposals are accepted somewhere and
    rejected somewhere."""
    model, tp = _target()
    dr, hp, hc = _parallel_head()
    eng = decoding.Engine(model, dr, _gen(gamma))
    ep = decoding.EngineParams(target=tp, draft=hp)
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    rounds, final = _step_through(eng, ep, batch, GREEDY)
    for before, st in rounds:
        np.testing.assert_array_equal(np.asarray(st.draft_state.cache.kv.lengths_B),
                                      np.minimum(np.asarray(st.lengths_B) - 1, before))
        assert _kept_kv_vs_fresh(hc, ep, batch.capacity, st) < 1e-5
    got = [list(np.asarray(final.tokens_BS)[b, len(p):len(p) + MAX_NEW]) for b, p in enumerate(PROMPTS)]
    assert got == _target_only()[0]
    m = final.metrics
    assert 0 < int(np.sum(m.accepted_B)) < int(np.sum(m.proposed_B)), gamma


def _kept_kv_vs_fresh(hc, ep, capacity, st):
    """The largest difference between the K/V of the cache's kept slots and a fresh prefill's
    (the parallel drafter keeps no output features: `HeadCache.pred_BSD` is unused)."""
    L, cache = st.lengths_B, st.draft_state.cache
    fresh = _fresh_head_init(hc, capacity)(ep.draft, st.tokens_BS, L, _true_features(st.tokens_BS, hc.feature_layers))
    kept = np.asarray(cache.kv.lengths_B)
    (k, v), (fk, fv) = ([np.asarray(x) for x in c.kv.layer(0)] for c in (cache, fresh))
    return max(max(np.abs(k[b, :, :n] - fk[b, :, :n]).max(initial=0), np.abs(v[b, ..., :n] - fv[b, ..., :n]).max(initial=0))
               for b, n in enumerate(kept))


def test_settings_and_inputs_are_checked(tmp_path):
    """A gamma or a tree deeper than the block, a block of 0 positions, drafter='parallel'
    without a directory or on another kind's head, and a parallel drafter saved for another
    target (vocabulary, width) are refused with the problem named."""
    model, tp = _target()
    dr, hp, hc = _parallel_head()
    with pytest.raises(ValueError, match="block of 4 positions.*asked for 5"):
        decoding.Engine(model, dr, _gen(5))             # when the engine is built, before any prefill
    with pytest.raises(ValueError, match="block of 4 positions"):
        dr.check_tree(trees.TreeShape.chain(5))
    with pytest.raises(ValueError, match="num_heads >= 1"):
        _parallel_config(k=0)
    kind = drafters.drafter_kind("parallel")
    ctx = drafters.BuildContext(target=model, target_params=tp, target_name="tiny")
    with pytest.raises(ValueError, match="drafter='parallel' needs draft_model"):
        kind.build(kind.settings_from({}), ctx)
    eagle_dir, par_dir = tmp_path / "eagle", tmp_path / "parallel"
    eh = drafters.HeadConfig.make("eagle", CFG)
    drafters.save_head(eagle_dir, eh, drafters.init_head_params(eh, jax.random.key(0)))
    with pytest.raises(ValueError, match="holds a 'eagle' head"):
        kind.build(kind.settings_from({"draft_model": str(eagle_dir)}), ctx)
    own = drafters.init_head_params(hc, jax.random.key(0))
    drafters.save_head(par_dir, hc, own, dtype="float32")
    built, params = kind.build(kind.settings_from({"draft_model": str(par_dir)}), ctx)
    assert isinstance(built, drafters.ParallelDrafter) and built.block_size == K
    from specjax.models import Llama
    for other, said in ((CFG.replace(vocab_size=CFG.vocab_size + 3), "'vocab_size': 100"),
                        (CFG.replace(hidden_size=48, head_dim=12), "'hidden_size': 48")):
        o = Llama(other.replace(scan_layers=False))
        abstract_params = jax.eval_shape(o.init_params, jax.random.key(0))     # (refused before they are read)
        with pytest.raises(ValueError, match=f"was made for a target with .*this target has .*{said}"):
            drafters.load_head(par_dir, o, abstract_params)


def test_export_and_reload_draft_identically(tmp_path):
    """save_head / load_head (float32) keep every own tensor; the reloaded drafter proposes
    the same tokens with the same q."""
    model, tp = _target()
    dr, hp, hc = _parallel_head()
    own = {k: hp[k] for k in hc.own_param_names}
    drafters.save_head(tmp_path / "p", hc, own, dtype="float32")
    dr2, hp2 = drafters.load_head(tmp_path / "p", model, tp)
    assert dr2.model.config.kind == "parallel" and dr2.block_size == K
    for k in hc.own_param_names:
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, own[k]), jax.tree.map(np.asarray, hp2[k]))
    samp = sampling.SamplingConfig.make(temperature=1.0)
    a = _propose(dr, hp, samp)
    b = _propose(dr2, hp2, samp)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.cache
def _propose_program(dr):
    """init + propose of drafter ``dr`` on a random context, jitted (params and sampling
    arguments: a drafter equal to ``dr`` runs the same program)."""
    model, tp = _target()
    cap, P = 16, 7
    toks = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, cap)), jnp.int32)
    feats = _jit_features(model)(tp, toks, None, layers=dr.feature_layers)[1]
    L = jnp.asarray([P, P - 2], jnp.int32)

    @jax.jit
    def run(hp, samp):
        st = dr.init(hp, toks[:, :P], L, cap, features_BPF=feats[:, :P])
        ctx = drafters.DraftContext(tokens_BS=toks, lengths_B=L, features=feats, target_cache=None)
        return dr.propose(hp, st, ctx, decoding.request_keys(jax.random.key(3), [0, 1]), 3, samp)[:2]

    return run


def _propose(dr, hp, samp):
    return _propose_program(dr)(hp, samp)
