"""The EAGLE family of head kinds: one decoder layer over (token, feature) entries with its own
KV cache (`EagleFamily`), and the family's training forward with training-time test
(`eagle_train_forward`, dispatched to the kind's `EagleFamily.train_forward`).

Indexing. ``f_t`` is the target's feature at position t (the residual stream after the chosen
layers, before the final norm); the target's LM head on ``norm(f_t)`` gives the distribution
of token ``x_{t+1}``. At a round with L committed tokens the engine knows ``f_0 .. f_{L-2}``
(the last committed token is the first input of the next verification pass). The entry at
slot s is the pair (token ``x_s``, feature of position s-1) and its output ``h_s`` predicts
``f_s``: its logits score ``x_{s+1}``.

A kind supplies its layer through hooks: `layer_config` and `run_layer_config`, `fuse` (the
target features as the layer's D-wide input), `init_layer_cache` and `layer_call` (the cached
layer `EagleHead` runs), `train_layer`, `first_visibility`, `position_offset` and
`hides_first` (the cache-free layer and its masks in training). The kinds: ``eagle``
(`_eagle`), ``eagle3`` (`_eagle3`), ``eagle3_published`` (`_eagle3_published`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.heads._config import HeadConfig, HeadKind, head_logits
from specjax.drafters.heads._runtime import EagleHead, FeatureHeadDrafter
from specjax.models import ModelConfig
from specjax.models import attention as attention_lib
from specjax.models import llama as llama_lib
from specjax.models.kv_cache import KVCache


class EagleFamily(HeadKind):
    """Heads with one decoder layer over (token, feature) entries and their own KV cache, run by
    `EagleHead` in `FeatureHeadDrafter` and trained through `train_forward`. A kind overrides
    the layer hooks (the EAGLE layer is `_eagle.Eagle`'s)."""
    # The layer's RoPE positions relative to the slots, and whether no query but its own sees
    # slot 0 (the published EAGLE-3 layout has no entry for the first token).
    position_offset: int = 0
    hides_first: bool = False
    origin_outputs = True

    # -- the kind's layer
    def layer_config(self, hc: HeadConfig) -> ModelConfig:
        """The layer in its stored and trained layout (every kind of the family has one)."""
        raise NotImplementedError

    def fuse(self, hc: HeadConfig, params: dict, f_BTF) -> jax.Array:
        """The target features [B, T, F] as the layer's input [B, T, D] (default: as they are)."""
        return f_BTF

    def init_layer_cache(self, hc: HeadConfig, batch_size: int, capacity: int) -> KVCache:
        """The layer's empty KV cache."""
        raise NotImplementedError

    def layer_call(self, hc: HeadConfig, params: dict, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        """The head's layer on (tokens, features) over its cache: (output [B, T, D], cache)."""
        raise NotImplementedError

    def train_layer(self, hc: HeadConfig, params: dict, tokens_BT, g_BTD, cos, sin, past, visibility):
        """The layer on whole sequences without a cache (`train_forward`): (h, (k, v))."""
        raise NotImplementedError

    def train_step(self, hc: HeadConfig, params: dict, j: int, tokens_BT, g_BTD, cos, sin, past, visibility):
        """Drafting step ``j`` (1-based) of `train_forward`: the layer on step j's entries
        (default: `train_layer` on (token, previous output) for every step)."""
        return self.train_layer(hc, params, tokens_BT, g_BTD, cos, sin, past, visibility)

    def first_visibility(self, T: int):
        """The first training step's visibility (None: causal)."""
        return None

    # -- what the family shares
    def drafter(self, hc):
        return FeatureHeadDrafter(EagleHead(hc))

    def train_outputs(self, hc, params, tokens_BT, f_BTF, steps, origins_BQ=None):
        outs = self.train_forward(hc, params, tokens_BT, f_BTF, steps, with_logits=False, origins_BQ=origins_BQ)
        return [(h, j) for j, (h, _) in enumerate(outs)]

    def train_shifts(self, hc, steps):
        return tuple(range(steps))

    def eval_outputs(self, hc, params, tokens_BT, f_BTF, steps):
        return [h for h, _ in self.train_forward(hc, params, tokens_BT, f_BTF, steps, with_logits=False)]

    def train_forward(self, hc: HeadConfig, params: dict, tokens_BT, feats_BTF, steps: int = 1,
                      with_logits: bool = True, dense_visibility: bool = False, origins_BQ=None) -> list:
        """The kind's teacher-forced outputs over ``steps`` drafting steps (`eagle_train_forward`)."""
        B, T = tokens_BT.shape
        lc = hc.layer_config
        dtype = lc.jnp_dtype
        f_BTD = self.fuse(hc, params, feats_BTF.astype(dtype))
        g_BTD = jnp.concatenate([jnp.zeros((B, 1, f_BTD.shape[-1]), dtype), f_BTD[:, :-1]], axis=1)
        o_BQ = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T)) if origins_BQ is None \
            else origins_BQ.astype(jnp.int32)
        take = lambda x_BT: jnp.take_along_axis(x_BT, jnp.clip(o_BQ, 0, T - 1).reshape(  # noqa: E731
            o_BQ.shape + (1,) * (x_BT.ndim - 2)), axis=1)
        out = []
        past_k, past_v = [], []               # per step: k [B, K, T or Q, H], v [B, K, H, T or Q]
        h_BTD = None
        for j in range(1, steps + 1):
            if j == 1:                        # every position: the step-1 entries are every later step's keys
                cos, sin = llama_lib.rope_cos_sin(lc, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
                                                  + self.position_offset)
                h_new, (k, v) = self.train_step(hc, params, 1, tokens_BT, g_BTD, cos, sin, None,
                                                self.first_visibility(T))
                if origins_BQ is not None:
                    h_new = take(h_new)
            else:
                # the origins' step j: token x_{o+j-1} (0 past the end) at position o + j - 1, seeing
                # the step-1 entries <= o (the one at position 0 by nobody else when hides_first) and
                # its own origin's entries of steps 2..j on the diagonal
                at_BQ = o_BQ + (j - 1)
                tok_BQ = jnp.where(at_BQ < T, jnp.take_along_axis(tokens_BT, jnp.clip(at_BQ, 0, T - 1), axis=1), 0)
                cos, sin = llama_lib.rope_cos_sin(lc, at_BQ + self.position_offset)
                tt = attention_lib.TrainingTimeTest(hides_first=self.hides_first, origins_BQ=origins_BQ,
                                                    width=None if origins_BQ is None else T)
                past = (jnp.concatenate(past_k, axis=2), jnp.concatenate(past_v, axis=3), None)
                vis = tt.dense(B, T, j - 1, o_BQ.shape[1]) if dense_visibility else tt
                h_new, (k, v) = self.train_step(hc, params, j, tok_BQ.astype(tokens_BT.dtype), g_BTD, cos, sin,
                                                past, vis)
            past_k.append(jnp.transpose(k, (0, 2, 1, 3)))        # [B, T, K, H] -> [B, K, T, H]
            past_v.append(jnp.transpose(v, (0, 2, 3, 1)))        # -> [B, K, H, T]
            h_BTD = h_new
            out.append((h_BTD, head_logits(hc, params, h_BTD) if with_logits else None))
            g_BTD = h_BTD
        return out


def eagle_train_forward(hc: HeadConfig, params: dict, tokens_BT, feats_BTF, steps: int = 1,
                        with_logits: bool = True, dense_visibility: bool = False, origins_BQ=None):
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
    itself only.

    ``origins_BQ`` (int32 [B, Q]): the outputs of the drafts from these origins only ([B, Q, D]
    per step; a trainer passes the origins its loss reads). Step 1 still runs at every position
    (its entries are what every later step attends to); steps 2..steps run at the Q origins, so
    their cost scales with Q, not T. Row q of every step is the full computation's row
    ``origins_BQ[b, q]``."""
    return hc.spec.train_forward(hc, params, tokens_BT, feats_BTF, steps, with_logits, dense_visibility,
                                 origins_BQ=origins_BQ)
