"""A tabular, prefix-dependent toy language model that follows the model `apply` protocol.

The next-token logits at a position are `table[previous token, current token]` (the token
before position 0 counts as 0), so the distribution depends on the prefix and the cache
must really hold the committed history: a wrong rollback changes the outputs.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class ToyCache:
    hist_BS: jax.Array
    lengths_B: jax.Array

    def rollback(self, lengths_B):
        return self.replace(lengths_B=lengths_B)

    def truncate(self, max_lengths_B):
        """Keep at most max_lengths_B entries per row (like `KVCache.truncate`: lengths only)."""
        return self.replace(lengths_B=jnp.minimum(self.lengths_B, jnp.asarray(max_lengths_B, jnp.int32)))

    def commit_path(self, offsets_BA, num_B):
        """Like `KVCache.commit_path`: slot L + j <- slot L + offsets[j] for j < num, L += num."""
        A = offsets_BA.shape[1]

        def row(h, L, off, n):
            src = jnp.take(h, L + off, mode="clip")
            dst = jnp.where(jnp.arange(A) < n, L + jnp.arange(A), h.shape[0])   # out of range: dropped
            return h.at[dst].set(src, mode="drop")

        hist = jax.vmap(row)(self.hist_BS, self.lengths_B, offsets_BA.astype(jnp.int32), num_B.astype(jnp.int32))
        return ToyCache(hist, self.lengths_B + num_B.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class TabularModel:
    vocab_size: int

    def init_cache(self, batch_size, capacity):
        return ToyCache(jnp.zeros((batch_size, capacity), jnp.int32), jnp.zeros((batch_size,), jnp.int32))

    def apply(self, table_VVV, tokens_BT, cache, num_valid_B=None, tree=None, rows=None):
        """``rows`` (`specjax.models.PackedRows`, a row-budget round): the positions not listed
        get zero logits, as in `specjax.models.Llama`'s packed pass (a round that read one would
        draw from the uniform law there: the distribution tests' negative control)."""
        B, T = tokens_BT.shape
        if tree is not None:
            return self._apply_tree(table_VVV, tokens_BT, cache, tree)
        if rows is not None:
            logits, cache = self.apply(table_VVV, tokens_BT, cache, num_valid_B)
            used_BT = rows.unpack(jnp.ones((1, rows.size), bool))
            return jnp.where(used_BT[..., None], logits, 0.0), cache
        if cache is None:
            prev_BT = jnp.concatenate([jnp.zeros((B, 1), tokens_BT.dtype), tokens_BT[:, :-1]], axis=1)
            return table_VVV[prev_BT, tokens_BT], None
        if num_valid_B is None:
            num_valid_B = jnp.full((B,), T, jnp.int32)
        start_B = cache.lengths_B
        hist = jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t.astype(h.dtype), (s,)))(
            cache.hist_BS, tokens_BT, start_B)
        prev_idx_BT = start_B[:, None] + jnp.arange(T)[None] - 1
        prev_BT = jnp.where(prev_idx_BT >= 0,
                            jnp.take_along_axis(hist, jnp.maximum(prev_idx_BT, 0), axis=1), 0)
        logits = table_VVV[prev_BT, tokens_BT]
        return logits, ToyCache(hist, start_B + num_valid_B)


    @staticmethod
    def _apply_tree(table_VVV, tokens_BT, cache, tree):
        """Tree attention for the toy: the block is written at L + offset + t, the lengths stay;
        a token's previous token is its deepest visible window entry other than itself (its
        parent), else the last committed one."""
        B, T = tokens_BT.shape
        W = tree.visible_BTW.shape[2]
        offset = W - T
        start_B = cache.lengths_B
        hist = jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t.astype(h.dtype), (s,)))(
            cache.hist_BS, tokens_BT, start_B + offset)
        not_self_TW = jnp.arange(W)[None, :] != (offset + jnp.arange(T))[:, None]
        vis_BTW = tree.visible_BTW & not_self_TW[None]
        deepest_BT = jnp.max(jnp.where(vis_BTW, jnp.arange(W)[None, None], -1), axis=2)
        idx_BT = jnp.where(deepest_BT >= 0, start_B[:, None] + deepest_BT, start_B[:, None] - 1)
        prev_BT = jnp.where(idx_BT >= 0, jnp.take_along_axis(hist, jnp.maximum(idx_BT, 0), axis=1), 0)
        return table_VVV[prev_BT, tokens_BT], ToyCache(hist, start_B)


def random_table(key, vocab_size, peak=3.0):
    """Peaked random logits table [V, V, V]."""
    return peak * jax.random.normal(key, (vocab_size, vocab_size, vocab_size), jnp.float32)


def sequence_probs(table_VVV, prompt, n_tokens, probs_fn):
    """Exact probability of every continuation of length n_tokens (dict tuple -> prob)."""
    V = table_VVV.shape[0]
    probs = np.asarray(probs_fn(table_VVV))  # [V, V, V] next-token distributions
    out = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        full = list(prompt) + list(seq)
        pr = 1.0
        for i in range(len(prompt), len(full)):
            prev = full[i - 2] if i >= 2 else 0
            pr *= probs[prev, full[i - 1], full[i]]
        out[seq] = pr
    return out


@dataclasses.dataclass(frozen=True)
class StrippedConfigDrafter:
    """A control drafter: ``inner`` proposing under the round's sampling config with ``fields``
    set to None (e.g. the penalties or the automata dropped). Its q is still what it sampled
    from, so the output stays exact; only acceptance changes."""
    inner: object
    fields: tuple

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _plain(self, cfg):
        return cfg.replace(**{f: None for f in self.fields})

    def propose(self, params, state, context, key_B, gamma, cfg):
        return self.inner.propose(params, state, context, key_B, gamma, self._plain(cfg))

    def propose_tree(self, params, state, context, key_B, tree, cfg, children):
        return self.inner.propose_tree(params, state, context, key_B, tree, self._plain(cfg), children)
