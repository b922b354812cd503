"""The EAGLE head (``eagle``; EAGLE-1/2, Li et al. 2024): ``fc([embed(x_s) ; g_{s-1}])``
(2D -> D), one decoder layer of the target's dimensions with its own KV cache, output ``h_s``
= the head's prediction of ``f_s`` (indexing in `_family`), logits of ``x_{s+1}`` from the
target's final norm and head. ``g_{s-1}`` is the target's ``f_{s-1}`` where known, else the
head's own ``h_{s-1}``. Trained with a feature regression (smooth L1 to ``f_s``,
`Eagle.extra_loss`) plus a divergence to the target's distribution.

``input_norm``: the embedding and the feature are RMS-normalized, each with its own learned
weight, before ``fc`` (EAGLE-3's reference layer normalizes its two inputs separately before
concatenating them). The target's features are raw residual streams, far larger than the
embedding, which otherwise drown the token's half of the input.

The head drafts through the target's embedding, final norm and LM head; a reduced-vocabulary
head (``head_size``: the target's head rows of the ``head_ids`` tokens, -inf logit elsewhere)
keeps sampling exact: q is zero off the subset, and the verifier only needs q to be what was
sampled. Its layer (`eagle_input`, then a Llama layer) is also the ``eagle3`` kind's (`_eagle3`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.heads._config import INIT_STD, HeadConfig, register_head_kind
from specjax.drafters.heads._family import EagleFamily
from specjax.drafters.heads._target_head import matmul
from specjax.models import Llama
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


def _layer_params(hc: HeadConfig, params: dict) -> dict:
    p = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": params["layers"]}
    if hc.run_layer_config.linear.head_copy:   # the layer's model checks for its stored head (never used)
        p["head_linear"] = params["head_linear"]
    return p


def _smooth_l1(x):
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


class Eagle(EagleFamily):
    """The EAGLE kind: `eagle_input` into one Llama layer of the target's dimensions (stacked
    layout when trained, the target's linear op and layout beside a target with one)."""
    name = "eagle"
    default_feature_weight = 1.0
    has_input_norm = True
    state_keys = ("head.input_norm", "head.feature_layers")

    # -- the layer
    def layer_config(self, hc):
        return hc.target.replace(num_layers=1, scan_layers=True, fuse_projections=False, linear_op="xla")

    def run_layer_config(self, hc):
        if hc.stored:
            return hc.target.replace(num_layers=1, scan_layers=False, fuse_projections=True, linear_op=hc.linear_op)
        return self.layer_config(hc)

    def init_layer_cache(self, hc, batch_size: int, capacity: int) -> KVCache:
        return Llama(hc.run_layer_config).init_cache(batch_size, capacity)

    def layer_call(self, hc, params, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        x_BTD = eagle_input(hc, params, tokens_BT, g_BTD)
        h_BTD, _, kv = Llama(hc.run_layer_config).trunk(_layer_params(hc, params), None, kv, num_valid_B, tree=tree,
                                                        inputs_BTD=x_BTD)
        return h_BTD, kv

    def train_layer(self, hc, params, tokens_BT, g_BTD, cos, sin, past, visibility):
        lp = jax.tree.map(lambda x: x[0], params["layers"])       # stacked layout, leading dim 1
        x = eagle_input(hc, params, tokens_BT, g_BTD)
        return llama_lib._layer(hc.layer_config, lp, x, cos, sin, past, visibility)

    # -- parameters
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

    def store(self, hc, p):
        dtype = hc.target.jnp_dtype
        p = {**p, "fc": hc.linear.store(p["fc"].astype(dtype))}
        p["layers"] = llama_lib.prepare_layers({k: v.astype(dtype) for k, v in p["layers"].items()},
                                               hc.run_layer_config)
        return p

    # -- training
    def extra_loss(self, hc, outs, f_BTF, mask_BT):
        """Feature regression: smooth L1 between step 1's output and the target's feature per
        position [B, T]; with ``input_norm`` between the two RMS-normalized (the head's output
        reaches everything through an RMS norm, so only its direction counts)."""
        out, f = outs[0][0].astype(jnp.float32), f_BTF.astype(jnp.float32)
        if hc.input_norm:
            ones = jnp.ones((f.shape[-1],), jnp.float32)
            out, f = (llama_lib.rms_norm(x, ones, hc.target.rms_eps) for x in (out, f))
        return jnp.mean(_smooth_l1(out - f), axis=-1)


EAGLE = register_head_kind(Eagle())
