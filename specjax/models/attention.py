"""Attention: the visibility rules and the ops that apply them, one seam for every kernel.

A layer hands an op the queries of its T new tokens, their keys and values, the layer's cache
*before* this call (``past = (k_BKSH, v_BKHS, lengths_B)`` or None; layouts in
`specjax.models.kv_cache`) and which keys each query sees, as a `Visibility`:

* ``None``: the plain causal rule. Cache slot s of row b is visible iff ``s < lengths_B[b]``,
  new token t' to query t iff ``t' <= t``.
* ``(visible_past_BTS, visible_new_BTT)`` (``visible_past`` may be [B, 1, S]): any other rule.
  `tree_attention_mask` gives a token tree's (a node sees its ancestors), `window_mask` narrows
  a rule to a sliding window.
* `TrainingTimeTest`: the rule of a feature head's training-time test (EAGLE-3, cache-free over
  whole sequences): the past is the step-1 entries of every position, seen causally, then one
  block per earlier step of the origins drafted, seen on the diagonal like the new tokens. Whatever the op, `attention` computes it with
  `training_time_test_attention` (einsums, soft-capping included), which never forms the
  mostly-empty [T, (J + 1) T] score matrix the dense mask would need; `TrainingTimeTest.dense`
  gives the same rule as masks for an op to be checked against.

Write-then-attend: a caller that has already written the block's K and V into the cache (at
slots ``write_at_B[b] + t``) passes ``k_new = v_new = None`` and the visibility over slots alone,
``(written_visibility(...), None)``; the op then attends over the cache's slots only. A
verification block and the one-token steps that score the same tokens then reduce over the same
operands in the same order, which the low-precision profiles need for bitwise equality (with
the block's keys appended after the cache, a token's key sits in the cache for a step and in
the appended part for a block row, and the sums split differently).

Token trees in low precision: write-then-attend makes a chain block's row t reduce over the
same slots as the step that scores its token, but a tree node's ancestors sit at the slots of
their block rows (breadth-first), not at ``length + depth`` where the steps find them, and a sum
over slots groups them differently (float32 and bfloat16 results differ in the last bits). With
``AttentionSpec.ordered_tail = W`` an op splits every query's visible keys in two: the last W
(by slot; for a node of a tree of at most W - 1 levels these include all its ancestors in the
block, in depth order) gathered into a [W] axis in slot order, and all others, read in place
(slots below the tail's first; for a tree node these are committed, at the slots a step reads
them at). The maximum is taken over both, each part is summed on its own and the two sums are
added. A tree node and the step at the same position then see the same keys in the same
order in each part, so they compute the same bits; the step's own tail is its last W keys
too. The tails are read from one window of ``AttentionSpec.tail_span`` slots per row, not the
whole cache; the TPU compiler still copies each cache buffer for that slice
(experiments/aot/README.md, "Ordered tails"), so models turn it on only for runs that verify
trees (`ModelConfig.ordered_tail`).

Positions are slots (rows are right-padded; see `specjax.models._protocol`), so cache slot s
holds position s. A sliding window of W keeps key positions j with ``i - W < j <= i`` for the
query at position i (Mistral, Gemma 2/3, the Hugging Face rule). Tentative tree entries of
earlier calls of a round (``TreeBlock.offset > 0``) are taken at their slot: they are ancestors
within the tree's depth of the query, so the window is exact while the tree is shallower than
the window.

Ops (`ATTENTION_OPS`, chosen by ``ModelConfig.attention_op``):

* ``reference``: einsums over the cache and the block with float32 scores; every feature
  (scale, soft-capping, any visibility). The CPU default.
* ``dot_product``: `jax.nn.dot_product_attention` over the concatenated keys with a boolean
  mask (XLA's fused attention; cuDNN on a GPU where the shapes allow). No soft-capping.

* ``pallas``: write-then-attend calls by `specjax.kernels.cache_attention`, a Pallas kernel
  that reads the cache in place up to each row's live length (Mosaic on TPU, the Pallas
  interpreter on CPU, the reference op elsewhere); every other call (no cache, keys appended)
  by the reference op. Every feature of the reference op.

All are pure functions of the same arguments and agree within float tolerance
(`tests/test_attention_ops.py`, `tests/test_pallas_attention.py`). A new op is one function added with `register_attention_op`.
``ModelConfig.cpu_attention`` routes plain causal decode steps to `specjax.kernels`' CPU kernel
instead, which reads only the committed slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.models.kv_cache import TreeBlock

NEG = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What an op computes besides the mask: scores = cap * tanh(q.k * scale / cap) (no cap: q.k * scale).

    ``ordered_tail`` (write-then-attend calls only; 0: off): each query's last ``ordered_tail``
    visible keys are summed apart from the rest, gathered in slot order (see "Token trees in
    low precision" in the module docstring). ``tail_span`` (0: unknown): every tail slot of a
    row lies within this many slots from the row's first one (a block of T tokens written after
    ``offset`` tentative entries: 2 T - 1 + offset), so the tails are read from one contiguous
    window of the cache instead of gathered from all of it.

    ``causal_chunk`` (the reference op; 0: off): a cache-free call under the plain causal rule
    with more than this many tokens attends chunk by chunk of queries, each chunk over the keys
    up to its own end, so the scores above the diagonal's chunks are never formed (about half
    of them on long sequences) and each chunk's scores stay small. Each query sees the same keys
    either way; only the length of the masked tail its softmax reduces over differs."""
    scale: float
    softcap: float | None = None
    ordered_tail: int = 0
    tail_span: int = 0
    causal_chunk: int = 0


# The widest block whose write-then-attend calls sum their last keys in position order
# (`AttentionSpec.ordered_tail`): verification blocks and trees; a prompt's prefill is wider.
ORDERED_TAIL_MAX = 64


# ---------------------------------------------------------------------------------------
# Visibility
# ---------------------------------------------------------------------------------------
def tree_attention_mask(tree: TreeBlock, lengths_B, capacity: int):
    """(visible_past_BTS, visible_new_BTT) of a tree block (see `TreeBlock`).

    Query t of row b sees cache slot s iff ``s < lengths_B[b]`` (committed) or s is in the
    window, ``0 <= w = s - lengths_B[b] < offset``, with ``visible_BTW[b, t, w]``; it sees the
    block's token t' iff ``visible_BTW[b, t, offset + t']``. ``visible_past`` is [B, 1, S] when
    the window is empty (offset 0), [B, T, S] otherwise (one gather of the window's columns).
    """
    B, T = tree.rel_positions_BT.shape
    offset = tree.offset
    visible_BTW = tree.visible_BTW.astype(bool)
    rel_BS = jnp.arange(capacity, dtype=jnp.int32)[None, :] - lengths_B[:, None]
    past_BTS = (rel_BS < 0)[:, None, :]
    if offset > 0:
        in_window_BS = (rel_BS >= 0) & (rel_BS < offset)
        w_BTS = jnp.broadcast_to(jnp.clip(rel_BS, 0, offset - 1)[:, None, :], (B, T, capacity))
        window_BTS = jnp.take_along_axis(visible_BTW[:, :, :offset], w_BTS, axis=2)
        past_BTS = past_BTS | (window_BTS & in_window_BS[:, None, :])
    return past_BTS, visible_BTW[:, :, offset:]


@dataclasses.dataclass(frozen=True)
class TrainingTimeTest:
    """Visibility of drafting step j > 1 of a training-time test over whole sequences (no cache;
    `specjax.drafters.heads.eagle_train_forward`): ``past`` holds the step-1 entries of every
    position (block 0, T entries) and then j - 2 blocks of Q entries, one per earlier step > 1
    (k [B, K, T + (j - 2) Q, H]); the call's Q new tokens are step j's. Query q is the draft
    from origin ``o_q`` (``origins_BQ[b, q]``; without ``origins_BQ`` every position is an
    origin, ``o_q = q`` and Q = T). It sees slot s of block 0 iff ``s <= o_q`` (and, with
    ``hides_first``, ``s >= 1``: slot 0 is seen by nobody but query 0's own step 1), and entry q
    of every later block and of the new tokens (its own origin's steps 2..j).

    ``origins_BQ`` (int32 [B, Q], ``width`` = T, the step-1 block's length) lets a trainer run
    steps 2..j at the origins its loss reads only; padding origins repeat a position (their
    outputs are the caller's to mask)."""
    hides_first: bool = False
    origins_BQ: Any = dataclasses.field(default=None, compare=False)
    width: int | None = None

    def __post_init__(self):
        if (self.origins_BQ is None) != (self.width is None):
            raise ValueError("TrainingTimeTest: origins_BQ and width (the step-1 block's length) go together")

    def first_visible(self, Q: int, T: int):
        """Which step-1 entries each query sees: [1 or B, Q, T] bool."""
        s_T = jnp.arange(T)
        o_BQ = jnp.arange(Q)[None] if self.origins_BQ is None else self.origins_BQ
        visible = s_T[None, None, :] <= o_BQ[:, :, None]
        if self.hides_first:
            visible = visible & (s_T >= 1)[None, None, :]
        return visible

    def dense(self, B: int, T: int, blocks: int, Q: int | None = None):
        """The same rule as a dense ``(visible_past_BQS, visible_new_BQQ)`` (for tests and the ops'
        agreement): [B, Q, T + (blocks - 1) Q] and [B, Q, Q] (Q = T without ``origins_BQ``)."""
        Q = T if Q is None else Q
        eye_QQ = jnp.broadcast_to(jnp.eye(Q, dtype=bool)[None], (B, Q, Q))
        first_BQT = jnp.broadcast_to(self.first_visible(Q, T), (B, Q, T))
        return jnp.concatenate([first_BQT] + [eye_QQ] * (blocks - 1), axis=2), eye_QQ


def training_time_test_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, tt: TrainingTimeTest,
                                 spec: AttentionSpec):
    """Attention under `TrainingTimeTest` in O(Q T + J Q) scores per head: one block of step-1
    entries ([Q, T], causal in the origins) and J diagonal entries per query, one softmax over
    both (what the dense mask computes, without its masked-out scores). [B, Q, N*H]."""
    B, Q, N, H = q_BTQH.shape
    K = k_new_BTKH.shape[2]
    G = N // K
    k_BKSH, v_BKHS, _ = past
    T = Q if tt.width is None else tt.width
    J = (k_BKSH.shape[2] - T) // Q + 1 if k_BKSH.shape[2] >= T else 0
    if J < 1 or T + (J - 1) * Q != k_BKSH.shape[2]:
        raise ValueError(f"training-time-test attention: {k_BKSH.shape[2]} past entries are not T={T} step-1 "
                         f"entries and whole blocks of Q={Q}")
    v_new_BTKH = jnp.nan_to_num(v_new_BTKH, nan=0.0, posinf=0.0, neginf=0.0)
    q = q_BTQH.reshape(B, Q, K, G, H)
    k1_BKTH, v1_BKHT = k_BKSH[:, :, :T], v_BKHS[..., :T]
    s_first = _scores(jnp.einsum("bqkgh,bksh->bkgqs", q.astype(k_BKSH.dtype), k1_BKTH,
                                 preferred_element_type=jnp.float32), spec)
    s_first = jnp.where(tt.first_visible(Q, T)[:, None, None], s_first, NEG)
    # diagonal keys: the Q-entry blocks of the past, then the new tokens: [B, Q, K, J, H]
    kd = jnp.concatenate([jnp.transpose(k_BKSH[:, :, T:].reshape(B, K, J - 1, Q, H), (0, 3, 1, 2, 4)
                                        ).astype(k_new_BTKH.dtype),
                          k_new_BTKH[:, :, :, None]], axis=3)
    vd = jnp.concatenate([jnp.transpose(v_BKHS[..., T:].reshape(B, K, H, J - 1, Q), (0, 4, 1, 3, 2)
                                        ).astype(v_new_BTKH.dtype), v_new_BTKH[:, :, :, None]], axis=3)
    s_diag = _scores(jnp.einsum("bqkgh,bqkjh->bkgqj", q.astype(kd.dtype), kd, preferred_element_type=jnp.float32),
                     spec)
    probs = jax.nn.softmax(jnp.concatenate([s_first, s_diag], axis=-1), axis=-1)
    p_first, p_diag = probs[..., :T], probs[..., T:]
    out = jnp.einsum("bkgqs,bkhs->bqkgh", p_first.astype(v1_BKHT.dtype), v1_BKHT, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgqj,bqkjh->bqkgh", p_diag.astype(vd.dtype), vd, preferred_element_type=jnp.float32)
    return out.reshape(B, Q, N * H).astype(q_BTQH.dtype)


def written_visibility(visibility, lengths_B, write_at_B, T: int, capacity: int):
    """A `Visibility` over cache slots only, for write-then-attend: [B, T, S] bool.

    After this call's T entries are written at slots ``write_at_B[b] + t`` (`write_kv`), query t
    sees slot s iff the rule (None: causal) lets it see s as a past slot, or s holds the block's
    token t' = s - write_at_B[b] and the rule lets query t see token t'. A block and the one-token
    steps that score the same tokens then attend over the same keys in the same slots, so their
    reductions run over the same operands in the same order (bitwise equal in any dtype).
    """
    past, new = causal_mask(lengths_B, T, capacity) if visibility is None else visibility
    B = lengths_B.shape[0]
    rel_BS = jnp.arange(capacity, dtype=jnp.int32)[None, :] - write_at_B[:, None].astype(jnp.int32)
    in_block_BS = (rel_BS >= 0) & (rel_BS < T)
    idx_BTS = jnp.broadcast_to(jnp.clip(rel_BS, 0, T - 1)[:, None, :], (B, T, capacity))
    block_BTS = jnp.take_along_axis(jnp.broadcast_to(new, (B, T, T)), idx_BTS, axis=2) & in_block_BS[:, None, :]
    return jnp.broadcast_to(past, (B, T, capacity)) | block_BTS


def causal_mask(lengths_B, T: int, capacity: int | None):
    """The plain causal rule as a `Visibility`: ([B, 1, S] or None without a cache, [1, T, T])."""
    t_T = jnp.arange(T)
    new_1TT = (t_T[None, :] <= t_T[:, None])[None]
    if lengths_B is None:
        return None, new_1TT
    return (jnp.arange(capacity)[None, :] < lengths_B[:, None])[:, None, :], new_1TT


def window_mask(visibility, positions_BT, lengths_B, capacity: int | None, window):
    """`visibility` (None = causal) narrowed to a sliding window of ``window`` positions
    (an int or a traced int32 scalar; 0 = no window): key position j stays visible to the
    query at position i iff ``i - j < window``. ``capacity`` None: no cache (only the block)."""
    T = positions_BT.shape[1]
    if visibility is None:
        visibility = causal_mask(lengths_B, T, capacity)
    past, new = visibility
    window = jnp.asarray(window, jnp.int32)
    open_ = window <= 0
    pos_BT = positions_BT.astype(jnp.int32)
    near_new = open_ | (pos_BT[:, :, None] - pos_BT[:, None, :] < window)
    new = new & near_new
    if past is not None:
        near_past = open_ | (pos_BT[:, :, None] - jnp.arange(capacity, dtype=jnp.int32)[None, None, :] < window)
        past = past & near_past
    return past, new


# ---------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------
def _scores(s, spec: AttentionSpec):
    s = s * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    return s


def reference_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec: AttentionSpec):
    """Grouped-query attention of T queries over cached slots and the T new tokens: [B, T, N*H]."""
    if k_new_BTKH is None:
        return _attend_cache(q_BTQH, past, visibility[0], spec)
    B, T, N, H = q_BTQH.shape
    K = k_new_BTKH.shape[2]
    G = N // K
    # A masked position gets weight exactly 0, but 0 * NaN = NaN: a NaN value vector at a later
    # (e.g. rejected draft) position would poison every earlier query. Zero it; a position whose
    # own state is NaN still yields NaN logits through the residual stream.
    v_new_BTKH = jnp.nan_to_num(v_new_BTKH, nan=0.0, posinf=0.0, neginf=0.0)
    q = q_BTQH.reshape(B, T, K, G, H)
    if past is None and visibility is None and 0 < spec.causal_chunk < T:
        return _causal_chunks(q, k_new_BTKH, v_new_BTKH, spec).reshape(B, T, N * H).astype(q_BTQH.dtype)
    s_new = _scores(jnp.einsum("btkgh,bskh->bkgts", q, k_new_BTKH, preferred_element_type=jnp.float32), spec)
    if visibility is None:
        t_T = jnp.arange(T)
        s_new = jnp.where((t_T[None, :] <= t_T[:, None])[None, None, None], s_new, NEG)
    else:
        s_new = jnp.where(visibility[1][:, None, None], s_new, NEG)
    if past is None:
        probs = jax.nn.softmax(s_new, axis=-1)
        out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_new_BTKH.dtype), v_new_BTKH,
                         preferred_element_type=jnp.float32)
        return out.reshape(B, T, N * H).astype(q_BTQH.dtype)
    k_BKSH, v_BKHS, lengths_B = past
    S = k_BKSH.shape[2]
    s_past = _scores(jnp.einsum("btkgh,bksh->bkgts", q.astype(k_BKSH.dtype), k_BKSH,
                                preferred_element_type=jnp.float32), spec)
    if visibility is None:
        visible_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
        s_past = jnp.where(visible_BS[:, None, None, None, :], s_past, NEG)
    else:
        s_past = jnp.where(visibility[0][:, None, None], s_past, NEG)
    probs = jax.nn.softmax(jnp.concatenate([s_past, s_new], axis=-1), axis=-1)
    p_past, p_new = probs[..., :S], probs[..., S:]
    out = jnp.einsum("bkgts,bkhs->btkgh", p_past.astype(v_BKHS.dtype), v_BKHS,
                     preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgts,bskh->btkgh", p_new.astype(v_new_BTKH.dtype), v_new_BTKH,
                           preferred_element_type=jnp.float32)
    return out.reshape(B, T, N * H).astype(q_BTQH.dtype)


def _causal_chunks(q_BTKGH, k_BTKH, v_BTKH, spec: AttentionSpec):
    """Cache-free causal attention, ``spec.causal_chunk`` queries at a time, each chunk over the
    keys up to its last query: [B, T, K, G, H] float32."""
    T, c = q_BTKGH.shape[1], spec.causal_chunk
    outs = []
    for a in range(0, T, c):
        e = min(T, a + c)
        s = _scores(jnp.einsum("btkgh,bskh->bkgts", q_BTKGH[:, a:e], k_BTKH[:, :e],
                               preferred_element_type=jnp.float32), spec)
        s = jnp.where((jnp.arange(e)[None, :] <= jnp.arange(a, e)[:, None])[None, None, None], s, NEG)
        probs = jax.nn.softmax(s, axis=-1)
        outs.append(jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_BTKH.dtype), v_BTKH[:, :e],
                               preferred_element_type=jnp.float32))
    return jnp.concatenate(outs, axis=1)


def _attend_cache(q_BTQH, past, visible_BTS, spec: AttentionSpec):
    """The reference op under write-then-attend: the cache already holds the block (no new keys)."""
    B, T, N, H = q_BTQH.shape
    k_BKSH, v_BKHS, _ = past
    if spec.ordered_tail:
        slots_BTW, rest_BTS = ordered_tail(jnp.broadcast_to(visible_BTS, (B, T, k_BKSH.shape[2])), spec.ordered_tail)
        return _with_tail(q_BTQH, past, slots_BTW, spec, *_cache_parts(q_BTQH, past, rest_BTS, spec))
    K = k_BKSH.shape[1]
    q = q_BTQH.reshape(B, T, K, N // K, H)
    s = _scores(jnp.einsum("btkgh,bksh->bkgts", q.astype(k_BKSH.dtype), k_BKSH, preferred_element_type=jnp.float32),
                spec)
    probs = jax.nn.softmax(jnp.where(visible_BTS[:, None, None], s, NEG), axis=-1)
    out = jnp.einsum("bkgts,bkhs->btkgh", probs.astype(v_BKHS.dtype), v_BKHS, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N * H).astype(q_BTQH.dtype)


def _cache_parts(q_BTQH, past, visible_BTS, spec: AttentionSpec):
    """The softmax's parts over the visible cache slots (what `kernels.cache_attention` returns
    with ``partial``): acc [B, T, N, H], m and l [B, T, N], float32; m = NEG, l = 0 where none."""
    B, T, N, H = q_BTQH.shape
    k_BKSH, v_BKHS, _ = past
    K = k_BKSH.shape[1]
    q = q_BTQH.reshape(B, T, K, N // K, H)
    s = _scores(jnp.einsum("btkgh,bksh->bkgts", q.astype(k_BKSH.dtype), k_BKSH, preferred_element_type=jnp.float32),
                spec)
    visible = visible_BTS[:, None, None]
    s = jnp.where(visible, s, NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bkgts,bkhs->btkgh", p.astype(v_BKHS.dtype), v_BKHS, preferred_element_type=jnp.float32)
    to_BTN = lambda x: jnp.transpose(x, (0, 3, 1, 2)).reshape(B, T, N)      # noqa: E731
    return acc.reshape(B, T, N, H), to_BTN(m), to_BTN(jnp.sum(p, axis=-1))


def _with_tail(q_BTQH, past, slots_BTW, spec: AttentionSpec, acc_BTNH, m_BTN, l_BTN):
    """Attention from the parts of the keys outside each query's tail and the tail's keys at
    ``slots_BTW`` (`ordered_tail`), summed in their order: [B, T, N*H]."""
    B, T, N, H = q_BTQH.shape
    k_BKSH, v_BKHS, _ = past
    K, S = k_BKSH.shape[1], k_BKSH.shape[2]
    G = N // K
    at = jnp.maximum(slots_BTW, 0)
    span = spec.tail_span
    if 0 < span < S:
        # one contiguous window per row holds every tail: a slice per row (a batched slice
        # would be a gather over the whole cache)
        start_B = jnp.clip(jnp.min(jnp.where(slots_BTW >= 0, slots_BTW, S), axis=(1, 2)), 0, S - span)
        k_BKSH = jnp.concatenate([jax.lax.dynamic_slice(k_BKSH, (b, 0, start_B[b], 0), (1, K, span, H))
                                  for b in range(B)])
        v_BKHS = jnp.concatenate([jax.lax.dynamic_slice(v_BKHS, (b, 0, 0, start_B[b]), (1, K, H, span))
                                  for b in range(B)])
        at = jnp.clip(at - start_B[:, None, None], 0, span - 1)
    k_BKTWH = jax.vmap(lambda k_KSH, i_TW: k_KSH[:, i_TW])(k_BKSH, at)
    v_BKHTW = jax.vmap(lambda v_KHS, i_TW: v_KHS[:, :, i_TW])(v_BKHS, at)
    q = q_BTQH.reshape(B, T, K, G, H)
    s = _scores(jnp.einsum("btkgh,bktwh->btkgw", q.astype(k_BKSH.dtype), k_BKTWH, preferred_element_type=jnp.float32),
                spec)
    valid = (slots_BTW >= 0)[:, :, None, None, :]
    s = jnp.where(valid, s, NEG)
    m_rest = m_BTN.reshape(B, T, K, G)
    m = jnp.maximum(m_rest, jnp.max(s, axis=-1))
    alpha = jnp.exp(m_rest - m)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l = alpha * l_BTN.reshape(B, T, K, G) + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc_BTNH.reshape(B, T, K, G, H) + jnp.einsum(
        "btkgw,bkhtw->btkgh", p.astype(v_BKHS.dtype), v_BKHTW, preferred_element_type=jnp.float32)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(B, T, N * H).astype(q_BTQH.dtype)


def ordered_tail(visible_BTS, width: int):
    """(slots_BTW, rest_BTS) for `AttentionSpec.ordered_tail`: each query's last ``width``
    visible slots in ascending order (-1 first where it sees fewer), and its other visible
    slots (all below the tail's first). ``visible_BTS`` may be [B, 1, S]."""
    S = visible_BTS.shape[-1]
    slot_S = jnp.arange(S, dtype=jnp.int32)
    last, _ = jax.lax.top_k(jnp.where(visible_BTS, slot_S, -1), min(width, S))
    slots_BTW = last[..., ::-1]
    return slots_BTW, visible_BTS & (slot_S < jnp.maximum(slots_BTW[..., :1], 0))


def dot_product_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec: AttentionSpec):
    """The same rule through `jax.nn.dot_product_attention` (keys: the cache's slots, then the block).
    It sums every key in one softmax (`AttentionSpec.ordered_tail` does not apply): its tree rows
    are not bitwise the steps' (chains are)."""
    if spec.softcap is not None:
        raise ValueError("attention_op='dot_product' cannot soft-cap attention scores "
                         "(jax.nn.dot_product_attention has no soft-capping); use attention_op='reference'")
    B, T, N, H = q_BTQH.shape
    if k_new_BTKH is None:        # write-then-attend: the cache's slots only
        k_BKSH, v_BKHS, _ = past
        out = jax.nn.dot_product_attention(q_BTQH, jnp.swapaxes(k_BKSH, 1, 2).astype(q_BTQH.dtype),
                                           jnp.transpose(v_BKHS, (0, 3, 1, 2)).astype(q_BTQH.dtype),
                                           mask=visibility[0][:, None], scale=spec.scale)
        return out.reshape(B, T, N * H).astype(q_BTQH.dtype)
    v_new_BTKH = jnp.nan_to_num(v_new_BTKH, nan=0.0, posinf=0.0, neginf=0.0)
    lengths_B = None if past is None else past[2]
    S = 0 if past is None else past[0].shape[2]
    past_mask, new_mask = causal_mask(lengths_B, T, S) if visibility is None else visibility
    new_mask = jnp.broadcast_to(new_mask, (B, T, T))
    if past is None:
        keys, values, mask = k_new_BTKH, v_new_BTKH, new_mask
    else:
        k_BKSH, v_BKHS, _ = past
        dt = q_BTQH.dtype
        keys = jnp.concatenate([jnp.swapaxes(k_BKSH, 1, 2).astype(dt), k_new_BTKH.astype(dt)], axis=1)
        values = jnp.concatenate([jnp.transpose(v_BKHS, (0, 3, 1, 2)).astype(dt), v_new_BTKH.astype(dt)], axis=1)
        mask = jnp.concatenate([jnp.broadcast_to(past_mask, (B, T, S)), new_mask], axis=-1)
    out = jax.nn.dot_product_attention(q_BTQH, keys.astype(q_BTQH.dtype), values.astype(q_BTQH.dtype),
                                       mask=mask[:, None], scale=spec.scale)
    return out.reshape(B, T, N * H).astype(q_BTQH.dtype)


def pallas_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec: AttentionSpec):
    """Write-then-attend calls by the Pallas kernel (module docstring), the rest by the reference op."""
    if k_new_BTKH is not None:
        return reference_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec)
    k_BKSH, v_BKHS, _ = past
    visible_BTS = visibility[0]
    if not spec.ordered_tail:
        return kernels.cache_attention(
            q_BTQH, k_BKSH, v_BKHS, visible_BTS, scale=spec.scale, softcap=spec.softcap,
            fallback=lambda: _attend_cache(q_BTQH, past, visible_BTS, spec)).astype(q_BTQH.dtype)
    B, T = q_BTQH.shape[:2]
    slots_BTW, rest_BTS = ordered_tail(jnp.broadcast_to(visible_BTS, (B, T, k_BKSH.shape[2])), spec.ordered_tail)
    parts = kernels.cache_attention(q_BTQH, k_BKSH, v_BKHS, rest_BTS, scale=spec.scale, softcap=spec.softcap,
                                    partial=True, fallback=lambda: _cache_parts(q_BTQH, past, rest_BTS, spec))
    return _with_tail(q_BTQH, past, slots_BTW, spec, *parts)


AttentionOp = Callable[..., jax.Array]
ATTENTION_OPS: dict[str, AttentionOp] = {"reference": reference_attention, "dot_product": dot_product_attention,
                                         "pallas": pallas_attention}


def register_attention_op(name: str, op: AttentionOp) -> None:
    """Make ``op(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec) -> [B, T, N*H]`` selectable
    as ``ModelConfig(attention_op=name)``. An op must also take write-then-attend calls:
    ``k_new = v_new = None``, ``visibility = (visible_BTS, None)`` over the cache's slots."""
    if name in ATTENTION_OPS and ATTENTION_OPS[name] is not op:
        raise ValueError(f"attention op {name!r} is already registered")
    ATTENTION_OPS[name] = op


# Cache capacities an op reads without a copy come in multiples of this many slots (the Pallas
# kernel's slot blocks; another capacity is padded to whole blocks, a copy per layer).
SLOT_MULTIPLES: dict[str, int] = {"pallas": kernels.CACHE_SLOT_MULTIPLE}


def slot_multiple(name: str) -> int:
    """The cache capacity multiple attention op ``name`` reads in place (1: any)."""
    get_attention_op(name)
    return SLOT_MULTIPLES.get(name, 1)


def get_attention_op(name: str) -> AttentionOp:
    try:
        return ATTENTION_OPS[name]
    except KeyError:
        raise ValueError(f"unknown attention op {name!r} (registered: {', '.join(ATTENTION_OPS)})") from None


def attention(q_BTQH, k_new_BTKH, v_new_BTKH, past=None, visibility=None, kernel: bool = False,
              spec: AttentionSpec | None = None, op: str = "reference"):
    """Attention by the op named ``op`` (see the module docstring); ``spec`` defaults to
    1/sqrt(head_dim) without soft-capping. ``kernel``: with ``past``, the plain causal rule
    (``visibility`` None) and a short block, `specjax.kernels.decode_attention` computes it
    (where it can run; the op otherwise); callers pass it only for plain attention."""
    spec = spec or AttentionSpec(scale=float(1.0 / np.sqrt(q_BTQH.shape[-1])))
    fn = get_attention_op(op)
    if k_new_BTKH is None:            # write-then-attend (module docstring)
        if past is None or visibility is None or visibility[1] is not None:
            raise ValueError("write-then-attend (k_new None) needs the written cache as past and "
                             "(visible_BTS, None) as visibility")
        return fn(q_BTQH, None, None, past, visibility, spec)
    if isinstance(visibility, TrainingTimeTest):
        return training_time_test_attention(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec)
    if kernel and past is not None and visibility is None:
        v_safe = jnp.nan_to_num(v_new_BTKH, nan=0.0, posinf=0.0, neginf=0.0)
        return kernels.decode_attention(
            q_BTQH, k_new_BTKH, v_safe, *past,
            reference=lambda: fn(q_BTQH, k_new_BTKH, v_new_BTKH, past, None, spec)).astype(q_BTQH.dtype)
    return fn(q_BTQH, k_new_BTKH, v_new_BTKH, past, visibility, spec)
