"""The EAGLE-3 style head (``eagle3``; Li et al. 2025): the EAGLE layer (`_eagle`) over the
target's features at a low, a middle and a high layer, fused by ``fuse`` (3D -> D) before
``fc``; beyond the known prefix the head's own output stands in for the fused feature. No
feature regression: training-time test unrolls ``default_ttt_steps`` drafting steps so the
head learns from its own predictions (`_family.EagleFamily.train_forward`, each step through
the EAGLE layer at the visibility drafting step j has at inference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.heads._config import INIT_STD, register_head_kind
from specjax.drafters.heads._eagle import Eagle
from specjax.drafters.heads._target_head import matmul


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

    def store(self, hc, p):
        p = super().store(hc, p)
        return {**p, "fuse": hc.linear.store(p["fuse"].astype(hc.target.jnp_dtype))}

    def fuse(self, hc, params, f_BTF):
        return matmul(f_BTF, params["fuse"], hc.hidden_size).astype(f_BTF.dtype)

    def extra_loss(self, hc, outs, f_BTF, mask_BT):
        return None


EAGLE3 = register_head_kind(Eagle3())
