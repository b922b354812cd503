"""Exact verification of draft *trees* (`specjax.trees.DraftTree`): the result type, the shared
walk-then-draw machinery, and the greedy and recursive-rejection verifiers.

Every tree verifier is a frozen (hashable) dataclass, usable as a static ``jax.jit`` argument::

    verifier(key, tree, q_BN1V, p_BN1V) -> TreeVerifyResult

* ``q_BN1V[:, 0]``: the draft distribution the root's children were drawn from;
  ``q_BN1V[:, n + 1]``: the one node n's children were drawn from (rows of leaves unused).
  How child k of a node relates to it is ``tree.mode``: ``"iid"`` (each child drawn from it),
  ``"without_replacement"`` (from it with the earlier siblings' tokens removed and
  renormalised), ``"deterministic"`` (a function of the context: each child's proposal is the
  one-hot of its own token, ``q_BN1V`` is informative only).
* ``p_BN1V[:, 0]``: the target distribution after the committed prefix;
  ``p_BN1V[:, n + 1]``: the target distribution after node n's path.

A verifier first *walks* the tree with one acceptance uniform per node (``walk``), which fixes
the accepted path and the distribution of the one final token, then draws that token.
``verify_with_uniforms(u_BN, key, ...)`` is the call with the uniforms injected; ``__call__``
draws them exactly as the linear verifiers do (``key`` -> one key per row -> an acceptance key
for the N uniforms and a replacement key for the final token; no reuse between the two).
Invalid nodes (``tree.valid_BN`` False) are never tried or accepted. The children mode is
checked at trace time: a verifier raises ``ValueError`` for a mode it is not exact for.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.sampling import argmax
from specjax.trees import CHILDREN_MODES, DraftTree, path_nodes
from specjax.verify._residual import RESIDUAL_TOL, normalize_residual
from specjax.verify._result import PAD_TOKEN, row_keys, row_uniforms, sample_rows


@struct.dataclass
class TreeVerifyResult:
    """Outcome of verifying one draft tree per row (shape-suffixed; A = ``tree.max_depth``).

    Attributes:
      n_accepted_B: int32 in ``[0, A]``: accepted drafted nodes on the path.
      path_BA: int32 ``[B, A]``: the accepted node indices by depth, -1 after the path.
      committed_BA1: int32 ``[B, A+1]``: the accepted nodes' tokens, then one final token
        (replacement or bonus), then ``PAD_TOKEN``.
      last_node_B: int32: the node whose (possibly residual) target distribution the final
        token came from (-1 = the root); the deepest node of the path.
      degenerate_residual_B: int32: degenerate residuals (``normalize_residual``'s rule) used in
        the row -- a residual whose mass was at most the tolerance and that then served as a
        node's target (a later child was tested against it, or the final token drawn from it).
        On a chain this is what the linear verifiers count.
      tested_accept_BA: float32 ``[B, A]``: for the root (column 0) and each accepted node of
        the path (column = its depth) that has a valid child, the acceptance probability
        ``min(1, p(x) / q_1(x))`` of its FIRST child x at the node's own target p (q_1: the
        proposal of a first child under the tree's mode; greedy: ``1[x == argmax p]``), an
        estimate of the acceptance rate alpha; 0 where ``tested_BA`` is False.
      tested_BA: bool ``[B, A]``: which entries of ``tested_accept_BA`` are meaningful.
    """

    n_accepted_B: jax.Array
    path_BA: jax.Array
    committed_BA1: jax.Array
    last_node_B: jax.Array
    degenerate_residual_B: jax.Array
    tested_accept_BA: jax.Array
    tested_BA: jax.Array

    @property
    def num_committed_B(self) -> jax.Array:
        """Tokens committed per row: ``n_accepted_B + 1``."""
        return self.n_accepted_B + 1


@struct.dataclass
class TreeWalk:
    """A tree walk before the final token is drawn (what ``walk`` returns).

    Attributes:
      last_node_B: int32: the deepest accepted node (-1 = the root).
      final_dist_BV: float32 ``[B, V]``: the distribution the final token is drawn from.
      degenerate_B: int32: degenerate residuals used (see ``TreeVerifyResult``).
      tested_BN: bool ``[B, N]``: the nodes whose acceptance test ran.
      accept_prob_BN: float32 ``[B, N]``: for a tested node, the probability that its test
        passes given everything decided before it (the test is ``u_n < accept_prob`` in
        distribution; ``u_n = 0`` passes iff it is > 0, ``u_n = 1`` never passes); 0 elsewhere.
      passed_BN: bool ``[B, N]``: tested and passed.
    """

    last_node_B: jax.Array
    final_dist_BV: jax.Array
    degenerate_B: jax.Array
    tested_BN: jax.Array
    accept_prob_BN: jax.Array
    passed_BN: jax.Array


# ---------------------------------------------------------------------------------------------
# Shared helpers.


def child_proposal(q_V: jax.Array, x: jax.Array, mode: str) -> jax.Array:
    """The distribution a child with token ``x`` was drawn from, given its node's draft
    distribution ``q_V`` with the tokens of the earlier siblings already zeroed (mode
    ``"without_replacement"``; see `remove_drawn`): ``"iid"`` -> ``q_V``;
    ``"without_replacement"`` -> ``q_V`` renormalised; ``"deterministic"`` -> one-hot(x)."""
    if mode == "iid":
        return q_V
    if mode == "without_replacement":
        mass = jnp.sum(q_V, axis=-1, keepdims=True)
        return jnp.where(mass > 0, q_V / jnp.where(mass > 0, mass, 1.0), 0.0)
    if mode == "deterministic":
        return jax.nn.one_hot(x, q_V.shape[-1], dtype=jnp.float32)
    raise ValueError(f"unknown children mode {mode!r}")


def remove_drawn(q_V: jax.Array, x: jax.Array, mode: str) -> jax.Array:
    """The node's draft bookkeeping after its child with token x was tried: without
    replacement the token is removed (zeroed); otherwise unchanged."""
    if mode == "without_replacement":
        return jnp.where(jnp.arange(q_V.shape[-1]) == x, 0.0, q_V)
    return q_V


def ratio_accept_prob(px: jax.Array, qx: jax.Array) -> jax.Array:
    """``min(1, p(x) / q(x))`` with the conventions of the test ``u * q(x) < p(x)``
    (``u`` in [0, 1)): q(x) = 0 gives 1 if p(x) > 0 else 0; p(x) = 0 gives 0."""
    safe_q = jnp.where(qx > 0, qx, 1.0)
    return jnp.where(qx > 0, jnp.minimum(1.0, px / safe_q), (px > 0).astype(jnp.float32))


def _clip_tokens(tokens, vocab):
    return jnp.clip(tokens.astype(jnp.int32), 0, vocab - 1)


def first_children(tree: DraftTree):
    """``(first_BN1, has_BN1)`` for every slot s (0 = root, n + 1 = node n): the index of the
    slot's first valid child (lowest index) and whether it has one."""
    B, N = tree.tokens_BN.shape
    slot_node_N1 = jnp.arange(N + 1, dtype=jnp.int32) - 1
    is_child_BN1N = ((tree.parents_BN.astype(jnp.int32)[:, None, :] == slot_node_N1[None, :, None])
                    & tree.valid_BN[:, None, :])
    return jnp.argmax(is_child_BN1N, axis=-1).astype(jnp.int32), jnp.any(is_child_BN1N, axis=-1)


class TreeWalkVerifier:
    """Base of the tree verifiers: ``walk`` (subclasses) -> final draw -> result layout.

    Subclasses define ``MODES`` (the children modes they are exact for) and
    ``walk(u_BN, tree, q_BN1V, p_BN1V) -> TreeWalk``; they may override ``final_token`` (how
    the final token is drawn from ``TreeWalk.final_dist_BV``) and ``first_child_accept``.
    """

    MODES: ClassVar[tuple[str, ...]] = CHILDREN_MODES

    def check_inputs(self, tree: DraftTree, q_BN1V, p_BN1V) -> None:
        """Trace-time checks: the children mode and the shapes."""
        if tree.mode not in self.MODES:
            raise ValueError(f"{type(self).__name__} is not exact for children mode "
                             f"{tree.mode!r} (it supports {self.MODES})")
        B, N = tree.tokens_BN.shape
        if p_BN1V.ndim != 3 or p_BN1V.shape[:2] != (B, N + 1):
            raise ValueError(f"p_BN1V must be [B, N+1, V] = [{B}, {N + 1}, V], got {p_BN1V.shape}")
        if q_BN1V.shape != p_BN1V.shape:
            raise ValueError(f"q_BN1V must have p_BN1V's shape {p_BN1V.shape}, got {q_BN1V.shape}")
        for name in ("parents_BN", "depths_BN", "valid_BN"):
            if getattr(tree, name).shape != (B, N):
                raise ValueError(f"tree.{name} must be [{B}, {N}], got {getattr(tree, name).shape}")

    def walk(self, u_BN, tree: DraftTree, q_BN1V, p_BN1V) -> TreeWalk:
        raise NotImplementedError

    def final_token(self, replace_keys_B, final_dist_BV):
        """One token per row from the walk's final distribution, with the row's replacement key."""
        return sample_rows(replace_keys_B, final_dist_BV)

    def first_child_accept(self, tree: DraftTree, q_BN1V, p_BN1V):
        """``[B, N+1]``: per slot, ``min(1, p(x) / q_1(x))`` of its first valid child x."""
        first_BN1, has_BN1 = first_children(tree)
        V = p_BN1V.shape[-1]
        x_BN1 = _clip_tokens(jnp.take_along_axis(tree.tokens_BN, first_BN1, axis=1), V)
        px_BN1 = jnp.take_along_axis(p_BN1V.astype(jnp.float32), x_BN1[..., None], axis=-1)[..., 0]
        if tree.mode == "deterministic":
            qx_BN1 = jnp.ones_like(px_BN1)
        else:
            qx_BN1 = jnp.take_along_axis(q_BN1V.astype(jnp.float32), x_BN1[..., None], axis=-1)[..., 0]
        return jnp.where(has_BN1, ratio_accept_prob(px_BN1, qx_BN1), 0.0), has_BN1

    def __call__(self, key, tree: DraftTree, q_BN1V, p_BN1V) -> TreeVerifyResult:
        B, N = tree.tokens_BN.shape
        accept_keys_B, _ = row_keys(key, B)
        return self.verify_with_uniforms(row_uniforms(accept_keys_B, N), key, tree, q_BN1V, p_BN1V)

    def verify_with_uniforms(self, u_BN, key, tree: DraftTree, q_BN1V, p_BN1V) -> TreeVerifyResult:
        """``__call__`` with the acceptance uniforms injected (``u_BN[:, n]`` is node n's);
        ``key`` supplies the per-row replacement keys exactly as in ``__call__``."""
        self.check_inputs(tree, q_BN1V, p_BN1V)
        B, N = tree.tokens_BN.shape
        walk = self.walk(u_BN, tree, q_BN1V, p_BN1V)
        _, replace_keys_B = row_keys(key, B)
        final_B = self.final_token(replace_keys_B, walk.final_dist_BV)
        return assemble_tree_result(tree, walk, final_B, *self.first_child_accept(tree, q_BN1V, p_BN1V))


def assemble_tree_result(tree: DraftTree, walk: TreeWalk, final_B, first_accept_BN1, has_child_BN1):
    """Lay out the path, committed tokens and first-child acceptance estimates of a walk."""
    A = tree.max_depth
    path_BA, n_B = path_nodes(tree.parents_BN, walk.last_node_B, A)
    tok_BA = jnp.take_along_axis(tree.tokens_BN.astype(jnp.int32), jnp.maximum(path_BA, 0), axis=1)
    j_BA1 = jnp.arange(A + 1, dtype=jnp.int32)[None]
    tok_BA1 = jnp.concatenate([tok_BA, jnp.zeros_like(tok_BA[:, :1])], axis=1)
    committed = jnp.where(j_BA1 < n_B[:, None], tok_BA1,
                          jnp.where(j_BA1 == n_B[:, None], final_B.astype(jnp.int32)[:, None], PAD_TOKEN))
    # Column j: the path's node at depth j (the root for j = 0), if the path reaches it.
    slot_BA = jnp.concatenate([jnp.zeros_like(path_BA[:, :1]), path_BA[:, :-1] + 1], axis=1)
    on_path_BA = j_BA1[:, :A] <= n_B[:, None]
    slot_BA = jnp.where(on_path_BA, slot_BA, 0)
    tested_BA = on_path_BA & jnp.take_along_axis(has_child_BN1, slot_BA, axis=1)
    tested_accept_BA = jnp.where(tested_BA, jnp.take_along_axis(first_accept_BN1, slot_BA, axis=1), 0.0)
    return TreeVerifyResult(
        n_accepted_B=n_B.astype(jnp.int32),
        path_BA=path_BA.astype(jnp.int32),
        committed_BA1=committed.astype(jnp.int32),
        last_node_B=walk.last_node_B.astype(jnp.int32),
        degenerate_residual_B=walk.degenerate_B.astype(jnp.int32),
        tested_accept_BA=tested_accept_BA.astype(jnp.float32),
        tested_BA=tested_BA,
    )


def _node_inputs(tree: DraftTree, V: int):
    return (_clip_tokens(tree.tokens_BN, V), tree.parents_BN.astype(jnp.int32), tree.valid_BN)


# ---------------------------------------------------------------------------------------------
# Greedy.


@dataclasses.dataclass(frozen=True)
class GreedyTreeVerifier(TreeWalkVerifier):
    """Temperature 0: from the root, move to the first valid child (lowest index) whose token
    is the current node's target argmax (ties: the lowest token index, as ``jnp.argmax``),
    until no child matches; the final token is the argmax at the last node. The committed
    tokens are exactly greedy target decoding. Any children mode; ``q`` and ``key`` unused;
    ``accept_prob_BN`` and ``tested_accept_BA`` are ``1[x == argmax p]``; never degenerate.
    """

    def walk(self, u_BN, tree: DraftTree, q_BN1V, p_BN1V) -> TreeWalk:
        self.check_inputs(tree, q_BN1V, p_BN1V)
        del u_BN, q_BN1V
        B, N = tree.tokens_BN.shape
        V = p_BN1V.shape[-1]
        choice_BN1 = argmax(p_BN1V)
        tok_BN, par_BN, valid_BN = _node_inputs(tree, V)

        def row(choice_N1, tok_N, par_N, valid_N):
            def step(cur, xs):
                n, x, par, ok = xs
                tried = ok & (par == cur)
                passed = tried & (x == choice_N1[cur + 1])
                return jnp.where(passed, n, cur), (tried, passed)

            last, (tried_N, passed_N) = jax.lax.scan(
                step, jnp.int32(-1), (jnp.arange(N, dtype=jnp.int32), tok_N, par_N, valid_N))
            return last, tried_N, passed_N

        last_B, tried_BN, passed_BN = jax.vmap(row)(choice_BN1, tok_BN, par_BN, valid_BN)
        final_B = jnp.take_along_axis(choice_BN1, last_B[:, None] + 1, axis=1)[:, 0]
        return TreeWalk(last_node_B=last_B,
                        final_dist_BV=jax.nn.one_hot(final_B, V, dtype=jnp.float32),
                        degenerate_B=jnp.zeros((B,), jnp.int32), tested_BN=tried_BN,
                        accept_prob_BN=passed_BN.astype(jnp.float32), passed_BN=passed_BN)

    def final_token(self, replace_keys_B, final_dist_BV):
        return argmax(final_dist_BV)

    def first_child_accept(self, tree: DraftTree, q_BN1V, p_BN1V):
        first_BN1, has_BN1 = first_children(tree)
        x_BN1 = jnp.take_along_axis(tree.tokens_BN.astype(jnp.int32), first_BN1, axis=1)
        match_BN1 = x_BN1 == argmax(p_BN1V)
        return jnp.where(has_BN1, match_BN1.astype(jnp.float32), 0.0), has_BN1


# ---------------------------------------------------------------------------------------------
# Recursive rejection sampling.


@dataclasses.dataclass(frozen=True)
class RecursiveRejectionVerifier(TreeWalkVerifier):
    """Recursive rejection sampling down the tree: exact for all three children modes.

    SpecInfer's multi-step speculative sampling (Miao et al., ASPLOS 2024, arXiv:2305.09781);
    the without-replacement variant as in Recursive Speculative Decoding (Jeon et al. 2024,
    arXiv:2402.14160). At the current node (first the root) with target ``p_1`` = the node's
    target distribution, its valid children ``x_1, x_2, ...`` are tried in index order:

    * child i is accepted iff ``u_i * q_i(x_i) < p_i(x_i)`` (``u_i`` ~ U[0, 1), the child's own
      uniform; no division, as ``TokenVerifier``): probability ``min(1, p_i(x_i) / q_i(x_i))``;
      on acceptance the walk moves to it and starts over with its children;
    * on rejection ``p_{i+1} = norm(max(0, p_i - q_i))`` via ``normalize_residual`` (fallback:
      the node's own target p; counted, as it is always used next);
    * ``q_i`` is what child i was drawn from: ``"iid"`` -> the node's q; ``"without_replacement"``
      -> the node's q with ``x_1 .. x_{i-1}`` removed and renormalised; ``"deterministic"`` ->
      one-hot(x_i) (then acceptance is ``u_i < p_i(x_i)`` and the residual zeroes x_i);
    * when the current node has no untried child the walk ends there; the final token is drawn
      from its current ``p_i`` (the residual after its last rejection, or its target p as the
      bonus when nothing at it was rejected).

    Exactness: by induction over the children, the token leaving the node (an accepted child
    or the final draw) has law p, given how the children were drawn (Miao et al. Thm 4.2; Jeon
    et al. for without replacement). Implemented as one ``lax.scan`` over the nodes in index
    order: breadth-first order puts every node after its parent and the untried siblings of an
    accepted node before any of its children, so a node is tried iff it is valid and its
    parent is the current node.

    Attributes:
      residual_tol: tolerance tau on the residual mass (see ``RESIDUAL_TOL``).
    """

    residual_tol: float = RESIDUAL_TOL

    def walk(self, u_BN, tree: DraftTree, q_BN1V, p_BN1V) -> TreeWalk:
        self.check_inputs(tree, q_BN1V, p_BN1V)
        B, N = tree.tokens_BN.shape
        V = p_BN1V.shape[-1]
        mode, tol = tree.mode, self.residual_tol
        tok_BN, par_BN, valid_BN = _node_inputs(tree, V)
        p_BN1V = p_BN1V.astype(jnp.float32)
        q_BN1V = q_BN1V.astype(jnp.float32)

        def row(u_N, tok_N, par_N, valid_N, q_N1V, p_N1V):
            def step(carry, xs):
                cur, P_V, Pnode_V, Q_V, deg = carry
                n, x, par, ok, u, p_next_V, q_next_V = xs
                tried = ok & (par == cur)
                q_i_V = child_proposal(Q_V, x, mode)
                px, qx = P_V[x], q_i_V[x]
                passed = tried & (u * qx < px)
                rejected = tried & ~passed
                resid_V, degenerate = normalize_residual(jnp.maximum(P_V - q_i_V, 0.0), Pnode_V, tol)
                carry = (jnp.where(passed, n, cur),
                         jnp.where(passed, p_next_V, jnp.where(rejected, resid_V, P_V)),
                         jnp.where(passed, p_next_V, Pnode_V),
                         jnp.where(passed, q_next_V, jnp.where(rejected, remove_drawn(Q_V, x, mode), Q_V)),
                         deg + (rejected & degenerate).astype(jnp.int32))
                return carry, (tried, jnp.where(tried, ratio_accept_prob(px, qx), 0.0), passed)

            init = (jnp.int32(-1), p_N1V[0], p_N1V[0], q_N1V[0], jnp.int32(0))
            xs = (jnp.arange(N, dtype=jnp.int32), tok_N, par_N, valid_N, u_N, p_N1V[1:], q_N1V[1:])
            (last, P_V, _, _, deg), (tried_N, prob_N, passed_N) = jax.lax.scan(step, init, xs)
            return last, P_V, deg, tried_N, prob_N, passed_N

        last, final, deg, tried, prob, passed = jax.vmap(row)(
            u_BN.astype(jnp.float32), tok_BN, par_BN, valid_BN, q_BN1V, p_BN1V)
        return TreeWalk(last_node_B=last, final_dist_BV=final, degenerate_B=deg, tested_BN=tried,
                        accept_prob_BN=prob, passed_BN=passed)
