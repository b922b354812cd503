"""The KV cache: one preallocated buffer per K and V, per-row committed lengths, O(1) rollback.

Layout: ``k_LBKSH`` / ``v_LBKSH`` = [layers, batch, kv_heads, slots, head_dim].

Why kv-heads before slots: attention is a batched matmul over (batch, kv_head) with the
contraction over head_dim (scores) or slots (values). With [.., K, S, H] the batch dims are
leading and each (b, k) block is a contiguous [S, H] matrix, so XLA on CPU feeds the cache
straight into the dot without transposing (= copying) it every decode step; the alternative
[.., S, K, H] layout forces a transpose of the whole per-layer cache per step.

Slot s of row b holds the token at position s. ``lengths_B[b]`` is the number of committed
tokens; slots at or beyond it hold garbage that is never attended to (the model masks them),
so rolling back is just ``cache.rollback(shorter_lengths)``: no copy, no zeroing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models._protocol import CacheCapacityError


@struct.dataclass
class KVCache:
    k_LBKSH: jax.Array
    v_LBKSH: jax.Array
    lengths_B: jax.Array  # int32 [B]

    @classmethod
    def zeros(cls, num_layers: int, batch_size: int, num_kv_heads: int, capacity: int,
              head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        return cls(k_LBKSH=jnp.zeros(shape, dtype), v_LBKSH=jnp.zeros(shape, dtype),
                   lengths_B=jnp.zeros((batch_size,), jnp.int32))

    @property
    def num_layers(self) -> int:
        return self.k_LBKSH.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k_LBKSH.shape[1]

    @property
    def capacity(self) -> int:
        return self.k_LBKSH.shape[3]

    def rollback(self, lengths_B) -> "KVCache":
        """Forget everything past ``lengths_B`` (per row). Never copies the buffers."""
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        lengths_B = jnp.broadcast_to(lengths_B, self.lengths_B.shape)
        return self.replace(lengths_B=lengths_B)

    def advance(self, num_B) -> "KVCache":
        return self.replace(lengths_B=self.lengths_B + jnp.asarray(num_B, jnp.int32))

    def check_fits(self, num_new: int) -> None:
        """Host-side check that ``num_new`` more tokens per row fit (syncs ``lengths_B``)."""
        longest = int(jax.device_get(self.lengths_B).max(initial=0))
        if longest + int(num_new) > self.capacity:
            raise CacheCapacityError(
                f"cache capacity {self.capacity} is too small: a row already holds {longest} "
                f"tokens and {num_new} more were requested.")


def write_kv(buf_LBKSH: jax.Array, new_LBTKH: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Write this call's entries of all layers at slots ``lengths_B[b] + t`` (per row).

    One update of the full buffer, so inside a jitted step with the cache donated XLA
    writes in place: a ``dynamic_update_slice`` for batch 1 (note: a dynamic slice start is
    clamped to stay in bounds, so capacity must be checked on the host beforehand), a
    scatter otherwise (out-of-range writes of padding are dropped).
    """
    return write_kv_slab(buf_LBKSH, 0, new_LBTKH, lengths_B)


def write_kv_layer(buf_LBKSH: jax.Array, layer: int, new_BTKH: jax.Array,
                   lengths_B: jax.Array) -> jax.Array:
    """`write_kv` for one layer (``new_BTKH`` [B, T, K, H]) of the full buffer."""
    return write_kv_slab(buf_LBKSH, layer, new_BTKH[None], lengths_B)


def write_kv_slab(buf_LBKSH, first_layer: int, new_LBTKH, lengths_B):
    """Write layers [first_layer, first_layer + L) of ``new_LBTKH`` [L, B, T, K, H]."""
    L, B, T = new_LBTKH.shape[:3]
    # Non-finite K/V only ever belong to positions whose logits are non-finite too; such a
    # position is never committed (the engine stops the row before it), but its slot stays
    # in the buffer past the row's length, and a masked slot still enters the value matmul
    # with weight 0 (0 * NaN = NaN). Zeroing non-finite entries keeps masked garbage inert.
    new_LBTKH = jnp.nan_to_num(new_LBTKH.astype(buf_LBKSH.dtype), nan=0.0, posinf=0.0, neginf=0.0)
    if B == 1:
        upd = jnp.swapaxes(new_LBTKH, 2, 3)
        zero = jnp.int32(0)
        return jax.lax.dynamic_update_slice(
            buf_LBKSH, upd, (jnp.int32(first_layer), zero, zero,
                             lengths_B[0].astype(jnp.int32), zero))
    pos_BT = lengths_B[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
    b_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]
    # Advanced indices (b, pos) broadcast to [B, T]; separated from the leading slice they
    # move to the front, so the indexed view is [B, T, L, K, H].
    upd = jnp.transpose(new_LBTKH, (1, 2, 0, 3, 4))
    return buf_LBKSH.at[first_layer:first_layer + L, b_B1, :, pos_BT, :].set(upd, mode="drop")
