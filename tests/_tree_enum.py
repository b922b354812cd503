"""Exact enumeration for tree verifiers: every draft-tree realisation with its probability under
the children mode, every branch of the walk's acceptance decisions, and the resulting exact law
of the committed tokens (no Monte Carlo).

Decisions are threshold tests: a tree verifier's ``walk`` reports, for every node it tested,
the probability ``a`` that the test passes given everything before (``TreeWalk``). Injecting
``u_n = 0`` makes a test pass iff ``a > 0`` and ``u_n = 1`` makes it fail, so running all
2^N vectors ``u in {0, 1}^N`` visits every branch. A run is *canonical* if every tested node
passed exactly when its uniform is 0 and every untested node has uniform 0; canonical runs are
the distinct branches, with probability ``prod_tested (a if passed else 1 - a)``. (A
non-canonical run is a branch of probability 0 seen through the other uniform, or a duplicate.)
That the reported ``a`` is the threshold actually used is checked separately in the tests.
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np

from specjax.trees import DraftTree, TreeShape


def path_tokens(parents, tokens, node):
    """Tokens from depth 1 down to ``node`` (-1: the empty path)."""
    out = []
    while node >= 0:
        out.append(int(tokens[node]))
        node = parents[node]
    return tuple(reversed(out))


def realisations(shape: TreeShape, mode: str, tree_q, vocab: int):
    """All draft trees of ``shape`` drawn from ``tree_q`` under ``mode``:
    list of (tokens, valid, probability). Without replacement, a child with no draft mass
    left (fewer tokens in q's support than children) is invalid, with its subtree."""
    parents, ranks, N = shape.parents, shape.ranks, shape.num_nodes
    out = []

    def rec(n, toks, valid, prob):
        if n == N:
            out.append((tuple(toks), tuple(valid), prob))
            return
        par = parents[n]
        if par >= 0 and not valid[par]:
            return rec(n + 1, toks + [0], valid + [False], prob)
        q = tree_q(path_tokens(parents, toks, par)).astype(np.float64)
        if mode == "deterministic":
            x = int(np.argsort(-q, kind="stable")[ranks[n]])
            return rec(n + 1, toks + [x], valid + [True], prob)
        if mode == "without_replacement":
            q = q.copy()
            for m in range(n):
                if parents[m] == par and valid[m]:
                    q[toks[m]] = 0.0
            if q.sum() <= 0:
                return rec(n + 1, toks + [0], valid + [False], prob)
            q = q / q.sum()
        for x in range(vocab):
            if q[x] > 0:
                rec(n + 1, toks + [x], valid + [True], prob * q[x])

    rec(0, [], [], 1.0)
    return out


def tree_inputs(shape: TreeShape, real, tree_p, tree_q):
    """Arrays (tokens_RN, valid_RN, prob_R, q_RN1V, p_RN1V) for a list of realisations."""
    parents = shape.parents
    tokens = np.array([r[0] for r in real], np.int32)
    valid = np.array([r[1] for r in real], bool)
    prob = np.array([r[2] for r in real], np.float64)
    paths = [[()] + [path_tokens(parents, t, n) for n in range(shape.num_nodes)] for t in tokens]
    q = np.array([[tree_q(pt) for pt in row] for row in paths], np.float32)
    p = np.array([[tree_p(pt) for pt in row] for row in paths], np.float32)
    return tokens, valid, prob, q, p


N_PAD = 6        # every enumerated tree is padded to this many nodes (invalid padding) ...
D_PAD = 3        # ... and this static depth, and V is fixed by the callers, so that one
CHUNK = 4096     # compilation per (verifier, mode) serves every case; rows per call


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(verifier, mode, u, key, tokens, parents, depths, valid, q, p):
    """The verifier as a static jit argument: its walk, its result with the uniforms ``u``
    injected, and its plain call with ``key``."""
    tree = DraftTree(tokens_BN=tokens, parents_BN=parents, depths_BN=depths, valid_BN=valid,
                     mode=mode, max_depth=D_PAD)
    return (verifier.walk(u, tree, q, p), verifier.verify_with_uniforms(u, key, tree, q, p),
            verifier(key, tree, q, p))


def chunk_key(key, c):
    """The key the rows ``c*CHUNK .. (c+1)*CHUNK - 1`` of `run_walks` are verified with."""
    return jax.random.fold_in(key, c)


def run_walks(verifier, shape: TreeShape, mode: str, u, tokens, valid, q, p, key=None):
    """``(walk, result, called)`` of ``verifier`` on the given rows: the walk and the result
    with the uniforms ``u`` injected, and the plain call. Trees are padded to ``N_PAD`` nodes
    (invalid, never tried) and rows to multiples of ``CHUNK`` (chunk c uses
    ``chunk_key(key, c)``), so one compilation serves every case; padding is dropped from
    the outputs (``path_BA`` and ``committed_BA1`` keep the padded depth ``D_PAD``)."""
    rows, N = tokens.shape
    assert N <= N_PAD and shape.max_depth <= D_PAD
    extra = N_PAD - N
    node_pad = lambda a, v: np.concatenate([a, np.full(a.shape[:1] + (extra,) + a.shape[2:], v, a.dtype)], 1)
    tokens, valid, u = node_pad(tokens, 0), node_pad(valid, False), node_pad(np.asarray(u, np.float32), 0)
    q, p = node_pad(q, 1.0 / q.shape[-1]), node_pad(p, 1.0 / p.shape[-1])
    parents = np.broadcast_to(np.array(shape.parents + (-1,) * extra, np.int32), (CHUNK, N_PAD))
    depths = np.broadcast_to(np.array(shape.depths + (1,) * extra, np.int32), (CHUNK, N_PAD))
    total = -(-rows // CHUNK) * CHUNK
    row_pad = lambda a: np.concatenate([a, np.repeat(a[:1], total - rows, axis=0)], axis=0)
    tokens, valid, u, q, p = map(row_pad, (tokens, valid, u, q, p))
    key = jax.random.key(0) if key is None else key
    outs = []
    for c in range(total // CHUNK):
        sl = slice(c * CHUNK, (c + 1) * CHUNK)
        outs.append(_run(verifier, mode, u[sl], chunk_key(key, c), tokens[sl], parents, depths,
                         valid[sl], q[sl], p[sl]))
    cat = lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=0)[:rows]
    walk, res, called = jax.tree.map(cat, *outs)
    walk = walk.replace(tested_BN=walk.tested_BN[:, :N], passed_BN=walk.passed_BN[:, :N],
                        accept_prob_BN=walk.accept_prob_BN[:, :N])
    return walk, res, called


class Outcomes:
    """Exact outcome distribution of one verifier on one tree law: rows are (realisation,
    canonical branch) pairs with probability ``weight``; each fixes the accepted path
    (``prefix``, ``n_accepted``) and the final token's distribution ``final``."""

    def __init__(self, weight, n_accepted, prefix, final, real_index, degenerate):
        self.weight, self.n_accepted, self.prefix, self.final = weight, n_accepted, prefix, final
        self.real_index, self.degenerate = real_index, degenerate

    @property
    def expected_accepted(self) -> float:
        return float(np.sum(self.weight * self.n_accepted))

    def committed_law(self, tree_p, vocab: int, length: int):
        """Exact law of the first ``length`` tokens: the committed tokens then, if fewer,
        target sampling (``tree_p``). Returns (law, target_law) over ``vocab**length``
        sequences in ``itertools.product`` order."""
        mass: dict = {}
        for w, pre, f in zip(self.weight, self.prefix, self.final):
            if w > 0:
                mass[pre] = mass.get(pre, 0.0) + w * f
        law, target = [], []
        for seq in itertools.product(range(vocab), repeat=length):
            t = [float(tree_p(seq[:j])[seq[j]]) for j in range(length)]
            target.append(np.prod(t))
            total = 0.0
            for k in range(min(length, max(len(pre) for pre in mass) + 1)):
                m = mass.get(seq[:k])
                if m is not None:
                    total += m[seq[k]] * np.prod(t[k + 1:])
            law.append(total)
        return np.array(law), np.array(target)


def exact_outcomes(verifier, shape: TreeShape, mode: str, tree_p, tree_q, vocab: int,
                   check_result: bool = True, verify_mode: str | None = None) -> Outcomes:
    """Enumerate realisations x decision branches (see the module doc) and check that the
    assembled ``TreeVerifyResult`` agrees with the walk on every branch. Trees are drawn
    under ``mode`` and handed to the verifier as ``verify_mode`` trees (default: the same;
    a different one makes a negative control)."""
    real = [r for r in realisations(shape, mode, tree_q, vocab) if r[2] > 0]
    tokens, valid, prob, q, p = tree_inputs(shape, real, tree_p, tree_q)
    N, R = shape.num_nodes, len(real)
    patterns = np.array(list(itertools.product([0.0, 1.0], repeat=N)), np.float32)   # [P, N]
    P = len(patterns)
    rep = lambda a: np.repeat(a, P, axis=0)
    u = np.tile(patterns, (R, 1))
    walk, res, _ = run_walks(verifier, shape, verify_mode or mode, u, rep(tokens), rep(valid), rep(q), rep(p))
    tested, passed, a = walk.tested_BN, walk.passed_BN, walk.accept_prob_BN.astype(np.float64)
    zero = u == 0
    canonical = np.all(np.where(tested, passed == zero, zero), axis=1)
    branch = np.prod(np.where(tested, np.where(passed, a, 1.0 - a), 1.0), axis=1)
    weight = np.where(canonical, rep(prob) * branch, 0.0)
    keep = weight > 0          # only the branches that happen matter from here on
    weight, walk_final = weight[keep], walk.final_dist_BV[keep]
    row_tokens, row_valid, last = rep(tokens)[keep], rep(valid)[keep], walk.last_node_B[keep]
    parents = np.array(shape.parents, np.int32)
    # The accepted path, deepest first, from the walk's last node.
    up, cur = [], last.copy()
    for _ in range(shape.max_depth):
        up.append(cur.copy())
        cur = np.where(cur >= 0, parents[np.maximum(cur, 0)], -1)
    up = np.stack(up, 1)
    n_acc = (up >= 0).sum(1)
    prefix = [tuple(int(row_tokens[i, n]) for n in up[i, :n_acc[i]][::-1]) for i in range(len(last))]
    if check_result:
        c = res.committed_BA1[keep]
        np.testing.assert_array_equal(res.last_node_B[keep], last)
        np.testing.assert_array_equal(res.n_accepted_B[keep], n_acc)
        np.testing.assert_array_equal(res.degenerate_residual_B, walk.degenerate_B)
        j = np.arange(c.shape[1])[None]
        path = res.path_BA[keep]
        assert ((path >= 0) == (j[:, :path.shape[1]] < n_acc[:, None])).all()
        on_path = np.take_along_axis(row_tokens, np.maximum(path, 0), 1)
        assert (np.where(path >= 0, c[:, :path.shape[1]] == on_path, True)).all()
        assert np.take_along_axis(row_valid, np.maximum(path, 0), 1)[path >= 0].all()
        final = np.take_along_axis(c, n_acc[:, None], 1)[:, 0]
        assert (np.take_along_axis(walk_final, final[:, None], 1) > 0).all(), "final token outside its law"
        assert (np.where(j > n_acc[:, None], c == -1, True)).all()
    assert np.isfinite(weight).all()
    np.testing.assert_allclose(np.sum(weight), 1.0, atol=1e-6)
    return Outcomes(weight, n_acc, prefix, walk_final.astype(np.float64),
                    np.repeat(np.arange(R), P)[keep], walk.degenerate_B[keep])
