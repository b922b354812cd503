"""The KV cache: preallocated K and V buffers, per-row committed lengths, O(1) rollback.

Two layouts of the same content, chosen by the model (``config.scan_layers``; `Llama.apply`
accepts only the layout its own `init_cache` makes):

* stacked: ``k`` is one array [layers, batch, kv_heads, slots, head_dim] and ``v`` one array
  [layers, batch, kv_heads, head_dim, slots], for the `lax.scan` layer loop (one in-place
  write of every layer after the scan);
* per-layer: ``k`` / ``v`` are tuples of ``num_layers`` arrays, k [batch, kv_heads, slots,
  head_dim] and v [batch, kv_heads, head_dim, slots], for the unrolled layer loop: each layer
  reads and then writes its own buffer, so with the cache donated XLA updates every buffer in
  place (with one stacked buffer, the unrolled loop's static per-layer slices made XLA CPU
  copy the whole cache every step), and an early-exit draft's view of the first k layers is a tuple
  slice, not a copy.

Why these layouts: attention is two batched matmuls over (batch, kv_head): scores contract
head_dim (q against k), values contract slots (probabilities against v). XLA CPU's matmul
kernels take the right operand with its contraction dim last, so k is stored [.., S, H] and v
[.., H, S]: both feed their dot as they are. Stored [.., S, H], v was transposed (= copied
whole) by every layer at every decode step (experiments/bench_speed/PROFILE.md). `write_kv` is
the one place that writes either.

Slot s of row b holds the token at position s. ``lengths_B[b]`` is the number of committed
tokens; slots at or beyond it hold garbage that is never attended to (the model masks them),
so rolling back is just ``cache.rollback(shorter_lengths)``: no copy, no zeroing.

Tree blocks (`TreeBlock`, ``Llama.apply(..., tree=...)``) write *tentative* entries past the
committed length without advancing it: a tree's nodes sit at slots ``lengths_B + offset + t``
in block order, not at their positions, and a node's position (``lengths_B + rel_position``)
differs from its slot. Once a path is accepted, `KVCache.commit_path` moves its entries to the
slots of their positions (``lengths_B + j`` for the path's j-th token) and advances the length;
whatever stays past the new length (rejected branches) is garbage like any other.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

Buffers = Union[jax.Array, tuple]   # k: [L, B, K, S, H] or L x [B, K, S, H]; v: [.., H, S]


@struct.dataclass
class TreeBlock:
    """How the T tokens of one tree call see each other and where they sit (traced arrays).

    ``rel_positions_BT`` int32 [B, T]: token t of row b has position
    ``cache.lengths_B[b] + rel_positions_BT[b, t]`` (its RoPE position).

    ``visible_BTW`` bool [B, T, W] with W = offset + T and the static ``offset = W - T >= 0``:
    query t sees slot ``lengths_B[b] + w`` (w < W) iff ``visible_BTW[b, t, w]``. The block's
    own tokens are written at slots ``lengths_B[b] + offset + t`` (columns offset .. W-1 are the
    block itself and replace the causal mask); columns 0 .. offset-1 are a window over slots
    ``lengths_B[b] .. lengths_B[b] + offset - 1``, tentative entries written by earlier tree
    calls of the same round (a drafter's previous depths). Besides the window and the block,
    every query sees every committed slot ``s < lengths_B[b]``.
    """
    rel_positions_BT: jax.Array   # int32 [B, T]
    visible_BTW: jax.Array        # bool [B, T, offset + T]

    @property
    def num_tokens(self) -> int:
        return self.rel_positions_BT.shape[1]

    @property
    def offset(self) -> int:
        """Slots between the committed length and the block's first slot (static)."""
        return self.visible_BTW.shape[2] - self.rel_positions_BT.shape[1]


@struct.dataclass
class KVCache:
    k: Buffers
    v: Buffers
    lengths_B: jax.Array  # int32 [B]
    # Static: a bound the caller guarantees, ``lengths_B <= attend_limit`` in every row, so
    # attention reads only the first ``attend_limit`` slots (None: all). Chunked prefill sets
    # it per chunk (`specjax.models.prefill`) so chunk j scores the slots before it, not the
    # whole capacity, and clears it afterwards. Tree calls do not take it.
    attend_limit: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def zeros(cls, num_layers: int, batch_size: int, num_kv_heads: int, capacity: int,
              head_dim: int, dtype=jnp.float32, per_layer: bool = False) -> "KVCache":
        k_shape = (batch_size, num_kv_heads, capacity, head_dim)
        v_shape = (batch_size, num_kv_heads, head_dim, capacity)
        if per_layer:
            k = tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers))
            v = tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers))
        else:
            k = jnp.zeros((num_layers,) + k_shape, dtype)
            v = jnp.zeros((num_layers,) + v_shape, dtype)
        return cls(k=k, v=v, lengths_B=jnp.zeros((batch_size,), jnp.int32))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def num_layers(self) -> int:
        return len(self.k) if self.per_layer else self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.lengths_B.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.per_layer else self.k.shape[3]

    @property
    def dtype(self):
        return self.k[0].dtype if self.per_layer else self.k.dtype

    def layer(self, i: int):
        """(k_BKSH, v_BKHS) of layer i (a static slice of the stacked layout)."""
        return self.k[i], self.v[i]

    def first_layers(self, n: int) -> "KVCache":
        """The cache of layers [0, n) with the same lengths (free for the per-layer layout)."""
        return self.replace(k=self.k[:n], v=self.v[:n])

    def limit_attention(self, limit: int | None) -> "KVCache":
        """The same cache with attention reading only slots ``< limit`` (None: all). The
        caller guarantees every row's committed length is at most ``limit``."""
        if limit is not None and not 0 <= limit <= self.capacity:
            raise ValueError(f"attend limit {limit} outside [0, {self.capacity}] (the cache capacity)")
        return self.replace(attend_limit=None if limit is None else int(limit))

    def rollback(self, lengths_B) -> "KVCache":
        """Forget everything past ``lengths_B`` (per row). Never copies the buffers."""
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        lengths_B = jnp.broadcast_to(lengths_B, self.lengths_B.shape)
        return self.replace(lengths_B=lengths_B)

    def truncate(self, max_lengths_B) -> "KVCache":
        """Keep at most ``max_lengths_B`` entries per row (a rollback that never grows a row)."""
        return self.rollback(jnp.minimum(self.lengths_B, jnp.asarray(max_lengths_B, jnp.int32)))

    def commit_path(self, offsets_BA, num_B) -> "KVCache":
        """Commit an accepted path of tentative tree entries: for every row b and ``j < num_B[b]``,
        slot ``lengths_B[b] + j`` receives the K and V of slot ``lengths_B[b] + offsets_BA[b, j]``;
        then ``lengths_B += num_B``.

        ``offsets_BA`` int32 [B, A] (A static): callers guarantee ``offsets_BA[b, j] >= j``,
        strictly increasing over the valid j, and ``lengths_B[b] + offsets_BA[b, j]`` inside the
        capacity. Entries ``j >= num_B[b]`` are ignored; ``num_B`` [B] (or a scalar) is in
        ``[0, A]``. Every buffer is moved with one gather of A slots per row and one write (a
        ``dynamic_update_slice`` for batch 1, a scatter otherwise): in place when the cache is
        donated. Committed slots ``< lengths_B[b]`` and rows with ``num_B[b] = 0`` are unchanged;
        slots at or beyond the new length may hold anything (as after any call).
        """
        offsets_BA = jnp.asarray(offsets_BA, jnp.int32)
        B, S = self.batch_size, self.capacity
        if offsets_BA.ndim != 2 or offsets_BA.shape[0] != B:
            raise ValueError(f"offsets_BA must be [batch={B}, A], got shape {offsets_BA.shape}")
        A = offsets_BA.shape[1]
        if A > S:
            raise ValueError(f"a path of {A} entries does not fit a cache of {S} slots")
        num_B = jnp.broadcast_to(jnp.asarray(num_B, jnp.int32), (B,))
        lengths_B = self.lengths_B.astype(jnp.int32)
        if A == 0:
            return self.replace(lengths_B=lengths_B + num_B)
        # Destination slots: lengths + j. For batch 1 the window starts at min(lengths, S - A),
        # so that the dynamic_update_slice start is never clamped (a clamped start would shift
        # the written entries onto committed slots); entries not on the path rewrite their own
        # slot's content (an identity move), so nothing but the path changes.
        start_B = lengths_B if B > 1 else jnp.minimum(lengths_B, S - A)
        dst_BA = start_B[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]
        j_BA = dst_BA - lengths_B[:, None]
        on_path_BA = (j_BA >= 0) & (j_BA < num_B[:, None])
        off_BA = jnp.take_along_axis(offsets_BA, jnp.clip(j_BA, 0, A - 1), axis=1)
        src_BA = jnp.clip(jnp.where(on_path_BA, lengths_B[:, None] + off_BA, dst_BA), 0, S - 1)
        move = lambda buf, slots_last: _move(buf, src_BA, dst_BA, slots_last)
        if self.per_layer:
            k = tuple(move(b, False) for b in self.k)
            v = tuple(move(b, True) for b in self.v)
        else:
            k, v = move(self.k, False), move(self.v, True)
        return self.replace(k=k, v=v, lengths_B=lengths_B + num_B)


def logical_axes(cache: KVCache) -> KVCache:
    """A `KVCache`-shaped pytree of logical axis names (for `specjax.sharding`)."""
    k_axes = ("batch", "kv", "sequence", "head_dim")
    v_axes = ("batch", "kv", "head_dim", "sequence")
    if cache.per_layer:
        return KVCache(k=tuple(k_axes for _ in cache.k), v=tuple(v_axes for _ in cache.v),
                       lengths_B=("batch",))
    return KVCache(k=("layers",) + k_axes, v=("layers",) + v_axes, lengths_B=("batch",))


def write_kv(k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array,
             lengths_B: jax.Array, per_row: bool = False) -> tuple[jax.Array, jax.Array]:
    """Write this call's K and V entries at slots ``lengths_B[b] + t`` (per row).

    ``k_buf`` [..., B, K, S, H] and ``v_buf`` [..., B, K, H, S] (the module docstring's layouts),
    ``k_new`` / ``v_new`` [..., B, T, K, H], with the same leading dims: none for one layer's
    buffers, [L] for the stacked layout. (A tree block passes ``lengths_B + offset``: the first
    slot past its window.) One update per buffer, so inside a jitted step with
    the cache donated XLA writes in place: a ``dynamic_update_slice`` for batch 1 (note: a
    dynamic slice start is clamped to stay in bounds, so capacity must be checked on the host
    beforehand), a scatter otherwise (out-of-range writes of padding are dropped). ``per_row``
    (one layer's buffers, batch > 1): a loop of one ``dynamic_update_slice`` per row instead of
    the scatter, which the TPU compiler keeps in place when attention then reads the written
    buffer (write-then-attend; with the scatter it copied every buffer: experiments/aot);
    starts are clamped as for batch 1.
    """
    return (_write(k_buf, k_new, lengths_B, slots_last=False, per_row=per_row),
            _write(v_buf, v_new, lengths_B, slots_last=True, per_row=per_row))


def _write(buf, new, lengths_B, slots_last: bool, per_row: bool = False):
    lead = buf.ndim - 4
    B, T = new.shape[lead], new.shape[lead + 1]
    # Non-finite K/V only ever belong to positions whose logits are non-finite too; such a
    # position is never committed (the engine stops the row before it), but its slot stays
    # in the buffer past the row's length, and a masked slot still enters the value matmul
    # with weight 0 (0 * NaN = NaN). Zeroing non-finite entries keeps masked garbage inert.
    new = jnp.nan_to_num(new.astype(buf.dtype), nan=0.0, posinf=0.0, neginf=0.0)
    zero = jnp.int32(0)
    start = lengths_B[0].astype(jnp.int32) if B == 1 else None
    if B == 1 and slots_last:
        upd = jnp.moveaxis(new, lead + 1, lead + 3)                 # [..., B, K, H, T]
        return jax.lax.dynamic_update_slice(buf, upd, (zero,) * (lead + 3) + (start,))
    if B == 1:
        upd = jnp.swapaxes(new, lead + 1, lead + 2)                 # [..., B, K, T, H]
        return jax.lax.dynamic_update_slice(buf, upd, (zero,) * (lead + 2) + (start, zero))
    if per_row and lead == 0:
        upd_BT = jnp.moveaxis(new, 1, 3) if slots_last else jnp.swapaxes(new, 1, 2)   # [B, K, H, T] / [B, K, T, H]

        for b in range(B):
            start = lengths_B[b].astype(jnp.int32)
            idx = (jnp.int32(b), zero, zero, start) if slots_last else (jnp.int32(b), zero, start, zero)
            buf = jax.lax.dynamic_update_slice(buf, upd_BT[b:b + 1], idx)
        return buf
    pos_BT = lengths_B[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
    b_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]
    # The advanced indices (b, pos) broadcast to [B, T]; separated by slices they move to the
    # front, so the indexed view is [B, T, ..., K, H] in either layout.
    upd = jnp.moveaxis(new, (lead, lead + 1), (0, 1))
    if slots_last:
        index = (slice(None),) * lead + (b_B1, slice(None), slice(None), pos_BT)
    else:
        index = (slice(None),) * lead + (b_B1, slice(None), pos_BT, slice(None))
    return buf.at[index].set(upd, mode="drop")


def _move(buf, src_BA, dst_BA, slots_last: bool):
    """``buf`` with slot ``dst_BA[b, a]`` of row b set to the old slot ``src_BA[b, a]`` (every
    layer, head and head dim): one gather, then one write. For batch 1 ``dst_BA`` must be
    consecutive (``dst_BA[0, 0] + a``, in bounds); otherwise out-of-range destinations are dropped."""
    lead = buf.ndim - 4
    B = src_BA.shape[0]
    b_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]

    def index(slots_BA):
        # As in `_write`: the advanced indices (b, slot) move to the front: [B, A, ..., K, H].
        if slots_last:
            return (slice(None),) * lead + (b_B1, slice(None), slice(None), slots_BA)
        return (slice(None),) * lead + (b_B1, slice(None), slots_BA, slice(None))

    moved = buf[index(src_BA)]                                          # [B, A, ..., K, H]
    if B == 1:
        upd = jnp.moveaxis(moved, (0, 1), (lead, lead + (3 if slots_last else 2)))
        zero = jnp.int32(0)
        start = (zero,) * (lead + 3) + (dst_BA[0, 0],) if slots_last else \
            (zero,) * (lead + 2) + (dst_BA[0, 0], zero)
        return jax.lax.dynamic_update_slice(buf, upd, start)
    return buf.at[index(dst_BA)].set(moved, mode="drop")
