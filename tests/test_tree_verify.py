"""Tree verifiers (greedy, recursive rejection, traversal): exactness by enumeration, multi-round
statistics with negative controls, expected accepted length, greedy decoding, the degenerate
residual rule, support, shapes / jit / vmap.

Exact tests (no Monte Carlo): `_tree_enum` enumerates every draft-tree realisation of a small
tree shape over V=3 or 4 (probability under the children mode) and every branch of the verifier's
acceptance decisions (injected uniforms 0 / 1 and the thresholds the walk reports), giving
the exact law of the committed tokens; extended by target sampling to D+1 tokens it must
equal the target's law (prefix-dependent p and q: every prefix has its own distribution).

Statistical tests: order-2 tabular target and draft over V=3 (`_tabular`); each round drafts a
tree from the draft table (iid / without replacement / deterministic top-k), verifies, commits,
and continues until every sequence has 2D+1 = 5 tokens; chi-square (cells of expected count < 5
pooled) against the exact target law of the 3^5 sequences, 100,000 sequences per test, fixed
seeds (1000 + case index; controls 7 and 8). Family: the 6 positive tests (recursive rejection
and traversal x 3 modes), family-wise false-alarm rate 1e-3, Bonferroni: each test at 1e-3 / 6.
The negative controls (wrong verifiers) must fail the same test at that level.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import sample
from specjax.trees import CHILDREN_MODES, DraftTree, TreeShape
from specjax.verify import (
    PAD_TOKEN,
    RESIDUAL_TOL,
    BlockVerifier,
    GreedyTreeVerifier,
    RecursiveRejectionVerifier,
    TokenVerifier,
    TraversalVerifier,
    TreeVerifyResult,
)

import _tabular as tab
import _tree_enum as te

V = 3
RRS = RecursiveRejectionVerifier()
TRAVERSAL = TraversalVerifier()
GREEDY = GreedyTreeVerifier()
VERIFIERS = {"rrs": RRS, "traversal": TRAVERSAL}
SHAPES = {
    "chain2": TreeShape.chain(2),
    "branch2": TreeShape.from_branching((2,)),
    "branch3": TreeShape.from_branching((3,)),
    "branch21": TreeShape.from_branching((2, 1)),
    "branch22": TreeShape.from_branching((2, 2)),
    "uneven": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)]),
    "second_child_deep": TreeShape.from_paths([(0,), (1,), (1, 0), (1, 1)]),
}


def _norm(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


def assert_exact(verifier, shape, mode, tree_p, tree_q, atol=1e-6):
    """The exact law of D+1 tokens after one round (then target sampling) equals the
    target's, and so does the first committed token's marginal. Returns the outcomes."""
    out = te.exact_outcomes(verifier, shape, mode, tree_p, tree_q, V)
    law, target = out.committed_law(tree_p, V, shape.max_depth + 1)
    np.testing.assert_allclose(law.reshape(V, -1).sum(1), tree_p(()), atol=atol)
    np.testing.assert_allclose(law, target, atol=atol)
    return out


# ---------------------------------------------------------------------------------------------
# Exactness by enumeration.


# branch22 (6 nodes: 3^6 realisations x 2^6 branches, 12 enumeration chunks of 4096 rows per
# full-support case, more than the other six shapes together) takes the sparse case only here
# (a few dozen realisations; invalid children without replacement). Its random and peaked cases
# add no structure: siblings under the first child are uneven's, siblings under the second
# child second_child_deep's, both with all three cases in every mode; branch22 with full-support
# (peaked) q is enumerated in `test_duplicate_siblings_are_enumerated_and_exact` (iid, both
# verifiers), and sampled by the multi-round statistics (rrs-deterministic) and the engine's
# chi-square tests (tests/test_engine_tree.py: BRANCHING, iid and without replacement).
BRANCH22_KINDS = ("sparse",)


@pytest.mark.parametrize("mode", CHILDREN_MODES)
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_exact_law_random_prefix_dependent(name, mode):
    """Every shape, random / peaked / sparse (exact zeros) prefix-dependent p and q (branch22:
    sparse, see BRANCH22_KINDS). iid enumerations include duplicate siblings (peaked q makes
    them likely); without replacement, a child with no draft mass left is invalid (sparse q)."""
    for shape_name, shape in SHAPES.items():
        for seed, kind in [(0, "random"), (1, "peaked"), (2, "sparse")]:
            if shape_name == "branch22" and kind not in BRANCH22_KINDS:
                continue
            assert_exact(VERIFIERS[name], shape, mode, tab.random_tree(seed, V, kind),
                         tab.random_tree(seed + 100, V, kind))


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_exact_law_vocab_4(mode):
    """The same over V=4 (smaller trees: the enumeration grows as V^N): branch3 (three children
    out of four tokens) and branch21 (two children, each with a child: a chain of 2 under a
    branching root, so chain2's and branch2's cases occur within it; each of those was a
    4096-row enumeration chunk of its own)."""
    for verifier in VERIFIERS.values():
        for shape_name in ["branch3", "branch21"]:
            for seed, kind in [(3, "random"), (4, "sparse")]:
                out = te.exact_outcomes(verifier, SHAPES[shape_name], mode, tab.random_tree(seed, 4, kind),
                                        tab.random_tree(seed + 100, 4, kind), 4)
                law, target = out.committed_law(tab.random_tree(seed, 4, kind), 4,
                                                SHAPES[shape_name].max_depth + 1)
                np.testing.assert_allclose(law, target, atol=1e-6)


def _fixed(dist):
    return lambda prefix: dist


def _perturbed(tree_p, scale):
    def tree(prefix):
        rng = np.random.default_rng([7, len(prefix), *prefix])
        return _norm(tree_p(prefix) * (1 + scale * rng.uniform(-1, 1, V)))
    return tree


def _special_cases():
    tp = tab.random_tree(5, V)
    onehot = lambda prefix: np.eye(V, dtype=np.float32)[(len(prefix) + sum(prefix)) % V]
    return {
        "p_equals_q": (tp, tp),
        "p_near_q": (tp, _perturbed(tp, 1e-6)),     # residual masses ~1e-7: the rule fires
        "one_hot_q": (tp, onehot),
        "one_hot_p": (onehot, tp),
        "disjoint": (_fixed(_norm([0.7, 0.3, 0.0])), _fixed(_norm([0.0, 0.0, 1.0]))),
        "disjoint_2": (_fixed(_norm([1.0, 0.0, 0.0])), _fixed(_norm([0.0, 0.4, 0.6]))),
    }


@pytest.mark.parametrize("case", list(_special_cases()))
def test_exact_law_special_distributions(case):
    """p == q exactly and up to ~1e-7 (the degenerate rule fires; its bias stays below 1e-6),
    one-hot q or p, disjoint supports; both verifiers, all modes, two shapes: branch21 and uneven
    (a chain's cases, a node with a single child and a node with no sibling, are branch21's
    depth-1 and depth-2 nodes and uneven's node 1 -> (1, 0); chain2 on its own added a 4096-row
    enumeration per verifier, mode and case)."""
    tree_p, tree_q = _special_cases()[case]
    for verifier in VERIFIERS.values():
        for mode in CHILDREN_MODES:
            for shape_name in ["branch21", "uneven"]:
                out = assert_exact(verifier, SHAPES[shape_name], mode, tree_p, tree_q)
                if case == "p_near_q" and mode != "deterministic":
                    assert (out.degenerate > 0).any()      # the degenerate rule was exercised
                if case == "p_equals_q" and mode != "deterministic":
                    # p == q: the first child is always accepted, down to a leaf.
                    assert out.expected_accepted == pytest.approx(SHAPES[shape_name].max_depth)


def test_duplicate_siblings_are_enumerated_and_exact():
    """iid children repeat tokens; both verifiers stay exact, and the realisations with a
    duplicate carry real probability mass."""
    tp, tq = tab.random_tree(3, V, "peaked"), tab.random_tree(4, V, "peaked")
    shape = SHAPES["branch22"]
    real = te.realisations(shape, "iid", tq, V)
    dup = sum(r[2] for r in real if r[0][0] == r[0][1])
    assert dup > 0.2
    for verifier in VERIFIERS.values():
        assert_exact(verifier, shape, "iid", tp, tq)


@dataclasses.dataclass(frozen=True)
class NoResidualRRS(RecursiveRejectionVerifier):
    """WRONG on purpose: recursive rejection without the residual update -- after a rejection
    the next sibling (and the final token) still use the node's target p. (A tolerance above
    any mass makes ``normalize_residual`` always return its fallback, the node's p.)"""

    residual_tol: float = 2.0


def test_exact_enumeration_detects_wrong_rules():
    """The enumeration test can fail: the negative controls deviate from the target law, and
    the right rules on the same case do not. (Over 3 tokens the with-replacement rule can be
    exact by accident on without-replacement children, e.g. when the residual after the first
    rejection is a point mass; here p > q on two tokens.)"""
    tp, tq = _fixed(_norm([0.2, 0.4, 0.4])), _fixed(_norm([0.6, 0.3, 0.1]))
    shape = SHAPES["branch21"]
    for verifier, mode, draw_mode in [(NoResidualRRS(), "iid", "iid"),
                                      (RRS, "iid", "without_replacement"),
                                      (TRAVERSAL, "iid", "without_replacement")]:
        out = te.exact_outcomes(verifier, shape, draw_mode, tp, tq, V, verify_mode=mode)
        law, target = out.committed_law(tp, V, shape.max_depth + 1)
        assert np.abs(law - target).max() > 1e-3, (verifier, mode, draw_mode)
    for verifier in VERIFIERS.values():      # the right rules on the same case are exact
        for mode in ["iid", "without_replacement"]:
            assert_exact(verifier, shape, mode, tp, tq)


def test_reported_thresholds_are_the_ones_used():
    """The enumeration trusts ``TreeWalk.accept_prob_BN``: check it against the decisions
    for random uniforms (a tested node passes iff u < accept_prob)."""
    rng = np.random.default_rng(0)
    shape = SHAPES["uneven"]
    for name, verifier in {**VERIFIERS, "greedy": GREEDY}.items():
        for mode in CHILDREN_MODES if name != "greedy" else ["iid"]:
            tree_p, tree_q = tab.random_tree(0, V), tab.random_tree(1, V)
            real = te.realisations(shape, mode, tree_q, V)
            tokens, valid, _, q, p = te.tree_inputs(shape, [real[i] for i in rng.choice(len(real), 512)],
                                                     tree_p, tree_q)
            u = rng.random((512, shape.num_nodes)).astype(np.float32)
            walk, _, _ = te.run_walks(verifier, shape, mode, u, tokens, valid, q, p)
            t = walk.tested_BN
            clear = np.abs(u - walk.accept_prob_BN) > 1e-6
            np.testing.assert_array_equal(walk.passed_BN[t & clear], (u < walk.accept_prob_BN)[t & clear])
            assert not walk.passed_BN[~t].any()
            assert t.any(axis=1).all()


# ---------------------------------------------------------------------------------------------
# Expected accepted length.


def test_traversal_accepts_at_least_as_much_as_recursive_rejection():
    """Exact E[accepted] on random small trees (iid and without replacement): traversal >=
    recursive rejection, strictly more on some. 32 (p, q) pairs: 2 modes x 4 shapes x 2 seeds
    (p from seed + 10, q from seed + 20) x random / peaked, each pair two exact enumerations (no
    sampling, so no false-alarm rate; 64 pairs before, the same shapes and modes). The strict
    gain > 0.01 needs one pair, e.g. a chain2 pair where block verification beats token
    verification (`test_chain_paper_example`: 2/9)."""
    gains = []
    for mode in ["iid", "without_replacement"]:
        for shape_name in ["chain2", "branch21", "uneven", "second_child_deep"]:
            for seed in range(2):
                for kind in ["random", "peaked"]:
                    tp, tq = tab.random_tree(seed + 10, V, kind), tab.random_tree(seed + 20, V, kind)
                    acc = {n: te.exact_outcomes(v, SHAPES[shape_name], mode, tp, tq, V,
                                                check_result=False).expected_accepted
                           for n, v in VERIFIERS.items()}
                    assert acc["traversal"] >= acc["rrs"] - 1e-6, (mode, shape_name, seed, kind, acc)
                    gains.append(acc["traversal"] - acc["rrs"])
    assert max(gains) > 0.01


BLOCK = jax.jit(BlockVerifier())
TOKEN = jax.jit(TokenVerifier())


def _padded_rows(linear):
    """A linear verifier on ``te.CHUNK`` rows (one compilation for every call here)."""
    def call(key, draft, q, p):
        n = draft.shape[0]
        pad = lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[:1], te.CHUNK - n, 0)])
        return jax.tree.map(lambda a: a[:n], linear(key, pad(draft), pad(q), pad(p)))
    return call


def test_chain_traversal_is_block_and_recursive_rejection_is_token():
    """On a chain of 3, exact E[accepted]: traversal == block verification >= recursive
    rejection == token verification (the linear ones enumerated independently by `_tabular`)."""
    shape = TreeShape.chain(3)
    for seed in range(3):
        for kind in ["random", "peaked"]:
            tp, tq = tab.random_tree(seed, V, kind), tab.random_tree(seed + 50, V, kind)
            _, _, block = tab.exact_round_then_target(_padded_rows(BLOCK), "block", tp, tq, V, 3)
            _, _, token = tab.exact_round_then_target(_padded_rows(TOKEN), "token", tp, tq, V, 3)
            trav = assert_exact(TRAVERSAL, shape, "iid", tp, tq).expected_accepted
            rrs = assert_exact(RRS, shape, "iid", tp, tq).expected_accepted
            assert trav == pytest.approx(block, abs=1e-6)
            assert rrs == pytest.approx(token, abs=1e-6)
            assert block >= token - 1e-6


def test_chain_paper_example():
    """Sun et al. Sec. 1 (binary target (1/3, 2/3), draft (2/3, 1/3), 2 draft tokens; here with
    a third token of probability 0): token-level accepts 10/9 per round, block 11/9."""
    tp, tq = _fixed(_norm([1 / 3, 2 / 3, 0])), _fixed(_norm([2 / 3, 1 / 3, 0]))
    shape = SHAPES["chain2"]
    assert assert_exact(TRAVERSAL, shape, "iid", tp, tq).expected_accepted == pytest.approx(11 / 9, abs=1e-6)
    assert assert_exact(RRS, shape, "iid", tp, tq).expected_accepted == pytest.approx(10 / 9, abs=1e-6)


def test_chain_same_key_same_tokens_as_linear_verifiers():
    """With the same key (hence the same uniforms), traversal on a chain commits exactly what
    BlockVerifier commits, and recursive rejection exactly what TokenVerifier commits."""
    gamma, batch = 3, te.CHUNK
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V), size=(batch, gamma + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=(batch, gamma + 1)).astype(np.float32)
    draft = (rng.random((batch, gamma, 1)) > np.cumsum(q[:, :gamma], -1)).sum(-1).clip(0, V - 1)
    draft = draft.astype(np.int32)
    shape = TreeShape.chain(gamma)
    for seed in range(2):
        key = jax.random.key(seed)
        for tree_v, linear in [(TRAVERSAL, BLOCK), (RRS, TOKEN)]:
            _, _, rt = te.run_walks(tree_v, shape, "iid", np.zeros((batch, gamma)), draft,
                                    np.ones((batch, gamma), bool), q, p, key=key)
            rl = linear(te.chunk_key(key, 0), draft, q[:, :gamma], p)
            np.testing.assert_array_equal(rt.n_accepted_B, rl.n_accepted_B)
            np.testing.assert_array_equal(rt.committed_BA1, rl.committed_BG1)
            np.testing.assert_array_equal(rt.degenerate_residual_B, rl.degenerate_residual_B)
            assert 0.5 < float(np.mean(rl.n_accepted_B)) < gamma - 0.5


# ---------------------------------------------------------------------------------------------
# Multi-round statistics.

FAMILY_WISE_ALPHA = 1e-3
FAMILY_SIZE = 6
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / FAMILY_SIZE
NUM_SEQUENCES = 100_000
# A sharper draft than `_tabular`'s (per-token acceptance ~0.5): rejections of first children
# are common, so the later siblings (where the modes differ) matter.
DRAFT_TABLE = (0.3 * tab.TARGET_TABLE + 0.7 * tab.peaked_tables(33, sharpness=4.0)).astype(np.float32)


def make_tree_round(verifier, shape, draw_mode, verify_mode, n_buf):
    """A jitted round on order-2 tables: draft a tree of ``shape`` from DRAFT_TABLE under
    ``draw_mode`` (iid draws / draws without replacement / deterministic top-k), verify it
    as a ``verify_mode`` tree, write the committed tokens."""
    P, Q = jnp.asarray(tab.TARGET_TABLE), jnp.asarray(DRAFT_TABLE)
    parents, ranks, N, D = shape.parents, shape.ranks, shape.num_nodes, shape.max_depth

    @jax.jit
    def one_round(key, buf_SL, len_S):
        rows = jnp.arange(buf_SL.shape[0])
        draft_key, verify_key = jax.random.split(key)
        keys = jax.random.split(draft_key, N)
        ctx = {-1: (buf_SL[rows, len_S - 2], buf_SL[rows, len_S - 1])}
        toks = []
        for n in range(N):
            q_SV = Q[ctx[parents[n]]]
            if draw_mode == "deterministic":
                x = jnp.argsort(-q_SV, axis=-1, stable=True)[:, ranks[n]]
            else:
                if draw_mode == "without_replacement":
                    for m in range(n):
                        if parents[m] == parents[n]:
                            q_SV = jnp.where(jnp.arange(V)[None] == toks[m][:, None], 0.0, q_SV)
                x = sample(keys[n], q_SV)        # Gumbel-argmax: needs no normalisation
            toks.append(x.astype(jnp.int32))
            ctx[n] = (ctx[parents[n]][1], toks[-1])
        slots = [-1, *range(N)]
        q_SN1V = jnp.stack([Q[ctx[s]] for s in slots], 1)
        p_SN1V = jnp.stack([P[ctx[s]] for s in slots], 1)
        tree = DraftTree.from_shape(shape, jnp.stack(toks, 1), verify_mode)
        res = verifier(verify_key, tree, q_SN1V, p_SN1V)
        slot = len_S[:, None] + jnp.arange(D + 1)[None]
        slot = jnp.where(res.committed_BA1 != PAD_TOKEN, slot, n_buf)
        buf_SL = buf_SL.at[rows[:, None], slot].set(res.committed_BA1, mode="drop")
        return buf_SL, len_S + res.n_accepted_B + 1, res.n_accepted_B

    return one_round


def generate(verifier, shape, draw_mode, verify_mode=None, seed=0, n_seq=NUM_SEQUENCES):
    n_tokens = 2 * shape.max_depth + 1
    n_buf = len(tab.START) + n_tokens + shape.max_depth + 1
    one_round = make_tree_round(verifier, shape, draw_mode, verify_mode or draw_mode, n_buf)
    buf = jnp.zeros((n_seq, n_buf), jnp.int32).at[:, : len(tab.START)].set(jnp.asarray(tab.START))
    length = jnp.full((n_seq,), len(tab.START), jnp.int32)
    key, accepted = jax.random.key(seed), []
    while int(jnp.min(length)) < len(tab.START) + n_tokens:
        key, sub = jax.random.split(key)
        buf, length, n_acc = one_round(sub, buf, length)
        accepted.append(np.asarray(n_acc))
    seqs = np.asarray(buf[:, len(tab.START): len(tab.START) + n_tokens])
    return seqs, n_tokens, float(np.concatenate(accepted).mean())


STAT_CASES = {  # (verifier, shape, mode)
    "rrs-iid": (RRS, "branch21", "iid"),
    "rrs-without_replacement": (RRS, "branch21", "without_replacement"),
    "rrs-deterministic": (RRS, "branch22", "deterministic"),
    "traversal-iid": (TRAVERSAL, "uneven", "iid"),
    "traversal-without_replacement": (TRAVERSAL, "uneven", "without_replacement"),
    "traversal-deterministic": (TRAVERSAL, "branch21", "deterministic"),
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_multi_round_sequences_match_target_law(case):
    verifier, shape_name, mode = STAT_CASES[case]
    seqs, n_tokens, mean_acc = generate(verifier, SHAPES[shape_name], mode,
                                        seed=1000 + list(STAT_CASES).index(case))
    pvalue = tab.sequence_pvalue(seqs, n_tokens)
    print(f"\n[{case}] {shape_name}, {NUM_SEQUENCES} sequences of {n_tokens} tokens: mean accepted/round "
          f"{mean_acc:.3f}, p-value {pvalue:.3g} (threshold {PER_TEST_ALPHA:.3g})")
    assert 0.3 < mean_acc < SHAPES[shape_name].max_depth - 0.2   # rejections are common
    assert pvalue > PER_TEST_ALPHA


@pytest.mark.parametrize("control", ["no_residual_update", "iid_rule_on_without_replacement"])
def test_multi_round_negative_controls_are_detected(control):
    """Same generator, same chi-square test, wrong verifier: must be rejected."""
    if control == "no_residual_update":
        seqs, n_tokens, _ = generate(NoResidualRRS(), SHAPES["branch21"], "iid", seed=7)
    else:  # children drawn without replacement, verified with the with-replacement rule
        seqs, n_tokens, _ = generate(RRS, SHAPES["branch21"], "without_replacement", "iid", seed=8)
    pvalue = tab.sequence_pvalue(seqs, n_tokens)
    print(f"\n[negative control {control}] p-value {pvalue:.3g} (must be < {PER_TEST_ALPHA:.3g})")
    assert pvalue < PER_TEST_ALPHA


# ---------------------------------------------------------------------------------------------
# Greedy.


def _greedy_reference(parents, tokens, valid, p):
    cur, path = -1, []
    while True:
        best = int(np.argmax(p[cur + 1]))
        nxt = [n for n in range(len(parents)) if parents[n] == cur and valid[n] and tokens[n] == best]
        if not nxt:
            return path, best
        cur = nxt[0]
        path.append(cur)


def test_greedy_follows_target_argmax():
    """Committed tokens == following the target argmax down the tree (first matching valid
    child), then the argmax at the last node: greedy target decoding. Ties in p resolve to the
    lowest token; duplicate matching children to the lowest node."""
    rng = np.random.default_rng(1)
    shape = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    B, N = 512, shape.num_nodes
    p = rng.dirichlet(np.ones(V), size=(B, N + 1)).astype(np.float32)
    p[::4] = _norm([0.4, 0.4, 0.2])                      # ties: token 0 wins
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    for n, par in enumerate(shape.parents):              # make argmax children common
        hit = rng.random(B) < 0.6
        tokens[hit, n] = p[hit, par + 1].argmax(-1)
    valid = rng.random((B, N)) < 0.9
    _, res, called = te.run_walks(GREEDY, shape, "iid", np.zeros((B, N)), tokens, valid, p, p)
    chex.assert_trees_all_equal(res, called)
    for b in range(B):
        path, final = _greedy_reference(shape.parents, tokens[b], valid[b], p[b])
        n = len(path)
        assert res.n_accepted_B[b] == n
        np.testing.assert_array_equal(res.path_BA[b, :n], path)
        assert (res.path_BA[b, n:] == -1).all()
        np.testing.assert_array_equal(res.committed_BA1[b, :n], tokens[b, path])
        assert res.committed_BA1[b, n] == final and (res.committed_BA1[b, n + 1:] == PAD_TOKEN).all()
        assert res.last_node_B[b] == (path[-1] if path else -1)
    np.testing.assert_array_equal(res.degenerate_residual_B, 0)
    assert np.mean(res.n_accepted_B) > 1.0 and (res.n_accepted_B == 3).any()


def test_greedy_ties_and_duplicate_children():
    shape = SHAPES["branch2"]
    p = np.array([[[0.4, 0.4, 0.2], [1, 0, 0], [0, 0.5, 0.5]]] * 2, np.float32)
    # Row 0: children (1, 0), argmax tie -> token 0 -> node 1. Row 1: duplicate children
    # (0, 0) -> the first, node 0.
    tokens = np.array([[1, 0], [0, 0]], np.int32)
    _, res, _ = te.run_walks(GREEDY, shape, "iid", np.zeros((2, 2)), tokens, np.ones((2, 2), bool), p, p)
    np.testing.assert_array_equal(res.path_BA[:, 0], [1, 0])
    np.testing.assert_array_equal(res.committed_BA1[:, :2], [[0, 1], [0, 0]])
    np.testing.assert_array_equal(res.tested_accept_BA[:, 0], [0.0, 1.0])   # first child vs argmax


# ---------------------------------------------------------------------------------------------
# The degenerate-residual rule.


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_degenerate_residual_rule_applies_and_is_counted(name):
    """A 2-chain with the same p and q at every node and uniforms 1 (every test fails):
    (a) q == p: every residual has mass 0; (b) q a few ulps from p: mass ~1e-8 <= tau. The
    final token comes from the fallback p at the root, and the degenerate residual used for
    it is counted once (traversal's other degenerate residual, at node 0, is never used: node
    0's updated weight is ~0 and it has no other child). (c) an ordinary uniform: everything
    accepted, nothing counted."""
    rng = np.random.default_rng(0)
    p = _norm(rng.dirichlet(np.ones(V)))
    x, y = int(np.argmax(p)), int(np.argsort(p)[-2])
    q_ulp = p.copy()
    for _ in range(3):
        q_ulp[x] = np.nextafter(q_ulp[x], np.float32(1))
        q_ulp[y] = np.nextafter(q_ulp[y], np.float32(0))
    assert 0 < np.maximum(p - q_ulp, 0).sum() <= RESIDUAL_TOL
    q = np.stack([np.broadcast_to(d, (3, V)) for d in (p, q_ulp, q_ulp)])
    pp = np.broadcast_to(p, (3, 3, V))
    u = np.array([[1.0, 1.0], [1.0, 1.0], [0.5, 0.5]], np.float32)
    walk, res, _ = te.run_walks(VERIFIERS[name], SHAPES["chain2"], "iid", u,
                                np.full((3, 2), x, np.int32), np.ones((3, 2), bool), q, pp)
    np.testing.assert_array_equal(res.n_accepted_B, [0, 0, 2])
    np.testing.assert_array_equal(res.degenerate_residual_B, [1, 1, 0])
    np.testing.assert_array_equal(walk.final_dist_BV[:2], np.stack([p, p]))   # the fallback: p
    np.testing.assert_array_equal(walk.final_dist_BV[2], p)                   # the bonus


# ---------------------------------------------------------------------------------------------
# Support, shapes, jit, vmap.


def _random_rows(seed, shape, B=512, sparse_p=False, tiny_q=False):
    """Random trees (10% invalid nodes) with random p and q, as arrays for `run_walks`."""
    rng = np.random.default_rng(seed)
    N = shape.num_nodes
    p = rng.dirichlet(np.ones(V), size=(B, N + 1))
    if sparse_p:
        p = p * (rng.random(p.shape) < 0.5)
        p[..., 0] += p.sum(-1) == 0
        p = p / p.sum(-1, keepdims=True)
    p = p.astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=(B, N + 1)).astype(np.float32)
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    if tiny_q:   # q at half the drafted tokens is 0 or the subnormal 1e-40
        slot = np.array(shape.parents) + 1
        for b in range(B):
            for n in np.flatnonzero(rng.random(N) < 0.5):
                q[b, slot[n], tokens[b, n]] = rng.choice([0.0, 1e-40])
        assert 0 < q[q > 0].min() < 1e-38   # subnormals survive
    valid = rng.random((B, N)) < 0.9
    u = rng.random((B, N)).astype(np.float32)
    return u, tokens, valid, q, p


@pytest.mark.parametrize("mode", CHILDREN_MODES)
def test_committed_tokens_lie_in_target_support(mode):
    """p has zeros; drafted tokens include ones outside p's support whose q is 0 or the
    subnormal 1e-40. Every accepted token has p > 0 at its parent and the final token p > 0 at
    the last node, for every verifier (injected uniforms and the plain call)."""
    shape = SHAPES["uneven"]
    u, tokens, valid, q, p = _random_rows(2, shape, B=2048, sparse_p=True, tiny_q=True)
    for name, verifier in {**VERIFIERS, "greedy": GREEDY}.items():
        if name == "greedy" and mode != "iid":
            continue
        _, res, called = te.run_walks(verifier, shape, mode, u, tokens, valid, q, p, key=jax.random.key(3))
        for r in (res, called):
            n = r.n_accepted_B
            slots = np.concatenate([np.zeros((len(n), 1), int), r.path_BA + 1], 1)   # parent slots
            j = np.arange(r.committed_BA1.shape[1])[None]
            tok = np.maximum(r.committed_BA1, 0)
            prob = p[np.arange(len(n))[:, None], np.maximum(slots, 0)[:, : tok.shape[1]], tok]
            assert (prob[j <= n[:, None]] > 0).all(), name
            assert (r.committed_BA1[j > n[:, None]] == PAD_TOKEN).all()


@pytest.mark.parametrize("name", ["rrs", "traversal", "greedy"])
def test_shapes_call_and_row_independence(name):
    """Field shapes and dtypes; the plain call equals the call with the uniforms its key
    yields (one key per row, split into an acceptance and a replacement key); a row's result
    does not depend on the other rows; the accepted path is valid and matches the tokens."""
    verifier = {**VERIFIERS, "greedy": GREEDY}[name]
    shape = SHAPES["uneven"]
    B, N, D = 512, shape.num_nodes, te.D_PAD
    u, tokens, valid, q, p = _random_rows(0, shape, B)
    key = jax.random.key(3)
    _, res, called = te.run_walks(verifier, shape, "iid", u, tokens, valid, q, p, key=key)
    assert isinstance(called, TreeVerifyResult)
    for field, shp, dtype in [("n_accepted_B", (B,), np.int32), ("path_BA", (B, D), np.int32),
                              ("committed_BA1", (B, D + 1), np.int32), ("last_node_B", (B,), np.int32),
                              ("degenerate_residual_B", (B,), np.int32),
                              ("tested_accept_BA", (B, D), np.float32), ("tested_BA", (B, D), np.bool_)]:
        assert getattr(called, field).shape == shp and getattr(called, field).dtype == dtype, field
    row_keys = jax.random.split(te.chunk_key(key, 0), (te.CHUNK, 2))
    u_key = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (te.N_PAD,), jnp.float32))(row_keys[:, 0]))
    _, again, _ = te.run_walks(verifier, shape, "iid", u_key[:B, :N], tokens, valid, q, p, key=key)
    chex.assert_trees_all_equal(called, again)
    # Row independence: other rows' inputs do not change a row's result.
    u2, tokens2, valid2, q2, p2 = _random_rows(1, shape, B)
    mix = lambda a, b: np.concatenate([a[:B // 2], b[B // 2:]])
    _, res2, called2 = te.run_walks(verifier, shape, "iid", mix(u, u2), mix(tokens, tokens2),
                                    mix(valid, valid2), mix(q, q2), mix(p, p2), key=key)
    for r, r2 in [(res, res2), (called, called2)]:
        half = lambda t: jax.tree.map(lambda a: a[:B // 2], t)
        chex.assert_trees_all_equal(half(r), half(r2))
    assert not np.array_equal(called.committed_BA1[B // 2:], called2.committed_BA1[B // 2:])
    # Invalid nodes are never on the path; path and committed tokens agree; PAD after.
    for r in (res, called):
        for b in range(B):
            n = r.n_accepted_B[b]
            path = r.path_BA[b, :n]
            assert valid[b, path].all() and (r.path_BA[b, n:] == -1).all()
            np.testing.assert_array_equal(r.committed_BA1[b, :n], tokens[b, path])
            assert (r.committed_BA1[b, n + 1:] == PAD_TOKEN).all()
            assert r.last_node_B[b] == (path[-1] if n else -1)


def test_vmap_over_batches_equals_a_loop():
    shape = SHAPES["branch21"]
    keys = jax.random.split(jax.random.key(4), 2)
    trees, qs, ps = [], [], []
    for seed in range(2):
        _, tokens, valid, q, p = _random_rows(seed, shape, B=4)
        trees.append(DraftTree.from_shape(shape, jnp.asarray(tokens), "without_replacement",
                                          jnp.asarray(valid)))
        qs.append(q)
        ps.append(p)
    stack = lambda *xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)

    @jax.jit
    def both(keys, tree, q, p):
        return {n: jax.vmap(v)(keys, tree, q, p) for n, v in {**VERIFIERS, "greedy": GREEDY}.items()}

    @jax.jit
    def one(key, tree, q, p):
        return {n: v(key, tree, q, p) for n, v in {**VERIFIERS, "greedy": GREEDY}.items()}

    out = both(keys, stack(*trees), stack(*qs), stack(*ps))
    for i in range(2):
        chex.assert_trees_all_equal(jax.tree.map(lambda a: a[i], out), one(keys[i], trees[i], qs[i], ps[i]))


def test_verifiers_are_hashable_static_arguments_and_check_the_mode():
    for cls in (GreedyTreeVerifier, RecursiveRejectionVerifier, TraversalVerifier):
        assert cls() == cls() and hash(cls()) == hash(cls())
    assert RecursiveRejectionVerifier(residual_tol=0.1) != RRS
    shape = SHAPES["branch21"]
    _, tokens, valid, q, p = _random_rows(0, shape, B=4)
    tree = DraftTree.from_shape(shape, jnp.asarray(tokens), "iid", jnp.asarray(valid))
    bad = tree.replace(mode="bogus")
    for v in (GREEDY, RRS, TRAVERSAL):
        with pytest.raises(ValueError, match=f"{type(v).__name__}.*'bogus'"):
            v(jax.random.key(0), bad, q, p)
        with pytest.raises(ValueError, match="p_BN1V"):
            v(jax.random.key(0), tree, q, p[:, :-1])


@pytest.mark.parametrize("mode", CHILDREN_MODES)
def test_tested_accept_is_first_child_ratio_along_the_path(mode):
    """Column j: the path's depth-j node (root for j = 0) if it has a valid child: min(1,
    p(x)/q(x)) of its first valid child at the node's own p (deterministic: q = one-hot);
    greedy: 1[x == argmax p]; 0 and untested elsewhere."""
    shape = SHAPES["uneven"]
    u, tokens, valid, q, p = _random_rows(5, shape, B=256)
    parents, B = shape.parents, 256
    for name, verifier in {**VERIFIERS, "greedy": GREEDY}.items():
        if name == "greedy" and mode != "iid":
            continue
        _, res, _ = te.run_walks(verifier, shape, mode, u, tokens, valid, q, p)
        assert res.tested_BA[:, 0].any() and res.tested_BA[:, 1].any()
        for b in range(B):
            n = res.n_accepted_B[b]
            for j in range(te.D_PAD):
                node = -1 if j == 0 else res.path_BA[b, j - 1]
                kids = [m for m in range(shape.num_nodes) if parents[m] == node and valid[b, m]]
                on = j <= n and bool(kids)
                assert res.tested_BA[b, j] == on, (name, b, j)
                if not on:
                    assert res.tested_accept_BA[b, j] == 0
                    continue
                x, slot = tokens[b, kids[0]], node + 1
                if name == "greedy":
                    want = float(x == p[b, slot].argmax())
                else:
                    qx = 1.0 if mode == "deterministic" else q[b, slot, x]
                    want = min(1.0, p[b, slot, x] / qx)
                assert res.tested_accept_BA[b, j] == pytest.approx(want, rel=1e-6), (name, b, j)
