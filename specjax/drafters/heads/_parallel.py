"""The parallel block drafter (``parallel``): a whole block of draft tokens from one forward of
a small transformer conditioned on the target's features.

Drafting one token at a time makes a gamma-token draft cost gamma sequential forwards. PARD
(An et al. 2025, arXiv:2504.18583) and DFlash (arXiv:2602.06036) instead append placeholder
positions after the context and predict every one of them in the same forward. specjax's
version keeps the EAGLE-3 layer (`_eagle3`: one decoder layer over (token, fused low / middle /
high target feature) entries, its own KV cache of the committed prefix) and adds ``K - 1``
learned placeholder inputs (``block_x``, K = ``HeadConfig.num_heads``, the block size):

* entry s of the prefix, as in EAGLE: ``fc([embed(x_s); fuse(f_{s-1})])`` at slot s; its
  output at the last committed token (slot L - 1) scores ``x_L``, the block's first token;
* placeholder m (m = 0 .. K - 2): input ``block_x[m]`` at position ``L + m``, attending to the
  committed entries and the placeholders <= m; its output scores ``x_{L+1+m}``.

A round of gamma <= K tokens is one call of width (unseen committed entries) + gamma - 1
(`ParallelDrafter._block`): the committed tokens the cache has not seen and the placeholders
go through the layer together (a `TreeBlock` gives each its position and visibility), the
committed entries are kept, the placeholders dropped. The LM head (the target's rows, or a
reduced vocabulary) then scores the gamma outputs.

Training is EAGLE-3's training-time test with K steps (`_family.EagleFamily.train_forward`):
step 1 is the prefix entries; step j > 1 of origin o is the placeholder ``block_x[j-2]`` at
position o + j - 1 seeing the step-1 entries <= o and its own origin's steps 2..j, exactly the
visibility placeholder j - 2 has at inference, and scores ``x_{o+j}``.

Exactness. Position g's token is drawn from q_g, the processed distribution of output g, with
its own key (`specjax.drafters.draw_positions`); the outputs do not depend on the drafted tokens
(placeholders read no token), so q_g is exactly the law the token was drawn from given the
tokens before it, which is all the chain verifiers ask of a draft. With penalties or an
automaton, q_g is processed with the drafted tokens before g in the history, as the target's
distribution at g is. Trees (`propose_tree`): a node at depth d draws its children from q_{d+1}
processed along its own path (`_tree.expand_static` / `expand_dynamic` over `_Positions`,
which answers every depth-d node with output d + 1), so each node's reported q is what its
children were drawn from, which is what the tree verifiers need.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters._model import ModelDraftState, draw_positions, expand
from specjax.drafters._protocol import DraftContext
from specjax.drafters.heads._config import INIT_STD, register_head_kind
from specjax.drafters.heads._config import head_logits, head_scores
from specjax.drafters.heads._eagle import _layer_params, eagle_input
from specjax.drafters.heads._eagle3 import Eagle3
from specjax.drafters.heads._runtime import EagleHead, FeatureHeadDrafter, fuse_features
from specjax.models import Llama, TreeBlock
from specjax.models import llama as llama_lib


class Parallel(Eagle3):
    """The parallel block drafter as a head kind: EAGLE-3's layer and fusion plus K - 1
    placeholder inputs (``block_x``), trained with K drafting steps at once."""
    name = "parallel"
    autoregressive = False                 # the block is drafted at once (head.ttt_steps must be 1)
    default_ttt_steps = 1
    state_keys = ("head.num_heads", "head.input_norm", "head.feature_layers")

    def check(self, hc):
        if hc.num_heads < 1:
            raise ValueError(f"a parallel drafter needs a block of num_heads >= 1 positions, got {hc.num_heads}")

    def own_names(self, hc):
        return super().own_names(hc) + (("block_x",) if hc.num_heads > 1 else ())

    def init_weights(self, hc, key):
        own = super().init_weights(hc, key)
        if hc.num_heads > 1:
            k = jax.random.fold_in(key, 4)
            own["block_x"] = (INIT_STD * jax.random.normal(k, (hc.num_heads - 1, hc.hidden_size), jnp.float32)
                              ).astype(hc.target.jnp_dtype)
        return own

    def max_steps(self, hc):
        return hc.num_heads

    def drafter(self, hc):
        return ParallelDrafter(EagleHead(hc))

    # -- training
    def train_step(self, hc, params, j, tokens_BT, g_BTD, cos, sin, past, visibility):
        if j == 1:
            return self.train_layer(hc, params, tokens_BT, g_BTD, cos, sin, past, visibility)
        B, T = tokens_BT.shape
        lp = jax.tree.map(lambda x: x[0], params["layers"])
        x_BTD = jnp.broadcast_to(params["block_x"][j - 2].astype(g_BTD.dtype), (B, T, g_BTD.shape[-1]))
        return llama_lib._layer(hc.layer_config, lp, x_BTD, cos, sin, past, visibility)

    def train_outputs(self, hc, params, tokens_BT, f_BTF, steps, origins_BQ=None):
        outs = self.train_forward(hc, params, tokens_BT, f_BTF, hc.num_heads, with_logits=False, origins_BQ=origins_BQ)
        return [(h, j) for j, (h, _) in enumerate(outs)]

    def train_shifts(self, hc, steps):
        return tuple(range(hc.num_heads))

    def eval_outputs(self, hc, params, tokens_BT, f_BTF, steps):
        outs = self.train_forward(hc, params, tokens_BT, f_BTF, min(steps, hc.num_heads), with_logits=False)
        return [h for h, _ in outs]


PARALLEL = register_head_kind(Parallel())


@struct.dataclass
class _PositionLogits:
    """The block's logits [B, G, V] standing in for a draft cache while a tree is expanded."""
    logits_BGV: jax.Array


@dataclasses.dataclass(frozen=True)
class _Positions:
    """A 'model' for `_tree.expand_static` / `expand_dynamic`: a tree call on nodes of depth d
    (relative position d - 1) answers output d + 1 of the block for each, whatever its token,
    since the parallel drafter's outputs do not depend on the drafted tokens."""
    vocab_size: int

    def apply(self, params, tokens_BT, cache: _PositionLogits, num_valid_B=None, tree=None):
        idx_BT1 = jnp.clip(tree.rel_positions_BT + 1, 0, cache.logits_BGV.shape[1] - 1)[..., None]
        return jnp.take_along_axis(cache.logits_BGV, idx_BT1, axis=1), cache


@dataclasses.dataclass(frozen=True)
class ParallelDrafter(FeatureHeadDrafter):
    """The parallel block drafter (module doc): gamma <= K tokens per round from one layer call.

    Its cache keeps the prefix entries made from the target's features (like the EAGLE head's)
    and has ``K - 1`` slots more than the engine's capacity: a round's call writes the unseen
    committed entries (up to gamma + 1, padded to that width) and then the gamma - 1
    placeholders, past the slots the target's verification block reaches. It reuses the EAGLE
    head's `HeadCache` and prefill; the cache's output features (``pred_BSD``, which EAGLE feeds
    back while drafting) are written at prefill and never read here."""

    @property
    def block_size(self) -> int:
        return self.model.config.num_heads

    def init(self, params, prompt_BP, prompt_lengths_B, capacity, features_BPF=None):
        return super().init(params, prompt_BP, prompt_lengths_B, capacity + self.block_size - 1, features_BPF)

    def forward_passes(self, gamma: int) -> int:
        return 1

    def tree_forward_passes(self, tree) -> int:
        return 1

    def check_gamma(self, gamma: int) -> None:
        if gamma > self.block_size:
            raise ValueError(f"a parallel drafter with a block of {self.block_size} positions drafts at most "
                             f"that many tokens per round, asked for {gamma}")

    def check_tree(self, tree) -> None:
        self.check_gamma(tree.max_depth)

    def _entries(self, params, cache, context: DraftContext, width: int):
        """The layer inputs [B, width, D] of the prefix entries at slots ``lengths + t`` (token
        ``x_s`` with the target's fused ``f_{s-1}``), with how many of them are committed
        tokens the cache has not seen ([B], at most ``width``); the others are finite filler."""
        hc = self.model.config
        tokens_BS, L_B, f_BSF = context.tokens_BS, context.lengths_B, context.features
        c_B = cache.kv.lengths_B
        n_B = jnp.clip(L_B - c_B, 0, width).astype(jnp.int32)
        slot_BW = c_B[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        valid_BW = jnp.arange(width)[None] < n_B[:, None]
        tok_BW = jnp.take_along_axis(tokens_BS, jnp.clip(slot_BW, 0, tokens_BS.shape[1] - 1), axis=1)
        tok_BW = jnp.where(valid_BW, tok_BW, 0)
        prev_BW = slot_BW - 1
        f_BWF = jnp.take_along_axis(f_BSF, jnp.clip(prev_BW, 0, f_BSF.shape[1] - 1)[..., None], axis=1)
        dtype = cache.pred_BSD.dtype
        g_BWD = fuse_features(hc, params, f_BWF.astype(dtype))
        g_BWD = jnp.where((valid_BW & (prev_BW >= 0))[..., None], g_BWD, 0)
        return eagle_input(hc, params, tok_BW, g_BWD), n_B

    def _block(self, params, state, context: DraftContext, gamma: int):
        """One layer call over the unseen committed entries and gamma - 1 placeholders ->
        (the outputs that score the block's gamma tokens [B, gamma, D], the state whose cache
        holds the entries of all ``lengths_B`` committed tokens)."""
        if context.features is None:
            raise ValueError("the engine gave no target features to the parallel drafter (feature_layers unset?)")
        hc = self.model.config
        layer = Llama(hc.run_layer_config)
        lp = _layer_params(hc, params)
        L_B = context.lengths_B
        W, M = gamma + 1, gamma - 1
        cache = state.cache

        # Unseen committed tokens beyond W (after rounds of a larger gamma or without drafting):
        # ingest W at a time first. A fixed-gamma loop never enters this while_loop.
        def behind(c):
            return jnp.any(L_B - c.kv.lengths_B > W)

        def ingest(c):
            x_BWD, n_B = self._entries(params, c, context, W)
            n_B = jnp.where(L_B - c.kv.lengths_B > W, n_B, 0)
            _, _, kv = layer.trunk(lp, None, c.kv, num_valid_B=n_B, inputs_BTD=x_BWD)
            return c.replace(kv=kv)

        cache = jax.lax.while_loop(behind, ingest, cache)
        x_BWD, n_B = self._entries(params, cache, context, W)
        n_B = jnp.maximum(n_B, 1)                  # a finished row: its last token again (never committed)
        B, D = x_BWD.shape[0], x_BWD.shape[-1]
        t_W, m_M = jnp.arange(W), jnp.arange(M)
        x_BTD = jnp.concatenate([x_BWD, jnp.broadcast_to(params["block_x"][:M].astype(x_BWD.dtype), (B, M, D))], 1) \
            if M else x_BWD
        rel_BT = jnp.concatenate([jnp.broadcast_to(t_W[None], (B, W)), n_B[:, None] + m_M[None]], axis=1)
        # entries: causal among themselves; placeholders: the unseen committed entries and placeholders <= own
        vis_entries_BWT = jnp.broadcast_to(jnp.concatenate([t_W[:, None] >= t_W[None], jnp.zeros((W, M), bool)], 1),
                                           (B, W, W + M))
        vis_place_BMT = jnp.concatenate([jnp.broadcast_to(t_W[None, None] < n_B[:, None, None], (B, M, W)),
                                         jnp.broadcast_to(m_M[:, None] >= m_M[None], (B, M, M))], axis=2)
        block = TreeBlock(rel_positions_BT=rel_BT.astype(jnp.int32),
                          visible_BTW=jnp.concatenate([vis_entries_BWT, vis_place_BMT], axis=1))
        h_BTD, _, kv = layer.trunk(lp, None, cache.kv, tree=block, inputs_BTD=x_BTD)
        kv = kv.rollback(cache.kv.lengths_B + n_B)
        h_last_BD = jnp.take_along_axis(h_BTD[:, :W], (n_B - 1)[:, None, None], axis=1)[:, 0]
        h_BGD = jnp.concatenate([h_last_BD[:, None], h_BTD[:, W:]], axis=1)
        return h_BGD, ModelDraftState(cache=cache.replace(kv=kv))

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        self.check_gamma(gamma)
        h_BGD, state = self._block(params, state, context, gamma)
        scores_BGU, ids = head_scores(self.model.config, params, h_BGD)
        tokens_BG, q_BGV = draw_positions(key_B, scores_BGU, ids, cfg, self.vocab_size)
        return tokens_BG, q_BGV, state

    def propose_tree(self, params, state, context: DraftContext, key_B, tree, cfg, children):
        self.check_tree(tree)
        h_BGD, state = self._block(params, state, context, tree.max_depth)
        logits_BGV = head_logits(self.model.config, params, h_BGD)
        draft, q_BN1V, _ = expand(_Positions(self.vocab_size), params, _PositionLogits(logits_BGV),
                                  logits_BGV[:, 0], key_B, tree, cfg, children)
        return draft.replace(draft_slots_BN=None), q_BN1V, state

    def commit(self, state, new_lengths_B, accepted=None):
        # The cache holds the committed prefix's entries only (placeholders are past its lengths).
        return ModelDraftState(cache=state.cache.truncate(new_lengths_B - 1))
