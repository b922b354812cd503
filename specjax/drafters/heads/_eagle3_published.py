"""The published EAGLE-3 head (``eagle3_published``; Li et al. 2025) as a head kind.

``fc`` (3D -> D) fuses three target features; the layer's attention reads the normed embedding
and the normed fused feature side by side (two norms, a 2D-wide q/k/v), its residual adds the
fused feature; the head scores with its *own* final norm and LM head over a draft vocabulary
(``head_ids``: draft row i is target token ``head_ids[i]``, the reference's ``i + d2t[i]``).
The layer itself is `_eagle3_layer`; the files other systems read and write are
`_eagle3_files`. The embedding stays the target's unless the file has its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.heads import _eagle3_layer
from specjax.drafters.heads._config import INIT_STD, register_head_kind
from specjax.drafters.heads._family import EagleFamily
from specjax.drafters.heads._target_head import matmul
from specjax.models import llama as llama_lib

EAGLE3_PUBLISHED = "eagle3_published"


class Eagle3Published(EagleFamily):
    name = EAGLE3_PUBLISHED
    default_ttt_steps = 3
    can_store = False
    configurable_layer = True
    position_offset = -1
    hides_first = True

    def default_feature_layers(self, num_layers):
        """The reference's triple as it is, the outputs of layers (1, L/2 - 1, L - 4) (0-based):
        the reference captures the inputs of layers 2, L // 2 and L - 3 (SafeAILab/EAGLE,
        eagle/model/modeling_llama_kv.py), as SGLang and vLLM do by default; on a target too
        shallow for three distinct layers there (L < 7) the config must name them."""
        return (1, num_layers // 2 - 1, num_layers - 4)

    def check(self, hc):
        t = hc.target
        fl = tuple(int(i) for i in hc.feature_layers)
        if len(fl) != 3 or list(fl) != sorted(set(fl)) or not 0 <= fl[0] <= fl[-1] < t.num_layers:
            raise ValueError(
                f"a {EAGLE3_PUBLISHED} head reads three distinct target layers in ascending order (the order "
                f"every engine concatenates them in), each in [0, {t.num_layers}), got {fl}; the default "
                f"(1, L//2 - 1, L - 4) needs a target of at least 7 layers, name them otherwise")
        if hc.head_size is None:              # the draft vocabulary: the whole target vocabulary
            object.__setattr__(hc, "head_size", t.vocab_size)
        # Medusa's setting, meaningless here: one value, so that configs read from any file compare equal.
        object.__setattr__(hc, "num_heads", 4)
        if self.layer_config(hc).hidden_size != t.hidden_size:
            raise ValueError(f"the head layer's width {self.layer_config(hc).hidden_size} differs from the "
                             f"target's {t.hidden_size}: it reads the target's embedding")

    def layer_config(self, hc):
        """`hc.layer` (or the target's dimensions), with the target's vocabulary, dtype and
        attention op, one layer, plain layout."""
        t = hc.target
        base = hc.layer if hc.layer is not None else _eagle3_layer.default_layer(t)
        return base.replace(vocab_size=t.vocab_size, dtype=t.dtype, attention_op=t.attention_op, num_layers=1,
                            scan_layers=False, fuse_projections=False, linear_op="xla",
                            cpu_attention=False)

    def run_layer_config(self, hc):
        return self.layer_config(hc)

    def own_names(self, hc):
        return ("fc", "layer", "norm", "lm_head", "head_ids") + (("embed",) if hc.own_embedding else ())

    def init_own(self, hc, key, head_ids=None):
        """``head_ids``: the draft vocabulary in row order (default ``arange(head_size)``)."""
        lc, S, V = self.layer_config(hc), hc.head_size, hc.target.vocab_size
        k1, k2, k3, k4 = jax.random.split(key, 4)
        normal = lambda k, shape: (INIT_STD * jax.random.normal(k, shape, jnp.float32)).astype(lc.jnp_dtype)  # noqa: E731
        ids = np.arange(S, dtype=np.int64) if head_ids is None else np.asarray(head_ids, np.int64)
        if ids.shape != (S,) or np.unique(ids).size != S or ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"head_ids must be {S} distinct ids in [0, {V}) (the draft vocabulary, in row order)")
        own = {"fc": normal(k1, (hc.feature_size, lc.hidden_size)), "layer": _eagle3_layer.init_layer(lc, k2),
               "norm": jnp.ones((lc.hidden_size,), lc.jnp_dtype), "lm_head": normal(k3, (S, lc.hidden_size)),
               "head_ids": jnp.asarray(ids, jnp.int32)}
        if hc.own_embedding:
            own["embed"] = normal(k4, (V, lc.hidden_size))
        return own

    def run_params(self, hc, p, target_params):
        """Its own norm and LM head; the target's embedding unless its own."""
        p = dict(p)
        if not hc.own_embedding:
            p["embed"] = target_params["embed"]
        return p

    def scores(self, hc, params, h_BTD):
        x = llama_lib.rms_norm(h_BTD, params["norm"], self.layer_config(hc).rms_eps)
        s = jnp.einsum("btd,sd->bts", x, params["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)
        return s, params["head_ids"]

    def train_scores(self, hc, params, head_UD, h_BTD):
        # Its own norm and rows (head_UD holds the same tokens in the same order: unused).
        return self.scores(hc, params, h_BTD)[0]

    def fuse(self, hc, params, f_BTF):
        return matmul(f_BTF, params["fc"], self.layer_config(hc).hidden_size).astype(f_BTF.dtype)

    def init_layer_cache(self, hc, batch_size, capacity):
        return _eagle3_layer.init_cache(self.layer_config(hc), batch_size, capacity)

    def layer_call(self, hc, params, tokens_BT, g_BTD, kv, num_valid_B=None, tree=None):
        e_BTD = jnp.take(params["embed"], tokens_BT, axis=0)
        return _eagle3_layer.cached_layer(self.layer_config(hc), params["layer"], e_BTD, g_BTD, kv, num_valid_B, tree)

    def train_layer(self, hc, params, tokens_BT, g_BTD, cos, sin, past, visibility):
        e_BTD = jnp.take(params["embed"], tokens_BT, axis=0)
        return _eagle3_layer.layer(self.layer_config(hc), params["layer"], e_BTD, g_BTD, cos, sin, past, visibility)

    def first_visibility(self, T):
        return _eagle3_layer.first_step_visibility(T)


EAGLE3_PUBLISHED_KIND = register_head_kind(Eagle3Published())
