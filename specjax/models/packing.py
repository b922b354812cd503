"""Packed rows: a block call that computes only the positions each row uses.

A verification block is dense, [B, T] tokens, but in a round where rows draft different
numbers of tokens, row b uses only its first ``counts_B[b]`` positions (the root and its own
drafts). `PackedRows` lists those positions, flattened (``b * T + t``), in a static number N of
slots; ``Llama.apply(..., rows=packed)`` then runs every position-wise part of the decoder (the
norms, the projections, the MLP or the experts, the LM head) on the N listed positions only
and the attention on the dense [B, T] block (attention is per row: each used query attends to
its own row's committed slots and its earlier positions, which are all used). Work then grows
with the positions the rows use, not with the widest row.

Unused positions: their queries, keys and values are zeros inside the attention call (a used
query never sees them: the rule is causal and a row's used positions come first), their
outputs (logits, features) are zeros, and their K/V entries land in the cache past the row's
used positions, where the caller's truncation leaves them as garbage like any rejected draft's.

The N slots hold the used positions first, in row-major order, then unused positions (each
listed once), so a gather or scatter through ``index_N`` touches distinct positions. N must be
at least the number of used positions: a traced count cannot be checked at trace time, so the
caller's allocation guarantees it (`specjax.decoding`'s per-row budget does: it never hands
out more positions than the budget's N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PackedRows:
    """Which positions of a [batch, width] block a call computes (module doc)."""
    index_N: jax.Array                                  # int32 [N]: flat positions b * width + t
    batch: int = struct.field(pytree_node=False)
    width: int = struct.field(pytree_node=False)

    @classmethod
    def leading(cls, counts_B, width: int, size: int) -> "PackedRows":
        """Row b's first ``counts_B[b]`` positions (``counts_B`` traced int [B], each in [0,
        width]) in ``size`` slots (static, ``batch <= size <= batch * width``)."""
        counts_B = jnp.asarray(counts_B, jnp.int32)
        if counts_B.ndim != 1:
            raise ValueError(f"counts_B must be [batch], got shape {counts_B.shape}")
        B = counts_B.shape[0]
        if not 1 <= size <= B * width:
            raise ValueError(f"a packed block of {B} rows x {width} positions has 1 to {B * width} slots, "
                             f"got {size}")
        used_F = (jnp.arange(width)[None] < counts_B[:, None]).reshape(-1)
        order_F = jnp.argsort(~used_F, stable=True)          # used positions first, each list in flat order
        return cls(index_N=order_F[:size].astype(jnp.int32), batch=B, width=width)

    @property
    def size(self) -> int:
        return self.index_N.shape[0]

    def pack(self, x_BT):
        """[B, T, ...] -> [1, N, ...]: the listed positions (a batch of one packed row)."""
        B, T = self.batch, self.width
        if x_BT.shape[:2] != (B, T):
            raise ValueError(f"packing a [{B}, {T}, ...] block, got shape {x_BT.shape}")
        return x_BT.reshape(B * T, *x_BT.shape[2:])[self.index_N][None]

    def unpack(self, x_1N):
        """[1, N, ...] -> [B, T, ...]: each slot back at its position, zeros elsewhere."""
        B, T = self.batch, self.width
        if x_1N.shape[:2] != (1, self.size):
            raise ValueError(f"unpacking [1, {self.size}, ...] packed positions, got shape {x_1N.shape}")
        out = jnp.zeros((B * T, *x_1N.shape[2:]), x_1N.dtype).at[self.index_N].set(x_1N[0], unique_indices=True)
        return out.reshape(B, T, *x_1N.shape[2:])
