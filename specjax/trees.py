"""Token trees: static shapes, the flattened per-row tree, ancestor masks and path bookkeeping.

A round of tree speculation scores a *block* of ``N + 1`` tokens in one target pass: block
position 0 is the root (the last committed token), block position ``n + 1`` is drafted node
``n``. Everything is a fixed-size array, so shapes stay static under ``jit``:

* nodes are numbered ``0 .. N-1`` in breadth-first order: ``parents[n] < n`` (``-1`` = the
  root) and depths never decrease with the index, so every node comes after its parent and
  the nodes of one depth are contiguous in a static tree;
* siblings (the children of one node) are *ordered by index*: the k-th child is the k-th draw
  (or the k-th most probable, for deterministic children), and verifiers try them in that order;
* a node's position is ``committed length - 1 + depth`` (root: depth 0);
* padding nodes (``valid = False``) are never visible to any other node, never accepted.

How children were drawn decides which verifier is exact for the tree (``DraftTree.mode``):

* ``"iid"``: the children of a node are independent draws from the node's ``q`` (with
  replacement; duplicate siblings are possible);
* ``"without_replacement"``: child k is drawn from ``q`` with the earlier siblings' tokens
  removed and renormalised (Gumbel-top-k sampling gives exactly this sequence);
* ``"deterministic"``: the children are a function of the context (top-k of the draft, n-gram
  matches, an EAGLE-2 dynamic tree); each child's ``q`` is the one-hot of its own token.

Static settings (hashable, usable as ``jit`` static arguments): `TreeShape` (an explicit
parent list, from a branching list per depth or from Medusa / EAGLE-1 style paths) and
`DynamicTree` (EAGLE-2: expand the most probable nodes per depth, keep the best
``node_budget`` nodes overall; Li et al. 2024, arXiv:2406.16858). Traced data: `DraftTree`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

CHILDREN_MODES = ("iid", "without_replacement", "deterministic")
ROOT = -1
# The largest trees a tree string (`parse_tree`) may ask for. A round scores every node in one
# target pass: its attention scores grow with nodes x cache slots, its tree mask and q over the
# vocabulary with the nodes, while it commits at most depth + 1 tokens. Published trees are
# smaller: Medusa, EAGLE-1/2 and SpecInfer use up to about a hundred nodes and depths <= 10;
# Sequoia's offloading runs, the largest, budget several hundred. The depth is a draft length
# (the drafter runs once per depth), bounded as gamma is (`specjax.build.MAX_GAMMA`). A dynamic
# tree's drafter also holds q over the vocabulary for each of its topk + (depth - 1) topk^2
# candidates (EAGLE-2's settings, top-10 up to depth 8, have at most 710).
MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 64
MAX_DYNAMIC_CANDIDATES = 4096


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A static tree of ``N`` drafted nodes: ``parents[n]`` in ``[-1, n)``, breadth-first order.

    Build it with `TreeShape.chain`, `TreeShape.from_branching` or `TreeShape.from_paths`.
    """
    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if not parents:
            raise ValueError("a tree needs at least one node")
        for n, p in enumerate(parents):
            if not -1 <= p < n:
                raise ValueError(f"node {n} has parent {p}: parents must be -1 (the root) or an earlier node")
        d = self.depths
        if any(b < a for a, b in zip(d, d[1:])):
            raise ValueError(f"nodes must be in breadth-first order (depths non-decreasing), got depths {d}")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def chain(cls, gamma: int) -> "TreeShape":
        """gamma nodes in a line (a linear draft as a tree)."""
        if gamma < 1:
            raise ValueError(f"a chain needs gamma >= 1, got {gamma}")
        return cls(tuple(range(-1, gamma - 1)))

    @classmethod
    def from_branching(cls, branching: Sequence[int]) -> "TreeShape":
        """Every node at depth d has ``branching[d]`` children (depth 0 = the root):
        (2, 2, 1) has 2 + 4 + 4 = 10 nodes."""
        branching = tuple(int(k) for k in branching)
        if not branching or any(k < 1 for k in branching):
            raise ValueError(f"branching needs one count >= 1 per depth, got {branching}")
        parents, frontier = [], [ROOT]
        for k in branching:
            nxt = []
            for p in frontier:
                for _ in range(k):
                    nxt.append(len(parents))
                    parents.append(p)
            frontier = nxt
        return cls(tuple(parents))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeShape":
        """A tree from paths of child ranks (Medusa / EAGLE-1 "choices"): ``(0,)`` is the root's
        first child, ``(1, 0)`` the first child of its second child. Every prefix of a path
        must be a path too; ranks of one parent must be 0..k-1."""
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("paths must be non-empty tuples of ranks >= 0")
        index = {(): ROOT}
        parents = []
        for p in paths:
            if p[:-1] not in index:
                raise ValueError(f"path {p} has no parent path {p[:-1]}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise ValueError(f"path {p}: ranks of one parent must be 0..k-1 without gaps")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
        return cls(tuple(parents))

    # -- static structure ------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        out = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Each node's index among its siblings (0 = first child)."""
        seen: dict[int, int] = {}
        out = []
        for p in self.parents:
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return tuple(out)

    def level(self, depth: int) -> tuple[int, int]:
        """[start, stop) node indices of one depth (contiguous in breadth-first order)."""
        idx = [n for n, d in enumerate(self.depths) if d == depth]
        if not idx:
            raise ValueError(f"the tree has no nodes at depth {depth}")
        return idx[0], idx[-1] + 1

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    def expected_tokens(self, alpha: float) -> float:
        """Tokens committed per round if every tried child is accepted with probability alpha
        independently: 1 + sum_n prod over n's path of alpha (1 - alpha)^rank. For a chain
        this is (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023, Eq. 1). alpha may be a
        traced scalar (the adaptive policy prices static trees with it inside the loop)."""
        reach = []
        for p, r in zip(self.parents, self.ranks):
            reach.append((1.0 if p < 0 else reach[p]) * alpha * (1.0 - alpha) ** r)
        return 1.0 + sum(reach)

    def describe(self) -> str:
        widths = [sum(1 for d in self.depths if d == k) for k in range(1, self.max_depth + 1)]
        return f"tree[{self.num_nodes} nodes, widths {widths}]"


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree (Li et al. 2024): from the root, ``depth`` times expand the ``topk``
    frontier nodes with the highest cumulative draft log-probability by their ``topk`` most
    probable children each, then keep the ``node_budget`` nodes of highest cumulative
    log-probability (ancestors always rank above their descendants, so the kept set is a tree).
    Children are deterministic (top-k), so the tree is exact with any tree verifier that
    accepts ``"deterministic"`` children."""
    depth: int = 5
    topk: int = 4
    node_budget: int = 24

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got {self.depth}, {self.topk}")
        most = self.topk + (self.depth - 1) * self.topk * self.topk
        if not 1 <= self.node_budget <= most:
            raise ValueError(f"node_budget must be in [1, {most}] (what depth={self.depth}, topk={self.topk} "
                             f"can produce), got {self.node_budget}")

    @property
    def num_nodes(self) -> int:
        return self.node_budget

    @property
    def max_depth(self) -> int:
        return self.depth

    def describe(self) -> str:
        return f"dynamic[depth {self.depth}, top-{self.topk}, {self.node_budget} nodes]"


TreeSpec = Union[TreeShape, DynamicTree]


def branching_nodes(branching: Sequence[int]) -> int:
    """The node count of `TreeShape.from_branching(branching)`, counted without building it:
    the sum over depths of the product of the counts down to that depth."""
    total, width = 0, 1
    for k in branching:
        width *= int(k)
        total += width
    return total


def dynamic_candidates(depth: int, topk: int) -> int:
    """The candidates a `DynamicTree` drafter scores before it keeps ``node_budget`` of them:
    ``topk`` children of the root, then ``topk`` children of each of ``topk`` frontier nodes per
    further depth."""
    return topk + (depth - 1) * topk * topk


def check_tree_size(nodes: int, depth: int, candidates: int | None = None) -> None:
    """Refuse a tree above `MAX_TREE_NODES` nodes or `MAX_TREE_DEPTH` depth (or, for a dynamic
    tree, above `MAX_DYNAMIC_CANDIDATES` candidates): ValueError with the count and the maximum."""
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"{nodes:,} nodes, expected at most {MAX_TREE_NODES} (every node is scored in one "
                         f"target pass: the round's memory and time grow with the node count)")
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"depth {depth:,}, expected at most {MAX_TREE_DEPTH} (the drafter runs once per depth)")
    if candidates is not None and candidates > MAX_DYNAMIC_CANDIDATES:
        raise ValueError(f"{candidates:,} candidates (topk + (depth - 1) topk^2), expected at most "
                         f"{MAX_DYNAMIC_CANDIDATES} (the drafter holds q over the vocabulary for each)")


def parse_tree(text: str) -> TreeSpec:
    """A tree from a command-line string: ``"branching:2,2,1"``, ``"chain:4"``,
    ``"dynamic:depth,topk,budget"`` or ``"paths:0;1;0.0;0.1"`` (ranks joined by dots). Its size
    is checked (`check_tree_size`) before a static tree is built; a bad or too large tree is a
    ValueError naming the string."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "branching":
            branching = [int(x) for x in arg.split(",")]
            if all(k >= 1 for k in branching):          # else from_branching names the bad count
                check_tree_size(branching_nodes(branching), len(branching))
            return TreeShape.from_branching(branching)
        if kind == "chain":
            n = int(arg)
            check_tree_size(n, n)
            return TreeShape.chain(n)
        if kind == "dynamic":
            d, k, b = (int(x) for x in arg.split(","))
            tree = DynamicTree(depth=d, topk=k, node_budget=b)
            check_tree_size(b, d, dynamic_candidates(d, k))
            return tree
        if kind == "paths":
            tree = TreeShape.from_paths([tuple(int(r) for r in p.split(".")) for p in arg.split(";")])
            check_tree_size(tree.num_nodes, tree.max_depth)
            return tree
    except ValueError as e:
        raise ValueError(f"bad tree {text!r}: {e}") from None
    raise ValueError(f"bad tree {text!r}: expected 'branching:2,2,1', 'chain:4', 'dynamic:5,4,24' or "
                     f"'paths:0;1;0.0'")


@struct.dataclass
class DraftTree:
    """One drafted tree per row (traced). ``N`` nodes in breadth-first order (module doc).

    tokens_BN: int32 drafted tokens; parents_BN: int32 parent node (-1 = root);
    depths_BN: int32 depth (1 = child of the root); valid_BN: bool (padding nodes False);
    mode: how the children were drawn (`CHILDREN_MODES`), static;
    max_depth: static upper bound on the depth of any node (paths have at most this many nodes).
    """
    tokens_BN: jax.Array
    parents_BN: jax.Array
    depths_BN: jax.Array
    valid_BN: jax.Array
    draft_slots_BN: jax.Array | None = None   # where the drafter holds each node's K/V (drafter-specific)
    mode: str = struct.field(pytree_node=False, default="iid")
    max_depth: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def from_shape(cls, shape: TreeShape, tokens_BN, mode: str, valid_BN=None, draft_slots_BN=None) -> "DraftTree":
        if mode not in CHILDREN_MODES:
            raise ValueError(f"mode must be one of {CHILDREN_MODES}, got {mode!r}")
        B = tokens_BN.shape[0]
        bcast = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32)[None], (B, shape.num_nodes))
        valid = jnp.ones((B, shape.num_nodes), bool) if valid_BN is None else valid_BN
        return cls(tokens_BN=jnp.asarray(tokens_BN, jnp.int32), parents_BN=bcast(shape.parents),
                   depths_BN=bcast(shape.depths), valid_BN=valid, draft_slots_BN=draft_slots_BN, mode=mode,
                   max_depth=shape.max_depth)

    @property
    def num_nodes(self) -> int:
        return self.tokens_BN.shape[1]


@struct.dataclass
class AcceptedPath:
    """What a round committed of a tree, for a drafter that holds tentative K/V of its nodes.

    nodes_BA: accepted node indices by depth (-1 after); num_B: how many of them were committed
    (after EOS / max-token truncation); draft_slots_BA: the drafter's ``draft_slots_BN`` of those
    nodes (-1 where it holds none)."""
    nodes_BA: jax.Array
    num_B: jax.Array
    draft_slots_BA: jax.Array


def ancestor_mask(parents_BN, valid_BN, max_depth: int):
    """``visible_BTT[b, t, s]``: block position s (0 = root, n + 1 = node n) is the query t
    itself or one of its ancestors; rows and columns of invalid nodes are False except that an
    invalid node still sees itself (its logits are computed, never used)."""
    B, N = parents_BN.shape
    T = N + 1
    parent_BT = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents_BN.astype(jnp.int32) + 1], axis=1)
    parent_BT = parent_BT.at[:, 0].set(0)       # the root's "parent" is itself (a fixed point)
    valid_BT = jnp.concatenate([jnp.ones((B, 1), bool), valid_BN], axis=1)
    eye = jnp.eye(T, dtype=bool)
    vis_BTT = jnp.broadcast_to(eye, (B, T, T))
    cur_BT = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    for _ in range(max_depth):
        cur_BT = jnp.take_along_axis(parent_BT, cur_BT, axis=1)
        vis_BTT = vis_BTT | jax.nn.one_hot(cur_BT, T, dtype=bool)
    vis_BTT = vis_BTT & (valid_BT[:, :, None] & valid_BT[:, None, :] | eye[None])
    return vis_BTT


def path_nodes(parents_BN, last_node_B, max_depth: int):
    """The nodes from depth 1 down to ``last_node_B`` (-1 = root only) -> ``path_BA`` (node
    indices, -1 after the path) and its length ``n_B``."""
    B, N = parents_BN.shape
    A = max_depth
    ext_BN1 = jnp.concatenate([parents_BN.astype(jnp.int32), jnp.full((B, 1), -1, jnp.int32)], axis=1)
    # Walk up from the last node, collecting A ancestors-or-self (deepest first).
    cur_B = last_node_B.astype(jnp.int32)
    up = []
    for _ in range(A):
        up.append(cur_B)
        cur_B = jnp.take_along_axis(ext_BN1, jnp.where(cur_B < 0, N, cur_B)[:, None], axis=1)[:, 0]
    up_BA = jnp.stack(up, axis=1)                      # deepest first, then -1s
    n_B = jnp.sum(up_BA >= 0, axis=1).astype(jnp.int32)
    # Reverse the first n_B entries of each row: path[j] = up[n - 1 - j].
    j_A = jnp.arange(A)
    src_BA = jnp.clip(n_B[:, None] - 1 - j_A[None], 0, A - 1)
    path_BA = jnp.where(j_A[None] < n_B[:, None], jnp.take_along_axis(up_BA, src_BA, axis=1), -1)
    return path_BA, n_B
