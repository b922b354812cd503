"""EAGLE heads (EAGLE-1/2, Li et al. 2024) and the EAGLE-3 style head (Li et al. 2025).

Indexing. ``f_t`` is the target's feature at position t (the residual stream after the chosen
layers, before the final norm); the target's LM head on ``norm(f_t)`` gives the distribution
of token ``x_{t+1}``. At a round with L committed tokens the engine knows ``f_0 .. f_{L-2}``
(the last committed token is the first input of the next verification pass).

* **EAGLE**: the entry at slot s is the pair (token ``x_s``, feature of position s-1):
  ``fc([embed(x_s) ; g_{s-1}])`` (2D -> D), one decoder layer with its own KV cache, output
  ``h_s`` = the head's prediction of ``f_s``, logits of ``x_{s+1}`` from the target's final norm
  and head. ``g_{s-1}`` is the target's ``f_{s-1}`` where known, else the head's own ``h_{s-1}``
  (drafting continues in feature space). Trained with a feature regression (smooth L1 to
  ``f_s``, `Eagle.extra_loss`) plus a divergence to the target's distribution.
* **EAGLE-3 style** (``eagle3``): the target features are a low, a middle and a high layer,
  fused by ``fuse`` (3D -> D) before ``fc``; beyond the known prefix the head's own output
  stands in for the fused feature. No feature regression; training-time test unrolls several
  drafting steps so the head learns from its own predictions (`eagle_train_forward`).
* ``input_norm``: the embedding and the feature are RMS-normalized, each with its own learned
  weight, before ``fc`` (EAGLE-3's reference layer normalizes its two inputs separately before
  concatenating them). The target's features are raw residual streams, far larger than the
  embedding, which otherwise drown the token's half of the input.

Both draft through the target's embedding, final norm and LM head; a reduced-vocabulary head
(``head_size``: the target's head rows of the ``head_ids`` tokens, -inf logit elsewhere) keeps
sampling exact: q is zero off the subset, and the verifier only needs q to be what was sampled.

`EagleHead` is a model of the `apply` protocol over its own `HeadCache`, so `ModelDrafter`'s
catch-up, rollout and commit drive it unchanged (`FeatureHeadDrafter`). Its layer, its cache
and its feature fusion are the kind's (`EagleFamily`), so the published EAGLE-3 layout
(`_eagle3_published`) runs in the same head and drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import kernels
from specjax.drafters._model import ModelDrafter, ModelDraftState, expand, rollout
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.drafters.heads._config import (INIT_STD, HeadConfig, HeadKind, head_logits, head_scores, matmul,
                                            register_head_kind)
from specjax.models import Llama, prefill
from specjax.models import attention as attention_lib
from specjax.models import llama as llama_lib
from specjax.models.kv_cache import KVCache


def eagle_input(hc: HeadConfig, params: dict, tokens_BT, g_BTD) -> jax.Array:
    """``fc([embed(x) ; g])``, each half RMS-normalized first with ``hc.input_norm``: the head
    layer's input [B, T, D]."""
    e = jnp.take(params["embed"], tokens_BT, axis=0).astype(g_BTD.dtype)
    if hc.input_norm:
        w = params["input_norm"]
        e = llama_lib.rms_norm(e, w[0], hc.target.rms_eps).astype(g_BTD.dtype)
        g_BTD = llama_lib.rms_norm(g_BTD, w[1], hc.target.rms_eps).astype(g_BTD.dtype)
    return matmul(jnp.concatenate([e, g_BTD], axis=-1), params["fc"], hc.hidden_size).astype(g_BTD.dtype)


def fuse_features(hc: HeadConfig, params: dict, f_BTF) -> jax.Array:
    """The target features as the head's D-wide input (the EAGLE-3 kinds fuse their layers)."""
    return hc.spec.fuse(hc, params, f_BTF)


def _layer_params(hc: HeadConfig, params: dict) -> dict:
    p = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": params["layers"]}
    if hc.packed:                 # a packed layer's model checks for its head's panels (never used)
        p["head_panels"] = params["head_panels"]
    return p


def _smooth_l1(x):
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


# ------------------------------------------------------------------------------ the kinds

class EagleFamily(HeadKind):
    """Heads with one decoder layer over (token, feature) entries and their own KV cache. The
    defaults are the EAGLE head's layer (the target's dimensions, one layer)."""
    # The layer's RoPE positions relative to the slots, and whether no query but its own sees
    # slot 0 (the published EAGLE-3 layout has no entry for the first token).
    position_offset: int = 0
    hides_first: bool = False

    def layer_config(self, hc):
        return hc.target.replace(num_layers=1, scan_layers=True, fuse_projections=False, packed_projections=False)

    def run_layer_config(self, hc):
        if hc.packed:
            return hc.target.replace(num_layers=1, scan_layers=False, fuse_projections=True, packed_projections=True)
        return self.layer_config(hc)

    def fuse(self, hc, params, f_BTF):
        return f_BTF

    def init_layer_cache(self, hc, batch_size: int, capacity: int) -> KVCache:
        return Llama(hc.run_layer_config).init_cache(batch_size, capacity)

    def layer_call(self, hc, params, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        """The head's layer on (tokens, features) over its cache: (output [B, T, D], cache)."""
        x_BTD = eagle_input(hc, params, tokens_BT, g_BTD)
        h_BTD, _, kv = Llama(hc.run_layer_config).trunk(_layer_params(hc, params), None, kv, num_valid_B, tree=tree,
                                                        inputs_BTD=x_BTD)
        return h_BTD, kv

    def train_layer(self, hc, params, tokens_BT, g_BTD, cos, sin, past, visibility):
        """The layer on whole sequences without a cache (`eagle_train_forward`): (h, (k, v))."""
        lp = jax.tree.map(lambda x: x[0], params["layers"])       # stacked layout, leading dim 1
        x = eagle_input(hc, params, tokens_BT, g_BTD)
        return llama_lib._layer(hc.layer_config, lp, x, cos, sin, past, visibility)

    def first_visibility(self, T: int):
        return None

    def drafter(self, hc):
        return FeatureHeadDrafter(EagleHead(hc))

    def train_outputs(self, hc, params, tokens_BT, f_BTF, steps):
        outs = eagle_train_forward(hc, params, tokens_BT, f_BTF, steps, with_logits=False)
        return [(h, j) for j, (h, _) in enumerate(outs)]

    def eval_outputs(self, hc, params, tokens_BT, f_BTF, steps):
        return [h for h, _ in eagle_train_forward(hc, params, tokens_BT, f_BTF, steps, with_logits=False)]


class Eagle(EagleFamily):
    name = "eagle"
    default_feature_weight = 1.0
    has_input_norm = True
    state_keys = ("head.input_norm", "head.feature_layers")

    def own_names(self, hc):
        return ("fc", "layers") + (("input_norm",) if hc.input_norm else ())

    def init_weights(self, hc, key):
        D, dtype = hc.hidden_size, hc.target.jnp_dtype
        k1, k2, _ = jax.random.split(key, 3)
        own = {"fc": (INIT_STD * jax.random.normal(k1, (2 * D, D), jnp.float32)).astype(dtype),
               "layers": Llama(hc.layer_config).init_params(k2)["layers"]}
        if hc.input_norm:       # [embedding's, feature's] RMS-norm weights
            own["input_norm"] = jnp.ones((2, D), dtype)
        return own

    def pack(self, hc, p):
        dtype = hc.target.jnp_dtype
        p = {**p, "fc": kernels.pack(p["fc"].astype(dtype))}
        if "fuse" in p:
            p["fuse"] = kernels.pack(p["fuse"].astype(dtype))
        p["layers"] = llama_lib.prepare_layers({k: v.astype(dtype) for k, v in p["layers"].items()},
                                               hc.run_layer_config)
        return p

    def extra_loss(self, hc, outs, f_BTF, mask_BT):
        """Feature regression: smooth L1 between step 1's output and the target's feature per
        position [B, T]; with ``input_norm`` between the two RMS-normalized (the head's output
        reaches everything through an RMS norm, so only its direction counts)."""
        out, f = outs[0][0].astype(jnp.float32), f_BTF.astype(jnp.float32)
        if hc.input_norm:
            ones = jnp.ones((f.shape[-1],), jnp.float32)
            out, f = (llama_lib.rms_norm(x, ones, hc.target.rms_eps) for x in (out, f))
        return jnp.mean(_smooth_l1(out - f), axis=-1)


class Eagle3(Eagle):
    name = "eagle3"
    default_ttt_steps = 3
    default_feature_weight = 0.0

    def default_feature_layers(self, num_layers):
        """A low, a middle and a high layer (layers 2, L/2 and L-3 in 1-based terms, as in Li
        et al. 2025)."""
        return tuple(sorted({min(1, num_layers - 1), num_layers // 2 - 1 if num_layers > 1 else 0,
                             max(num_layers - 4, 0)}))

    def check(self, hc):
        pass                                        # any number of feature layers

    def own_names(self, hc):
        return ("fc", "layers", "fuse") + (("input_norm",) if hc.input_norm else ())

    def init_weights(self, hc, key):
        own = super().init_weights(hc, key)
        k3 = jax.random.split(key, 3)[2]
        own["fuse"] = (INIT_STD * jax.random.normal(k3, (hc.feature_size, hc.hidden_size), jnp.float32)
                       ).astype(hc.target.jnp_dtype)
        return own

    def fuse(self, hc, params, f_BTF):
        return matmul(f_BTF, params["fuse"], hc.hidden_size).astype(f_BTF.dtype)

    def extra_loss(self, hc, outs, f_BTF, mask_BT):
        return None


EAGLE = register_head_kind(Eagle())
EAGLE3 = register_head_kind(Eagle3())


# ------------------------------------------------------------------------------ the head and its drafter

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



# ------------------------------------------------------------------------------ training forward

def eagle_train_forward(hc: HeadConfig, params: dict, tokens_BT, feats_BTF, steps: int = 1,
                        with_logits: bool = True, dense_visibility: bool = False):
    """Teacher-forced head outputs on whole sequences, cache-free: a list over drafting steps
    j = 1..steps of (h_BTD, logits_BTV), row o of step j being the draft that starts at
    position o (its first step reads the target's ``f_{o-1}``).

    Step 1 at position s: input (``x_s``, target feature ``f_{s-1}``; zeros at s = 0), causal
    attention over step-1 entries: ``h_s`` predicts ``f_s`` and its logits score ``x_{s+1}``.
    Step j > 1 (training-time test, EAGLE-3): the draft from origin o continues at position
    ``o + j - 1`` with input (``x_{o+j-1}``, the head's own step-(j-1) output of origin o),
    attending to the step-1 entries at positions <= o (the committed prefix a real draft sees)
    and to its own origin's entries of steps 2..j, exactly the visibility of drafting step j
    at inference. Its logits score ``x_{o+j}``; positions past the sequence read token 0 and
    their outputs are the caller's to mask. ``with_logits=False``: logits are None (a trainer
    scores the outputs itself, e.g. over a reduced vocabulary).

    The kind's layer (`EagleFamily.train_layer`) runs under that visibility
    (`specjax.models.attention.TrainingTimeTest`; ``dense_visibility``: as the equivalent dense
    masks through the layer's attention op instead, the slow reference the tests compare with);
    a published EAGLE-3 head at RoPE positions one less, with the entry at position 0 seen by
    itself only."""
    B, T = tokens_BT.shape
    lc, spec = hc.layer_config, hc.spec
    dtype = lc.jnp_dtype
    f_BTD = fuse_features(hc, params, feats_BTF.astype(dtype))
    g_BTD = jnp.concatenate([jnp.zeros((B, 1, f_BTD.shape[-1]), dtype), f_BTD[:, :-1]], axis=1)
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    out = []
    past_k, past_v = [], []               # per step: k [B, K, T, H], v [B, K, H, T]
    h_BTD = None
    for j in range(1, steps + 1):
        tok_BT = jnp.concatenate([tokens_BT[:, j - 1:], jnp.zeros((B, j - 1), tokens_BT.dtype)], axis=1)
        cos, sin = llama_lib.rope_cos_sin(lc, pos_BT + (j - 1) + spec.position_offset)
        run = lambda past, vis: spec.train_layer(hc, params, tok_BT, g_BTD, cos, sin, past, vis)  # noqa: E731
        if j == 1:
            h_new, (k, v) = run(None, spec.first_visibility(T))
        else:
            # step-1 entries causal (the one at position 0 seen by nobody else when hides_first),
            # the origin's own entries of steps 2..j on the diagonal
            tt = attention_lib.TrainingTimeTest(hides_first=spec.hides_first)
            past = (jnp.concatenate(past_k, axis=2), jnp.concatenate(past_v, axis=3), None)
            h_new, (k, v) = run(past, tt.dense(B, T, j - 1) if dense_visibility else tt)
        past_k.append(jnp.transpose(k, (0, 2, 1, 3)))        # [B, T, K, H] -> [B, K, T, H]
        past_v.append(jnp.transpose(v, (0, 2, 3, 1)))        # -> [B, K, H, T]
        h_BTD = h_new
        out.append((h_BTD, head_logits(hc, params, h_BTD) if with_logits else None))
        g_BTD = h_BTD
    return out
