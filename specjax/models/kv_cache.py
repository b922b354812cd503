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
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

Buffers = Union[jax.Array, tuple]   # k: [L, B, K, S, H] or L x [B, K, S, H]; v: [.., H, S]


@struct.dataclass
class KVCache:
    k: Buffers
    v: Buffers
    lengths_B: jax.Array  # int32 [B]

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

    def rollback(self, lengths_B) -> "KVCache":
        """Forget everything past ``lengths_B`` (per row). Never copies the buffers."""
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        lengths_B = jnp.broadcast_to(lengths_B, self.lengths_B.shape)
        return self.replace(lengths_B=lengths_B)

    def truncate(self, max_lengths_B) -> "KVCache":
        """Keep at most ``max_lengths_B`` entries per row (a rollback that never grows a row)."""
        return self.rollback(jnp.minimum(self.lengths_B, jnp.asarray(max_lengths_B, jnp.int32)))


def logical_axes(cache: KVCache) -> KVCache:
    """A `KVCache`-shaped pytree of logical axis names (for `specjax.sharding`)."""
    k_axes = ("batch", "kv", "sequence", "head_dim")
    v_axes = ("batch", "kv", "head_dim", "sequence")
    if cache.per_layer:
        return KVCache(k=tuple(k_axes for _ in cache.k), v=tuple(v_axes for _ in cache.v),
                       lengths_B=("batch",))
    return KVCache(k=("layers",) + k_axes, v=("layers",) + v_axes, lengths_B=("batch",))


def write_kv(k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array,
             lengths_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write this call's K and V entries at slots ``lengths_B[b] + t`` (per row).

    ``k_buf`` [..., B, K, S, H] and ``v_buf`` [..., B, K, H, S] (the module docstring's layouts),
    ``k_new`` / ``v_new`` [..., B, T, K, H], with the same leading dims: none for one layer's
    buffers, [L] for the stacked layout. One update per buffer, so inside a jitted step with
    the cache donated XLA writes in place: a ``dynamic_update_slice`` for batch 1 (note: a
    dynamic slice start is clamped to stay in bounds, so capacity must be checked on the host
    beforehand), a scatter otherwise (out-of-range writes of padding are dropped).
    """
    return (_write(k_buf, k_new, lengths_B, slots_last=False),
            _write(v_buf, v_new, lengths_B, slots_last=True))


def _write(buf, new, lengths_B, slots_last: bool):
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
