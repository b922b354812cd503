"""Parameters and scores of heads that draft through the target's own embedding, final norm and
output layer (every kind but the published EAGLE-3 layout, which has its own norm and LM head),
and the matrix product the kinds' own weights run through (plain, or a `specjax.kernels`
linear op's stored form).
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


def target_head_params(hc, p: dict, target_params: dict, store) -> dict:
    """A head that drafts through the target's embedding, final norm and output layer: those
    added to its own ``p`` (a reduced head's rows gathered), stored by ``store`` in ``hc.linear``'s
    form if ``hc.stored``."""
    p = dict(p)
    p["embed"] = target_params["embed"]
    p["final_norm"] = target_params["final_norm"]
    if hc.head_size is not None:
        ids = p["head_ids"]
        p["head"] = (jnp.take(target_params["embed"], ids, axis=0) if hc.target.tie_embeddings
                     else jnp.take(target_params["lm_head"], ids, axis=1).T)
    elif not hc.target.tie_embeddings:
        p["lm_head"] = target_params["lm_head"]
    if "head_linear" in target_params and (hc.head_size is None or hc.stored):
        p["head_linear"] = target_params["head_linear"]     # the target's stored head (its layer reads it too)
    if hc.stored:
        if hc.linear.head_copy and "head_linear" not in p:
            raise ValueError(f"a head with linear_op={hc.linear_op!r} needs the target's params in that op's "
                             f"layout (with 'head_linear'): target.prepare_params(params)")
        if hc.head_size is not None:
            p["head"] = hc.linear.store_rows(p["head"])                       # [S, D] rows -> the form of [D, S]
        p = store(hc, p)
    return p


def matmul(x, w, width: int):
    """x [..., in] @ w in float32: w a matrix [in, width] (in x's dtype) or a linear op's stored form of it."""
    return kernels.dense(x, w if kernels.stored_op(w) is not None else w.astype(x.dtype), width)


def target_head_scores(hc, params: dict, h_BTD) -> tuple[jax.Array, jax.Array | None]:
    """Head outputs through the target's final norm and the head's rows of the target's output
    layer, soft-capped as the target's logits."""
    x = llama_lib.norm(hc.target, h_BTD, params["final_norm"])
    if hc.head_size is not None:
        op = kernels.stored_op(params["head"])
        if op is not None:                                                  # the stored form of [D, U]
            s = op.apply(x, params["head"], hc.head_size)
        else:                                                               # rows [U, D]
            s = jnp.einsum("btd,sd->bts", x, params["head"].astype(x.dtype), preferred_element_type=jnp.float32)
        return llama_lib.softcap(s, hc.target.final_softcap), params["head_ids"]
    return Llama(hc.target).logits_from_hidden(params, x), None

