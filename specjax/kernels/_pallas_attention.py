"""A Pallas kernel for attention over specjax's KV cache after the block is written.

`cache_attention` computes, for every query of a call, softmax-weighted values over the cache
slots its visibility allows, reading the cache in blocks of ``block_slots`` slots and only up to
each row's last visible slot (the live length): blocks past it are neither fetched nor computed.
It is the write-then-attend form of `specjax.models.attention` (the caller has written the
block's K and V into the cache), so a decode step, a k-token verification block and a token
tree are one kernel with different visibility.

Layouts are the cache's own (`specjax.models.kv_cache`): keys [B, K, S, H], values [B, K, H, S];
no transpose or copy of the cache. One grid step reads one block of slots of every KV head of a
row and the visibility of those slots once for all heads; the G = N / K query heads of a KV head
and the T tokens are its rows. Scores are float32; softmax is the online (flash) form over slot
blocks: a running maximum m, normalizer l and float32 accumulator per query, rescaled by
exp(m_old - m_new) at each block (Milakov & Gimelshein 2018; Dao et al. 2022). Scores are
``cap * tanh(q.k * scale / cap)`` with soft-capping, ``q.k * scale`` without.

Where it runs (chosen when the program is lowered, `jax.lax.platform_dependent`):
* TPU: compiled by Mosaic; the live length is a prefetched scalar per row, so the index map
  clamps the slot block (a repeated block index is not fetched again) and the kernel skips it.
* CPU: Pallas interpret mode, the same kernel body run by XLA (how the tests check it).
* other platforms (GPU): ``fallback``, the caller's reference computation; the GPU's Triton
  lowering has no prefetched scalars.

Precision: each row's result is a function of that row's query and the cache alone; rows of a
call do not mix, so a row of a k-token block computes what the same row computes in a call of
the same shape (the accelerator profiles give every target pass one block shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# A slot block's width: a multiple of 128 (the TPU's lane width; values are [H, S], slots on
# lanes). The cache's capacity is padded up to a whole number of blocks where it is not one.
DEFAULT_BLOCK_SLOTS = 512
LANES = 128
_NEG = float(jnp.finfo(jnp.float32).min)


def _kernel(live_ref, q_ref, k_ref, v_ref, vis_ref, *refs, scale: float, softcap: float | None,
            block_slots: int, num_kv_heads: int, group: int, keys_by_lane: bool, partial: bool):
    """One (row b, slot block j) step. q [1, K, G, T, H]; k [1, K, blk, H] ([1, K, H, blk] with
    ``keys_by_lane``); v [1, K, H, blk]; vis [1, T, blk] int32; o [1, K, G, T, H] (``partial``:
    float32 and unnormalized, then the outputs m_out, l_out [1, K*G, T, LANES]); scratch m, l
    [K*G, T, LANES], acc [K*G, T, H]."""
    if partial:
        o_ref, m_out, l_out, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, m_ref, l_ref, acc_ref = refs
    b, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * block_slots < live_ref[b])
    def _block():
        visible_TS = vis_ref[0] != 0
        for kh in range(num_kv_heads):
            k = k_ref[0, kh]                    # [blk, H], or [H, blk] with keys_by_lane
            v_HS = v_ref[0, kh]
            for g in range(group):
                n = kh * group + g
                q_TH = q_ref[0, kh, g]
                s_TS = jax.lax.dot_general(q_TH.astype(k.dtype), k, (((1,), (0 if keys_by_lane else 1,)), ((), ())),
                                           preferred_element_type=jnp.float32) * scale
                if softcap is not None:
                    s_TS = softcap * jnp.tanh(s_TS / softcap)
                s_TS = jnp.where(visible_TS, s_TS, _NEG)
                m_old = m_ref[n][:, :1]
                m_new = jnp.maximum(m_old, jnp.max(s_TS, axis=1, keepdims=True))
                p_TS = jnp.where(visible_TS, jnp.exp(s_TS - m_new), 0.0)
                alpha = jnp.exp(m_old - m_new)
                l_new = alpha * l_ref[n][:, :1] + jnp.sum(p_TS, axis=1, keepdims=True)
                pv_TH = jax.lax.dot_general(p_TS.astype(v_HS.dtype), v_HS, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
                acc_ref[n] = alpha * acc_ref[n] + pv_TH
                m_ref[n] = jnp.broadcast_to(m_new, m_ref.shape[1:])
                l_ref[n] = jnp.broadcast_to(l_new, l_ref.shape[1:])

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        if partial:
            for kh in range(num_kv_heads):
                for g in range(group):
                    o_ref[0, kh, g] = acc_ref[kh * group + g]
            m_out[0] = m_ref[...]
            l_out[0] = l_ref[...]
            return
        for kh in range(num_kv_heads):
            for g in range(group):
                n = kh * group + g
                l_T1 = l_ref[n][:, :1]
                o_ref[0, kh, g] = jnp.where(l_T1 > 0, acc_ref[n] / jnp.where(l_T1 > 0, l_T1, 1.0),
                                            0.0).astype(o_ref.dtype)


def _pallas_call(q_BKGTH, k, v_BKHS, vis_BTS, live_B, *, scale, softcap, block_slots, interpret, keys_by_lane,
                 partial):
    B, K, G, T, H = q_BKGTH.shape
    S = v_BKHS.shape[3]
    num_blocks = S // block_slots

    def slot_block(b, j, live):
        # blocks past the row's live length map to its last live block: not fetched again
        last = jax.lax.div(jnp.maximum(live[b] - 1, 0), block_slots)     # >= 0: truncation is floor
        return jnp.minimum(j, last)

    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, block_slots=block_slots,
                               num_kv_heads=K, group=G, keys_by_lane=keys_by_lane, partial=partial)
    key_block = (1, K, H, block_slots) if keys_by_lane else (1, K, block_slots, H)
    key_index = (lambda b, j, live: (b, 0, 0, slot_block(b, j, live))) if keys_by_lane else \
        (lambda b, j, live: (b, 0, slot_block(b, j, live), 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, num_blocks),
        in_specs=[
            pl.BlockSpec((1, K, G, T, H), lambda b, j, live: (b, 0, 0, 0, 0)),
            pl.BlockSpec(key_block, key_index),
            pl.BlockSpec((1, K, H, block_slots), lambda b, j, live: (b, 0, 0, slot_block(b, j, live))),
            pl.BlockSpec((1, T, block_slots), lambda b, j, live: (b, 0, slot_block(b, j, live))),
        ],
        out_specs=[pl.BlockSpec((1, K, G, T, H), lambda b, j, live: (b, 0, 0, 0, 0))] + (
            [pl.BlockSpec((1, K * G, T, LANES), lambda b, j, live: (b, 0, 0, 0))] * 2 if partial else []),
        scratch_shapes=[pltpu.VMEM((K * G, T, LANES), jnp.float32),
                        pltpu.VMEM((K * G, T, LANES), jnp.float32),
                        pltpu.VMEM((K * G, T, H), jnp.float32)],
    )
    out_shape = [jax.ShapeDtypeStruct(q_BKGTH.shape, jnp.float32 if partial else q_BKGTH.dtype)]
    if partial:
        out_shape += [jax.ShapeDtypeStruct((B, K * G, T, LANES), jnp.float32)] * 2
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, interpret=interpret, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(live_B, q_BKGTH, k, v_BKHS, vis_BTS)
    if not partial:
        return out[0]
    acc, m, l = out
    return acc, m[..., 0].reshape(B, K, G, T), l[..., 0].reshape(B, K, G, T)


def _slot_block(S: int, block_slots: int) -> int:
    """The widest multiple of LANES up to ``block_slots`` that divides a capacity of S slots;
    for a capacity that is no multiple of LANES, the block the capacity is padded to (a copy
    of the cache per call; `specjax.build` pads prompts, and so rounds capacities, to a
    multiple of LANES for this op: `models.attention.slot_multiple`)."""
    if S % LANES:
        return min(block_slots, -(-S // LANES) * LANES)
    return max(b for b in range(LANES, min(block_slots, S) + 1, LANES) if S % b == 0)


def cache_attention(q_BTQH, k_BKSH, v_BKHS, visible_BTS, *, scale: float, softcap: float | None = None,
                    block_slots: int = DEFAULT_BLOCK_SLOTS, fallback=None, partial: bool = False):
    """Attention of the T queries of each row over the cache slots ``visible_BTS`` allows: [B, T, N*H].

    ``visible_BTS`` [B, T, S] (or [B, 1, S]) bool; the cache already holds this call's keys and
    values. ``fallback()``: what to compute on a platform the kernel does not run on (None: the
    interpreter there too). A query that sees no slot gets zeros. Traced under a mesh
    (`jax.set_mesh`), the kernel runs on each device's rows and KV heads (`_on_mesh`); XLA does
    not partition a Mosaic kernel, so a TPU program over several chips must be traced so.

    ``partial``: the softmax's parts instead, for a caller that adds keys of its own:
    (acc_BTNH, m_BTN, l_BTN), float32, with out = acc / l; m is the largest score, l the sum of
    exp(score - m) and acc the sum of exp(score - m) v (the weights rounded to the values' dtype
    first). ``fallback`` then returns the same triple.
    """
    B, T, N, H = q_BTQH.shape
    K, S = k_BKSH.shape[1], k_BKSH.shape[2]
    if N % K:
        raise ValueError(f"cache_attention: {N} query heads are not a multiple of the cache's {K} KV heads")
    if v_BKHS.shape != (B, K, H, S) or k_BKSH.shape != (B, K, S, H):
        raise ValueError(f"cache_attention: keys {k_BKSH.shape} and values {v_BKHS.shape} are not "
                         f"[B, K, S, H] and [B, K, H, S] for queries {q_BTQH.shape}")
    if block_slots % LANES:
        raise ValueError(f"cache_attention: block_slots={block_slots} is not a multiple of {LANES}")
    G = N // K
    visible_BTS = jnp.broadcast_to(visible_BTS, (B, T, S))
    # the live length: one past the last slot any query of the row sees
    live_B = jnp.max(jnp.where(visible_BTS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=(1, 2)).astype(jnp.int32)
    blk = _slot_block(S, block_slots)
    pad = -S % blk
    vis_BTS = visible_BTS.astype(jnp.int32)
    if pad:          # the capacity rounded up to whole blocks (the padding is never visible)
        k_BKSH = jnp.pad(k_BKSH, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v_BKHS = jnp.pad(v_BKHS, ((0, 0), (0, 0), (0, 0), (0, pad)))
        vis_BTS = jnp.pad(vis_BTS, ((0, 0), (0, 0), (0, pad)))
    q_BKGTH = jnp.transpose(q_BTQH.reshape(B, T, K, G, H), (0, 2, 3, 1, 4))
    # A head width that is no multiple of the lane width: the TPU keeps such keys with slots on
    # lanes (the layout of [B, K, H, S]), so the kernel takes them so, the transpose a relabeling
    # of the same bytes (Mosaic takes row-major operands; [B, K, S, H] would be copied).
    keys_by_lane = H % LANES != 0
    keys = jnp.swapaxes(k_BKSH, 2, 3) if keys_by_lane else k_BKSH

    def kernel_call(interpret):
        def local(q, k, v, vis, live):
            return _pallas_call(q, k, v, vis, live, scale=scale, softcap=softcap, block_slots=blk,
                                interpret=interpret, keys_by_lane=keys_by_lane, partial=partial)
        out = _on_mesh(local, q_BKGTH, keys, v_BKHS, vis_BTS, live_B, partial)
        if not partial:
            return out
        acc_BKGTH, m_BKGT, l_BKGT = out
        to_BTN = lambda x: jnp.transpose(x, (0, 3, 1, 2)).reshape(B, T, N)       # noqa: E731
        return jnp.transpose(acc_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H), to_BTN(m_BKGT), to_BTN(l_BKGT)

    def other():
        if partial:
            return fallback()
        return jnp.transpose(fallback().reshape(B, T, K, G, H).astype(q_BTQH.dtype), (0, 2, 3, 1, 4))

    branches = dict(tpu=lambda: kernel_call(False), cpu=lambda: kernel_call(True))
    branches["default"] = other if fallback is not None else branches["cpu"]
    out = jax.lax.platform_dependent(**branches)
    if partial:
        return out
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N * H)


# The mesh axes rows and KV heads are split over when the call is traced under a mesh
# (`jax.set_mesh`): specjax's meshes are ("data", "fsdp", "model") (`specjax.sharding`), rows
# over data x fsdp and heads over model, as its default logical-axis rules place the cache.
ROW_AXES = ("data", "fsdp")
HEAD_AXIS = "model"


def _on_mesh(local, q_BKGTH, keys, v_BKHS, vis_BTS, live_B, partial: bool = False):
    """``local`` on each device's rows and KV heads under the traced mesh (a Mosaic kernel is not
    partitioned by XLA), or on the whole arrays without one. An axis that does not divide its
    dimension is not split (its dimension stays whole on every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q_BKGTH, keys, v_BKHS, vis_BTS, live_B)
    sizes = dict(mesh.shape)
    B, K = v_BKHS.shape[:2]
    rows = tuple(a for a in ROW_AXES if sizes.get(a, 1) > 1)
    rows = rows if rows and B % int(np.prod([sizes[a] for a in rows])) == 0 else None
    heads = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 and K % sizes[HEAD_AXIS] == 0 else None
    P = jax.sharding.PartitionSpec
    qkv = P(rows, heads)
    out_specs = (qkv, qkv, qkv) if partial else qkv      # acc [B, K, G, T, H]; m, l [B, K, G, T]
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows), P(rows)), out_specs=out_specs,
                         check_vma=False)(q_BKGTH, keys, v_BKHS, vis_BTS, live_B)
