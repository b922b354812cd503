"""The shared runtime of the EAGLE-family heads: `EagleHead`, a model of the `apply` protocol
over its own `HeadCache`, and `FeatureHeadDrafter`, which drives it with `ModelDrafter`'s
catch-up, rollout and commit unchanged.

A head keeps, per cache slot s, the entry of token ``x_s`` read with the feature of position
s - 1 (`_family` has the indexing), its layer's K/V and its own output ``h_s`` there. The
feature before an entry is the target's where the engine has it, else the head's own output
(drafting continues in feature space). The layer, its cache and the feature fusion are the
kind's (`EagleFamily` hooks), so every EAGLE-family kind runs in this one head and drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters._model import ModelDrafter, ModelDraftState, expand, rollout
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.drafters.heads._config import HeadConfig, head_logits, head_scores
from specjax.models import prefill
from specjax.models.kv_cache import KVCache


def fuse_features(hc: HeadConfig, params: dict, f_BTF) -> jax.Array:
    """The target features as the head's D-wide input (the EAGLE-3 kinds fuse their layers)."""
    return hc.spec.fuse(hc, params, f_BTF)


@struct.dataclass
class HeadCache:
    """An EAGLE head's state: its layer's K/V, its output feature per slot, and (during a call
    only) the target's features with how many positions have them."""
    kv: KVCache
    pred_BSD: jax.Array            # the head's output at each slot (its prediction of f_s)
    true_len_B: jax.Array          # positions < true_len_B have target features
    true_BSF: Any = None           # the target's features [B, S, F] (None in stored state)
    # Static: inside a rollout, where every step reads the head's own previous output and no
    # target feature, so the features need not be carried (one-token calls only).
    drafting: bool = struct.field(pytree_node=False, default=False)

    @property
    def lengths_B(self):
        return self.kv.lengths_B

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def limit_attention(self, limit):
        return self.replace(kv=self.kv.limit_attention(limit))

    def rollback(self, lengths_B) -> "HeadCache":
        return self.replace(kv=self.kv.rollback(lengths_B))

    def truncate(self, max_lengths_B) -> "HeadCache":
        return self.replace(kv=self.kv.truncate(max_lengths_B))


def _write_slots(buf_BSD, new_BTD, start_B):
    return jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new.astype(row.dtype), (s, 0)))(
        buf_BSD, new_BTD, start_B)


@dataclasses.dataclass(frozen=True)
class EagleHead:
    """The EAGLE / EAGLE-3 head as a protocol model over a `HeadCache` (chains and tree calls)."""
    config: HeadConfig

    @property
    def vocab_size(self) -> int:
        return self.config.target.vocab_size

    def init_cache(self, batch_size: int, capacity: int) -> HeadCache:
        c = self.config
        kv = c.spec.init_layer_cache(c, batch_size, capacity)
        return HeadCache(kv=kv,
                         pred_BSD=jnp.zeros((batch_size, capacity, c.hidden_size), c.target.jnp_dtype),
                         true_len_B=jnp.zeros((batch_size,), jnp.int32))

    def apply(self, params, tokens_BT, cache: HeadCache, num_valid_B=None, tree=None):
        """Entries for tokens at slots ``lengths_B + t``; the feature before each is the
        target's where known (``< true_len_B``), else the head's own output there (which, for
        t > 0, must already be in the cache: a call never needs its own outputs). With a tree
        block see `_apply_tree`."""
        if tree is not None:
            return self._apply_tree(params, tokens_BT, cache, tree)
        h_BTD, cache = self._chain(params, tokens_BT, cache, num_valid_B)
        return head_logits(self.config, params, h_BTD), cache

    def apply_support(self, params, tokens_BT, cache: HeadCache, num_valid_B=None):
        """`apply` with the logits over the head's own tokens only: (scores [B, T, S], the
        reduced head's token ids or None for the full vocabulary, cache); see
        `specjax.drafters.support_scores`."""
        h_BTD, cache = self._chain(params, tokens_BT, cache, num_valid_B)
        scores, ids = head_scores(self.config, params, h_BTD)
        return scores, ids, cache

    def _chain(self, params, tokens_BT, cache: HeadCache, num_valid_B):
        hc = self.config
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        B, T = tokens_BT.shape
        start_B = cache.lengths_B
        prev_BT = start_B[:, None] + jnp.arange(T)[None, :] - 1
        idx_BT1 = jnp.clip(prev_BT, 0, cache.capacity - 1)[..., None]
        pred_BTD = jnp.take_along_axis(cache.pred_BSD, idx_BT1, axis=1)
        if cache.true_BSF is None:
            # Drafting steps past the committed prefix read only the head's own outputs.
            if not cache.drafting or T != 1:
                raise ValueError("the head needs the target's features in its cache for this call "
                                 "(only one-token drafting steps run without them)")
            g_BTD = pred_BTD
        else:
            true_BTF = jnp.take_along_axis(cache.true_BSF, idx_BT1, axis=1)
            g_BTD = jnp.where((prev_BT < cache.true_len_B[:, None])[..., None],
                              fuse_features(hc, params, true_BTF.astype(pred_BTD.dtype)), pred_BTD)
        g_BTD = jnp.where((prev_BT >= 0)[..., None], g_BTD, 0)
        h_BTD, kv = self._layer_call(params, tokens_BT, g_BTD, cache.kv, num_valid_B)
        return h_BTD, cache.replace(kv=kv, pred_BSD=_write_slots(cache.pred_BSD, h_BTD, start_B))

    def _layer_call(self, params, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        """The head's layer on (tokens, features) over its cache: (output [B, T, D], cache)."""
        return self.config.spec.layer_call(self.config, params, tokens_BT, g_BTD, kv, num_valid_B, tree)

    def _apply_tree(self, params, tokens_BT, cache: HeadCache, tree):
        """One tree call (EAGLE-2 drafting): node t's input feature is its parent's head output,
        the parent being its deepest visible tentative entry (the highest visible window column:
        specjax's trees lay depths out in slot order and every node sees its ancestors), or,
        with none visible, the last committed token at slot ``lengths_B - 1``. Nodes are written
        at slots ``lengths_B + offset + t`` like any tree call; the committed slots are untouched."""
        hc = self.config
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        off, start_B = tree.offset, cache.lengths_B
        if off:
            cols = jnp.where(tree.visible_BTW[:, :, :off], jnp.arange(off, dtype=jnp.int32), -1)
            col_BT = jnp.max(cols, axis=-1)
        else:
            col_BT = jnp.full(tokens_BT.shape, -1, jnp.int32)
        parent_BT = jnp.where(col_BT >= 0, start_B[:, None] + col_BT, start_B[:, None] - 1)
        g_BTD = jnp.take_along_axis(cache.pred_BSD, jnp.clip(parent_BT, 0, cache.capacity - 1)[..., None], axis=1)
        g_BTD = jnp.where((parent_BT >= 0)[..., None], g_BTD, 0)
        h_BTD, kv = self._layer_call(params, tokens_BT, g_BTD, cache.kv, tree=tree)
        cache = cache.replace(kv=kv, pred_BSD=_write_slots(cache.pred_BSD, h_BTD, start_B + off))
        return head_logits(hc, params, h_BTD), cache


@dataclasses.dataclass(frozen=True)
class FeatureHeadDrafter(ModelDrafter):
    """An EAGLE / EAGLE-3 head driven by `ModelDrafter` (catch-up, `lax.scan` rollout, commit),
    reading the target's features from the context. Its cache keeps only entries made from
    the target's own features: after a round it is cut back to the last slot whose input
    feature was the target's, and the accepted tokens are re-ingested with their true features
    next round (as EAGLE does)."""
    model: EagleHead

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.config.feature_layers

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(feature_layers=self.model.config.feature_layers, own_cache=True, trees=True)

    def init(self, params, prompt_BP, prompt_lengths_B, capacity, features_BPF=None):
        if features_BPF is None:
            raise ValueError("a feature head's init needs the target's prompt features (features_BPF)")
        B, P = prompt_BP.shape
        cache = jax.lax.optimization_barrier(self.model.init_cache(B, capacity))
        true_BSF = jnp.zeros((B, capacity, features_BPF.shape[-1]), features_BPF.dtype).at[:, :P].set(features_BPF)
        cache = cache.replace(true_BSF=true_BSF, true_len_B=prompt_lengths_B - 1)
        cache = prefill(self.model, params, prompt_BP, cache, prompt_lengths_B - 1, start_bound=0)
        return ModelDraftState(cache=cache.replace(true_BSF=None))

    def _with_features(self, state, context: DraftContext):
        if context.features is None:
            raise ValueError("the engine gave no target features to a feature head (its feature_layers are unset?)")
        return state.cache.replace(true_BSF=context.features, true_len_B=context.lengths_B - 1)

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        # The target's features are needed only to catch up on the committed tokens; the
        # rollout's steps read the head's own outputs, so its scan does not carry them.
        scores_BU, ids, cache = self._catch_up_support(params, self._with_features(state, context), context)
        tokens_BG, q_BGV, cache = rollout(self.model, params, cache.replace(true_BSF=None, drafting=True),
                                          scores_BU, key_B, gamma, cfg, ids)
        return tokens_BG, q_BGV, ModelDraftState(cache=cache.replace(drafting=False))

    def propose_tree(self, params, state, context: DraftContext, key_B, tree, cfg, children):
        """A static or EAGLE-2 dynamic tree from the head's own confidences (`expand`); the
        head's tentative entries are dropped at commit (they were made from its predictions)."""
        logits_BV, cache = self._catch_up(params, self._with_features(state, context), context)
        draft, q_BN1V, cache = expand(self.model, params, cache.replace(true_BSF=None, drafting=True), logits_BV,
                                      key_B, tree, cfg, children)
        return draft.replace(draft_slots_BN=None), q_BN1V, ModelDraftState(cache=cache.replace(drafting=False))

    def check_tree(self, tree) -> None:
        pass

    def commit(self, state, new_lengths_B, accepted=None):
        # Slots <= true_len (the last committed token at the round's start) were made from
        # the target's features; later ones from the head's own predictions: drop those.
        cache = state.cache
        keep_B = jnp.minimum(new_lengths_B - 1, cache.true_len_B + 1)
        return ModelDraftState(cache=cache.truncate(keep_B))
