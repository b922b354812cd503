"""Parameters and scores of heads that draft through the target's own embedding, final norm and
output layer (every kind but the published EAGLE-3 layout, which has its own norm and LM head),
and the matrix product the kinds' own weights run through (plain or `specjax.kernels` panels).
``hc`` is a `HeadConfig` (`_config`, which imports this module).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.models import Llama
from specjax.models import llama as llama_lib


def check_head_ids(hc, head_ids) -> jax.Array | None:
    """The reduced head's tokens as sorted int32 ids (required iff ``hc.head_size``)."""
    if (hc.head_size is None) != (head_ids is None):
        raise ValueError("head_ids must be given exactly when the head config has a head_size")
    if head_ids is None:
        return None
    ids = np.unique(np.asarray(head_ids, np.int64))
    if ids.size != hc.head_size or ids[0] < 0 or ids[-1] >= hc.target.vocab_size:
        raise ValueError(f"head_ids must be {hc.head_size} distinct ids in [0, {hc.target.vocab_size})")
    return jnp.asarray(ids, jnp.int32)


def target_head_params(hc, p: dict, target_params: dict, pack) -> dict:
    """A head that drafts through the target's embedding, final norm and output layer: those
    added to its own ``p`` (a reduced head's rows gathered), packed by ``pack`` if ``hc.packed``."""
    p = dict(p)
    p["embed"] = target_params["embed"]
    p["final_norm"] = target_params["final_norm"]
    if hc.head_size is not None:
        ids = p["head_ids"]
        p["head"] = (jnp.take(target_params["embed"], ids, axis=0) if hc.target.tie_embeddings
                     else jnp.take(target_params["lm_head"], ids, axis=1).T)
    elif not hc.target.tie_embeddings:
        p["lm_head"] = target_params["lm_head"]
    if "head_panels" in target_params and (hc.head_size is None or hc.packed):
        p["head_panels"] = target_params["head_panels"]     # a packed target's head (its layer reads it too)
    if hc.packed:
        if "head_panels" not in p:
            raise ValueError("a packed head needs the packed target's params (with 'head_panels'): "
                             "target.prepare_params(params)")
        if hc.head_size is not None:
            p["head"] = kernels.pack_rows(p["head"])                          # [S, D] rows -> panels of [D, S]
        p = pack(hc, p)
    return p


def matmul(x, w, width: int):
    """x [..., in] @ w in float32: w a matrix [in, width] (in x's dtype) or its kernel panels."""
    return kernels.dense(x, w if kernels.is_packed(w) else w.astype(x.dtype), width)


def target_head_scores(hc, params: dict, h_BTD) -> tuple[jax.Array, jax.Array | None]:
    """Head outputs through the target's final norm and the head's rows of the target's output
    layer, soft-capped as the target's logits."""
    x = llama_lib.norm(hc.target, h_BTD, params["final_norm"])
    if hc.head_size is not None:
        if kernels.is_packed(params["head"]):                               # panels of [D, U]
            s = kernels.matmul(x, params["head"], hc.head_size)
        else:                                                               # rows [U, D]
            s = jnp.einsum("btd,sd->bts", x, params["head"].astype(x.dtype), preferred_element_type=jnp.float32)
        return llama_lib.softcap(s, hc.target.final_softcap), params["head_ids"]
    return Llama(hc.target).logits_from_hidden(params, x), None

