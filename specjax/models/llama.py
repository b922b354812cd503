"""Llama-family decoder (Llama / SmolLM2 / Qwen2): pure functions over a plain parameter dict.

Canonical parameters (what the loaders return, `param_specs` describes and export / storage
use) are a nested dict with every per-layer tensor stacked along a leading layer axis::

    embed        [V, D]                 token embedding (also the head when tied)
    final_norm   [D]
    lm_head      [D, V]                 only when not tied
    layers/attn_norm [L, D]   wq [L, D, H*hd]   wk, wv [L, D, K*hd]   wo [L, H*hd, D]
           bq [L, H*hd]  bk, bv [L, K*hd]        (only with attention_bias, Qwen2 style)
           mlp_norm [L, D]    w_gate, w_up [L, D, F]   w_down [L, F, D]

Projections are stored input-major ([in, out]) so ``x @ w`` needs no transpose; heads are
laid out head-major inside the H*hd axis (the Hugging Face order). RoPE uses the HF
"rotate_half" convention (dims i and i + hd/2 form a pair).

Layout. The static config fixes how `Llama.apply` runs the layers and so which parameter
layout it reads:

* ``scan_layers=True``: a `lax.scan` over the stacked layers and a stacked KV cache (the
  canonical layout; quick to compile);
* ``scan_layers=False``: an unrolled loop over ``params['layers']``, a tuple of per-layer
  dicts, and a per-layer cache (the fast path on XLA CPU, which loses its fast matmul path when
  it slices a layer's weights out of the stacked arrays inside the step; see
  experiments/bench_speed/PROFILE.md);
* ``fuse_projections=True``: every layer holds ``wqkv = [wq | wk | wv]`` (and ``bqkv``) and
  ``w_gate_up = [w_gate | w_up]``, concatenated along the output axis: two matmuls per layer
  instead of five read the same bytes in longer streams.
* ``linear_op``: the `specjax.kernels.LinearOp` that stores every projection [in, out] and
  multiplies by it (``config.linear``; the model names no layout). "xla" (the default, the
  canonical form): plain matrices and XLA's dot. "panels" (with ``scan_layers=False``): the CPU
  kernel's layout, whose matmul streams each weight once for up to 8 rows, so a k-token
  verification block reads the weights once, as a one-token step does; off the CPU backend the
  same stored form goes through an einsum. An op with ``head_copy`` adds ``head_linear`` to the
  params, the LM head in the op's stored form (the embedding or ``lm_head`` stays for lookups,
  drafters and export). A new op is one `specjax.kernels.register_linear_op` call.

The layout is decided once, outside the jitted step: `Llama.prepare_params` turns params of any
layout into the config's (`specjax.models.load`, `Llama.init_params`, `truncate_layers` and the
draft loader all return that layout). `apply` reads the layout from the config and raises,
naming `prepare_params`, when the params do not match it; `canonical_params` converts back.

No Flax NNX module. The hot path is a pure function of this parameter dict, and every consumer
(the jitted engine, optax training in `specjax.distill`, draft artifacts, the exporter,
`specjax.sharding`) reads and writes the dict as it is. An NNX module would be split once into
exactly this dict and never called; it would only add a second description of the parameters
beside `param_specs` (which already holds shapes, logical axes for sharding and the init recipe)
and a conversion, or one module per layout. So there is none.

`Llama(config)` is the frozen, hashable model object of the `specjax.models.DecoderModel`
protocol: ``apply(params, tokens_BT, cache, num_valid_B=None, tree=None) -> (logits_BTV, cache)``.

Attention. Without ``tree`` a call is causal over the committed slots and the block (token t of
row b sits at slot and position ``lengths_B[b] + t``). With a `specjax.models.TreeBlock` (tree
verification, tree drafting) the block is a flattened token tree: positions come from the tree,
the causal mask inside the block is replaced by the tree's visibility (a node sees its
ancestors), a window of earlier tentative entries may be visible too, and the entries are
written past the committed length without advancing it (`KVCache.commit_path` commits an
accepted path). The two cases are separate traces: a call without ``tree`` compiles to exactly
the program it compiled to before trees existed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.models.attention import (ORDERED_TAIL_MAX, AttentionSpec, attention, tree_attention_mask, window_mask,
                                      written_visibility)
from specjax.models.attention import causal_mask as causal_mask_for
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, TreeBlock, write_kv  # noqa: F401  (TreeBlock: the protocol's type)
from specjax.models.packing import PackedRows

__all__ = ["Llama", "attention", "tree_attention_mask"]    # attention lives in specjax.models.attention

INIT_STD = 0.02
# fused projection -> its parts, concatenated in this order along the output axis
_FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}
# the projections (2-D per layer, [in, out]); the config's linear op stores these
_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up")


# ---------------------------------------------------------------------------------------
# Parameter specification: shapes, logical axes and init, one source of truth.
# ---------------------------------------------------------------------------------------
def param_specs(config: ModelConfig) -> dict:
    """Canonical param path -> (shape, logical axes, init kind) for every parameter."""
    c = config
    D, F, L, V = c.hidden_size, c.ffn_size, c.num_layers, c.vocab_size
    Q, KV = c.q_size, c.kv_size
    layers = {
        "attn_norm": ((L, D), ("layers", "embed"), "ones"),
        "wq": ((L, D, Q), ("layers", "embed", "heads"), "normal"),
        "wk": ((L, D, KV), ("layers", "embed", "kv"), "normal"),
        "wv": ((L, D, KV), ("layers", "embed", "kv"), "normal"),
        "wo": ((L, Q, D), ("layers", "heads", "embed"), "normal"),
        "mlp_norm": ((L, D), ("layers", "embed"), "ones"),
        "w_gate": ((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "w_up": ((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "w_down": ((L, F, D), ("layers", "mlp", "embed"), "normal"),
    }
    if c.num_experts:        # the MLP becomes a router and E experts
        E = c.num_experts
        for name in ("w_gate", "w_up", "w_down"):
            del layers[name]
        layers["router"] = ((L, D, E), ("layers", "embed", None), "normal")
        layers["we_gate"] = ((L, E, D, F), ("layers", "expert", "embed", "mlp"), "normal")
        layers["we_up"] = ((L, E, D, F), ("layers", "expert", "embed", "mlp"), "normal")
        layers["we_down"] = ((L, E, F, D), ("layers", "expert", "mlp", "embed"), "normal")
    norm = "zeros" if c.norm_offset else "ones"       # (offset + w): zeros are a unit scale
    for name in ("attn_norm", "mlp_norm"):
        layers[name] = layers[name][:2] + (norm,)
    if c.qk_norm:
        layers["q_norm"] = ((L, c.head_dim), ("layers", None), norm)
        layers["k_norm"] = ((L, c.head_dim), ("layers", None), norm)
    if c.sandwich_norms:
        layers["post_attn_norm"] = ((L, D), ("layers", "embed"), norm)
        layers["post_mlp_norm"] = ((L, D), ("layers", "embed"), norm)
    if c.attention_bias:
        layers["bq"] = ((L, Q), ("layers", "heads"), "normal")
        layers["bk"] = ((L, KV), ("layers", "kv"), "normal")
        layers["bv"] = ((L, KV), ("layers", "kv"), "normal")
    specs = {
        "embed": ((V, D), ("vocab", "embed"), "normal"),
        "layers": layers,
        "final_norm": ((D,), ("embed",), norm),
    }
    if not c.tie_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"), "normal")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def param_shapes(config: ModelConfig) -> dict:
    """Shapes of the canonical params."""
    return jax.tree.map(lambda s: s[0], param_specs(config), is_leaf=_is_spec)


def _layout_specs(config: ModelConfig) -> dict:
    """`param_specs` in the layout `config` prescribes: a fused projection concatenates its
    parts' output axes and takes the logical axes of its first part (its output axis is split
    like heads / mlp: correct under any split; XLA reshards the q|k|v slices); per-layer specs
    drop the leading ``layers`` axis."""
    specs = param_specs(config)
    layer = specs["layers"]
    if config.fuse_projections:
        for fused, parts in _FUSED.items():
            if parts[0] in layer:
                shape, axes, init = layer[parts[0]]
                width = sum(layer.pop(name)[0][-1] for name in parts)
                layer[fused] = (shape[:-1] + (width,), axes, init)
    op = config.linear
    for name in _PROJECTIONS:        # each projection in the linear op's stored form
        if name in layer:
            shape, axes, init = layer[name]
            layer[name] = (shape[:-2] + op.stored_shape(*shape[-2:]), axes[:-2] + op.stored_axes(*axes[-2:]), init)
    if op.head_copy:
        specs["head_linear"] = (op.stored_shape(config.hidden_size, config.vocab_size),
                                op.stored_axes("embed", "vocab"), "normal")
    if not config.scan_layers:
        layer = {k: (shape[1:], axes[1:], init) for k, (shape, axes, init) in layer.items()}
        specs["layers"] = tuple(dict(layer) for _ in range(config.num_layers))
    else:
        specs["layers"] = layer
    return specs


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and not any(isinstance(d, (tuple, list, dict)) for d in x)


def param_logical_axes(config: ModelConfig) -> dict:
    """A pytree parallel to the params in `config`'s layout, holding each leaf's logical axes
    (see `_layout_specs`)."""
    return jax.tree.map(lambda s: s[1], _layout_specs(config), is_leaf=_is_spec)


def _init_canonical(config: ModelConfig, key, std: float = INIT_STD) -> dict:
    """Random canonical params: normal(0, std) weights (drawn in float32, then cast), unit norms.

    The i-th normal tensor, in `param_specs` order, is drawn with ``jax.random.fold_in(key, i)``.
    """
    dtype = config.jnp_dtype
    drawn = 0

    def make(specs: dict) -> dict:
        nonlocal drawn
        out = {}
        for name, spec in specs.items():
            if not _is_spec(spec):
                out[name] = make(spec)
                continue
            shape, _, kind = spec
            if kind == "ones":
                out[name] = jnp.ones(shape, dtype)
            elif kind == "zeros":
                out[name] = jnp.zeros(shape, dtype)
            else:
                k = jax.random.fold_in(key, drawn)
                drawn += 1
                out[name] = (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return out

    return make(param_specs(config))


# ---------------------------------------------------------------------------------------
# Parameter layouts (see the module docstring): converted once, outside the jitted step.
# ---------------------------------------------------------------------------------------
def _fuse(lp: dict) -> dict:
    """One layer's (or the stacked layers') dict with fused projections (no-op if fused)."""
    for fused, parts in _FUSED.items():
        if all(n in lp for n in parts):
            lp[fused] = jnp.concatenate([lp.pop(n) for n in parts], axis=-1)
    return lp


def _unfuse(lp: dict, config: ModelConfig) -> dict:
    """The inverse of `_fuse` (no-op if unfused)."""
    c = config
    sizes = {"wqkv": (c.q_size, c.kv_size, c.kv_size), "bqkv": (c.q_size, c.kv_size, c.kv_size),
             "w_gate_up": (c.ffn_size, c.ffn_size)}
    for fused, parts in _FUSED.items():
        if fused in lp:
            arr = lp.pop(fused)
            splits = np.cumsum(sizes[fused])[:-1].tolist()
            lp.update(zip(parts, jnp.split(arr, splits, axis=-1)))
    return lp


def _proj_width(name: str, config: ModelConfig) -> int:
    """The output width of projection `name` (what its stored form holds: `LinearOp.restore`,
    `LinearOp.apply`)."""
    c = config
    return {"wq": c.q_size, "wk": c.kv_size, "wv": c.kv_size, "wo": c.hidden_size, "w_gate": c.ffn_size,
            "w_up": c.ffn_size, "w_down": c.hidden_size, "wqkv": c.q_size + 2 * c.kv_size,
            "w_gate_up": 2 * c.ffn_size}[name]


def _restore(lp: dict, config: ModelConfig, stacked: bool = False) -> dict:
    """One layer's dict (``stacked``: the layers' stacked dict) with every projection held in a
    linear op's stored form back as an [in, out] matrix (plain ones: left as they are)."""
    lp = dict(lp)
    for name in _PROJECTIONS:
        if name not in lp:
            continue
        w = lp[name]
        op = kernels.stored_op(jax.ShapeDtypeStruct(jnp.shape(w)[1:], w.dtype) if stacked else w)
        if op is not None:
            restore = lambda x, op=op, n=_proj_width(name, config): op.restore(x, n)    # noqa: E731
            lp[name] = jax.vmap(restore)(w) if stacked else restore(w)
    return lp


def _store(lp: dict, config: ModelConfig, stacked: bool = False) -> dict:
    """One layer's dict (``stacked``: the layers' stacked dict) with its [in, out] projections
    in the config's linear op's stored form (`LinearOp.store`)."""
    op = config.linear
    lp = dict(lp)
    for name in _PROJECTIONS:
        if name in lp:
            lp[name] = jax.vmap(op.store)(lp[name]) if stacked else op.store(lp[name])
    return lp


def _head_linear(params: dict, config: ModelConfig):
    """The LM head [D, V] in the linear op's stored form (``params['head_linear']``)."""
    if config.tie_embeddings:
        return config.linear.store_rows(params["embed"])
    return config.linear.store(params["lm_head"])


def stack_layers(layers):
    """Per-layer dicts (a list/tuple) -> one dict of arrays with a leading layer axis."""
    if not isinstance(layers, (list, tuple)):
        return layers
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def _relayout(params: dict, config: ModelConfig, with_head: bool = True) -> dict:
    """Params of any layout in the layout `config` prescribes; **consumes** ``params``.
    ``with_head=False``: no ``head_linear`` (the layers of a draft head that has its own head).

    The given dicts (``params``, its ``layers`` and their per-layer dicts) are emptied or
    rewritten as the result is built, so a caller that holds no other reference to the arrays (a
    loader) never holds two full copies of the layers: stacked arrays are split one tensor kind
    at a time, projections fused one layer (or one tensor group) at a time.
    """
    layers = params.pop("layers")
    out = dict(params)
    params.clear()
    out.pop("head_linear", None)
    fuse = _fuse if config.fuse_projections else (lambda lp: _unfuse(lp, config))
    convert = lambda lp: _store(fuse(_restore(lp, config)), config)       # noqa: E731  (one per-layer dict)
    if config.scan_layers:      # plain matrices before stacking, the op's stored form after fusing
        if isinstance(layers, (list, tuple)):
            layers = stack_layers([_restore(lp, config) for lp in layers])
        else:
            layers = _restore(layers, config, stacked=True)
        out["layers"] = _store(fuse(layers), config, stacked=True)
        if config.linear.head_copy and with_head:
            out["head_linear"] = _head_linear(out, config)
        return out
    if isinstance(layers, (list, tuple)):
        per_layer = list(layers)
    else:
        per_layer = [{} for _ in range(jax.tree.leaves(layers)[0].shape[0])]
        for key in list(layers):
            arr = layers.pop(key)
            for i, lp in enumerate(per_layer):
                lp[key] = arr[i]
            del arr
    for i in range(len(per_layer)):
        per_layer[i] = convert(per_layer[i])
    out["layers"] = tuple(per_layer)
    if config.linear.head_copy and with_head:
        out["head_linear"] = _head_linear(out, config)
    return out


def prepare_layers(layers, config: ModelConfig):
    """Decoder layers of any layout in the layout `config` prescribes (`Llama.prepare_params`
    for the layers alone: no embedding, no ``head_linear``; the input is left intact)."""
    return _relayout(_copy_dicts({"layers": layers}), config, with_head=False)["layers"]


def _copy_dicts(params: dict) -> dict:
    """New dicts (the arrays shared), so that `_relayout` leaves `params` intact."""
    p = dict(params)
    layers = p["layers"]
    p["layers"] = tuple(dict(lp) for lp in layers) if isinstance(layers, (list, tuple)) else dict(layers)
    return p


def canonical_params(params, config: ModelConfig) -> dict:
    """Stacked layers, unfused plain projections (``linear_op="xla"``): the form of `param_specs`
    (export, storage)."""
    canonical = config.replace(scan_layers=True, fuse_projections=False, linear_op="xla")
    return _relayout(_copy_dicts(params), canonical)


def truncate_layers(params, config: ModelConfig, k: int):
    """The first k layers with the same embeddings, final norm and head (early-exit draft).

    Keeps the layout (stacked params: a slice of every layer array; per-layer params: the first
    k entries). Returns (params, config with num_layers=k).
    """
    if not 1 <= k <= config.num_layers:
        raise ValueError(f"k must be in [1, {config.num_layers}], got {k}")
    p = dict(params)
    if isinstance(p["layers"], (list, tuple)):
        p["layers"] = tuple(p["layers"][:k])
    else:
        p["layers"] = jax.tree.map(lambda x: x[:k], p["layers"])
    return p, config.replace(num_layers=k)


# ---------------------------------------------------------------------------------------
# Building blocks (pure functions).
# ---------------------------------------------------------------------------------------
def rms_norm(x, weight, eps: float):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in float32 (as HF Llama/Qwen2)."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(dtype)


def norm(config: ModelConfig, x, weight):
    """The family's RMSNorm: `rms_norm` (Llama: the normalized x cast to the model dtype, then
    scaled), or for Gemma (``norm_offset``, or ``sandwich_norms``: a Gemma read from GGUF, whose
    norm weights hold the offset already) x * rsqrt(mean(x^2) + eps) * (offset + weight)
    computed in float32, then cast. In float32 the two are the same."""
    if not config.norm_offset and not config.sandwich_norms:
        return rms_norm(x, weight, config.rms_eps)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + config.rms_eps)
    return (x32 * (config.norm_offset + weight.astype(jnp.float32))).astype(x.dtype)


def softcap(logits, cap: float | None):
    """cap * tanh(logits / cap) (Gemma 2's final soft-capping); None leaves them as they are.
    Every path that turns a final hidden state into output logits applies it."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def rope_cos_sin(config: ModelConfig, positions_BT, local: bool = False):
    """cos, sin [B, T, head_dim] in float32 for integer positions [B, T] (``local``: the
    windowed layers' RoPE, `ModelConfig.inv_freq`)."""
    inv = jnp.asarray(config.inv_freq(local))                              # [hd/2]
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTQH, cos_BTH, sin_BTH):
    half = x_BTQH.shape[-1] // 2
    x = x_BTQH.astype(jnp.float32)
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BTH[:, :, None, :] + rot * sin_BTH[:, :, None, :]
    return out.astype(x_BTQH.dtype)


def _linear(config: ModelConfig, x, w, b=None, width: int | None = None):
    """x @ w (+ b); ``w`` a matrix [in, width] in the stored form of the config's linear op."""
    y = config.linear.apply(x, w, width)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _activation(config: ModelConfig, x):
    if config.mlp_activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def _experts(config: ModelConfig, p: dict, x_BTD):
    """A mixture-of-experts MLP. Routing is exact: softmax over the router's logits in float32,
    the top ``experts_per_token`` (normalized to sum 1 with ``normalize_topk``); dispatch is by
    sort: the M*k (token, expert) pairs sorted by expert and multiplied group by group with
    `jax.lax.ragged_dot`, so work grows with k, not with the number of experts; each token then
    sums its k outputs, weighted."""
    c = config
    B, T, D = x_BTD.shape
    E, k = c.num_experts, c.experts_per_token
    x_MD = x_BTD.reshape(B * T, D)
    logits_ME = jnp.einsum("md,de->me", x_MD, p["router"], preferred_element_type=jnp.float32)
    weights_Mk, experts_Mk = jax.lax.top_k(jax.nn.softmax(logits_ME, axis=-1), k)
    if c.normalize_topk:
        weights_Mk = weights_Mk / jnp.sum(weights_Mk, axis=-1, keepdims=True)
    order_Mk = jnp.argsort(experts_Mk.reshape(-1), stable=True)        # P = M * k pairs, by expert
    token_Mk = order_Mk // k
    sizes_E = jnp.bincount(experts_Mk.reshape(-1), length=E).astype(jnp.int32)
    xs_MkD = x_MD[token_Mk]
    gate = jax.lax.ragged_dot(xs_MkD, p["we_gate"], sizes_E, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(xs_MkD, p["we_up"], sizes_E, preferred_element_type=jnp.float32)
    h_MkI = (_activation(c, gate.astype(x_MD.dtype)) * up.astype(x_MD.dtype))
    out_MkD = jax.lax.ragged_dot(h_MkI, p["we_down"], sizes_E, preferred_element_type=jnp.float32)
    out_MkD = out_MkD.astype(x_MD.dtype).astype(jnp.float32) * weights_Mk.reshape(-1)[order_Mk][:, None]
    y_MD = jnp.zeros((B * T, D), jnp.float32).at[token_Mk].add(out_MkD)
    return y_MD.reshape(B, T, D).astype(x_BTD.dtype)


def _layer(config: ModelConfig, p: dict, h_BTD, cos, sin, past, tree_mask=None, write_at=None, offset: int = 0,
           rows: PackedRows | None = None):
    """One decoder layer. ``past`` = (k_BKSH, v_BKHS, lengths_B) of this layer, or None;
    ``tree_mask``: the queries' `specjax.models.attention` visibility (None: plain causal).
    With ``rows`` (`specjax.models.packing`) ``h_BTD`` is the packed [1, N, D]: the position-wise
    parts run on it, the attention on the dense block (q, k, v unpacked, its output packed).

    Returns the new hidden states and this call's (k, v) [B, T, K, H] in the cache dtype.
    With ``write_at`` [B] (write-then-attend): this call's entries are written into ``past``'s
    buffers at slots ``write_at + t`` before attending, ``tree_mask`` is the visibility over
    slots (`attention.written_visibility`), and the written (k_buf, v_buf) are returned instead.
    """
    c = config
    B, T = h_BTD.shape[:2] if rows is None else (rows.batch, rows.width)
    kv_dtype = c.jnp_dtype
    x = norm(c, h_BTD, p["attn_norm"])
    width = lambda name: _proj_width(name, c)     # noqa: E731  (the width the stored form holds)
    if c.fuse_projections:
        qkv = _linear(c, x, p["wqkv"], p["bqkv"] if c.attention_bias else None, width("wqkv"))
        q, k, v = qkv[..., :c.q_size], qkv[..., c.q_size:c.q_size + c.kv_size], qkv[..., c.q_size + c.kv_size:]
    else:
        q, k, v = (_linear(c, x, p["w" + n], p["b" + n] if c.attention_bias else None, width("w" + n)) for n in "qkv")
    if rows is not None:
        q, k, v = rows.unpack(q), rows.unpack(k), rows.unpack(v)
    q = q.reshape(B, T, c.num_heads, c.head_dim)
    k = k.reshape(B, T, c.num_kv_heads, c.head_dim)
    v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = norm(c, q, p["q_norm"]), norm(c, k, p["k_norm"])
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin).astype(kv_dtype)
    v = v.astype(kv_dtype)
    spec = AttentionSpec(scale=c.attention_scale, softcap=c.attn_softcap, causal_chunk=c.causal_chunk)
    if write_at is not None:
        # a verification block's or tree's last keys in position order (`AttentionSpec.ordered_tail`),
        # within 2 T - 1 slots after ``offset`` tentative entries of earlier calls
        if c.ordered_tail and T <= ORDERED_TAIL_MAX:
            spec = dataclasses.replace(spec, ordered_tail=T, tail_span=2 * T - 1 + offset)
        # The barrier asks XLA to keep the written buffers one value that attention and the
        # returned cache share. XLA:CPU expands barriers early and still copies the buffers at
        # batch 1 (tests/test_llama_cache.py checks the CPU profile, which keeps this off); the
        # TPU programs compile copy-free at batch 1 (experiments/aot/README.md).
        k_buf, v_buf = jax.lax.optimization_barrier(write_kv(past[0], past[1], k, v, write_at, per_row=True))
        attn = attention(q, None, None, (k_buf, v_buf, past[2]), (tree_mask, None), spec=spec, op=c.attention_op)
        k, v = k_buf, v_buf
    else:
        attn = attention(q, k, v, past, tree_mask, kernel=c.cpu_attention and c.plain_attention, spec=spec,
                         op=c.attention_op)
    if rows is not None:
        attn = rows.pack(attn)
    out = _linear(c, attn, p["wo"], width=width("wo"))
    h_BTD = h_BTD + (norm(c, out, p["post_attn_norm"]) if c.sandwich_norms else out)
    x = norm(c, h_BTD, p["mlp_norm"])
    if c.num_experts:
        out = _experts(c, p, x)
        h_BTD = h_BTD + (norm(c, out, p["post_mlp_norm"]) if c.sandwich_norms else out)
        return h_BTD, (k, v)
    if c.fuse_projections:
        gate_up = _linear(c, x, p["w_gate_up"], width=width("w_gate_up"))
        gate, up = gate_up[..., :c.ffn_size], gate_up[..., c.ffn_size:]
    else:
        gate, up = _linear(c, x, p["w_gate"], width=width("w_gate")), _linear(c, x, p["w_up"], width=width("w_up"))
    out = _linear(c, _activation(c, gate) * up, p["w_down"], width=width("w_down"))
    h_BTD = h_BTD + (norm(c, out, p["post_mlp_norm"]) if c.sandwich_norms else out)
    return h_BTD, (k, v)


def _describe(layers) -> str:
    if isinstance(layers, (list, tuple)):
        first = layers[0] if layers else {}
        kind = f"a tuple of {len(layers)} per-layer dicts"
    elif isinstance(layers, dict):
        first = layers
        n = layers["attn_norm"].shape[0] if "attn_norm" in layers else "?"
        kind = f"a dict of arrays stacked over {n} layers"
    else:
        return f"a {type(layers).__name__}"
    ops = {op.name for op in (kernels.stored_op(first[n]) for n in _PROJECTIONS if n in first) if op is not None}
    stored = f", stored by linear op {', '.join(sorted(ops))}" if ops and isinstance(layers, (list, tuple)) else ""
    return f"{kind}, projections {'fused' if 'wqkv' in first else 'unfused'}{stored}"


# ---------------------------------------------------------------------------------------
# The trunk's pieces (`Llama.trunk` calls them in this order).
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Block:
    """What every layer of one trunk call shares: where the block is written and what it sees.

    ``limit``: attention reads cache slots [0, limit) only (chunked prefill's bound on the
    committed lengths; None: all). ``past_capacity``: the committed slots a layer reads (None:
    nothing committed to attend to: no cache, or limit 0). ``masks`` and ``ropes``: per layer
    variant, its visibility (None: causal) and its (cos, sin); ``variant_L``: each layer's variant.
    """
    lengths_B: jax.Array | None        # int32 committed lengths (None: no cache)
    write_at_B: jax.Array | None       # the slot of the block's first token (None: no cache)
    limit: int | None
    past_capacity: int | None
    write_first: bool                  # write-then-attend (`ModelConfig.write_then_attend`)
    offset: int                        # tentative tree entries of earlier calls before the block
    masks: tuple
    ropes: tuple
    variant_L: tuple[int, ...]
    rows: PackedRows | None = None     # the positions the position-wise parts compute (None: all)


def _block_shape(config: ModelConfig, tokens_BT, inputs_BTD):
    """(tokens_BT as int32 or None, B, T) of a trunk call, its inputs' shapes checked."""
    if inputs_BTD is None:
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens_BT must be [batch, time], got shape {tokens_BT.shape}")
        return (tokens_BT, *tokens_BT.shape)
    if jnp.ndim(inputs_BTD) != 3 or jnp.shape(inputs_BTD)[2] != config.hidden_size:
        raise ValueError(f"inputs_BTD must be [batch, time, {config.hidden_size}], got {jnp.shape(inputs_BTD)}")
    return (tokens_BT, *jnp.shape(inputs_BTD)[:2])


def _layer_indices(config: ModelConfig, collect) -> tuple[int, ...]:
    """Feature layers as 0-based indices (-1 = the last layer)."""
    L = config.num_layers
    collect = tuple(int(i) % L if -L <= int(i) < L else None for i in collect)
    if None in collect:
        raise ValueError(f"feature layers must be in [-{L}, {L}), the model's layers")
    return collect


def _check_tree(tree, cache, num_valid_B, B: int, T: int) -> None:
    """Raise ValueError unless ``tree`` can be the block of tokens [B, T] of a cached call."""
    if cache is None:
        raise ValueError("tree= needs a cache: tree entries are written past its committed "
                         "length (for a cache-free forward, pass tree=None)")
    if num_valid_B is not None:
        raise ValueError("tree= and num_valid_B cannot be combined: a tree call never "
                         "advances the committed length (commit a path with "
                         "cache.commit_path)")
    pos_shape, vis_shape = jnp.shape(tree.rel_positions_BT), jnp.shape(tree.visible_BTW)
    if pos_shape != (B, T) or len(vis_shape) != 3 or vis_shape[:2] != (B, T) \
            or vis_shape[2] < T:
        raise ValueError(f"a tree block for tokens [{B}, {T}] needs rel_positions_BT "
                         f"[{B}, {T}] and visible_BTW [{B}, {T}, offset + {T}], got "
                         f"{pos_shape} and {vis_shape}")


def _embed(config: ModelConfig, params, tokens_BT, inputs_BTD):
    """The first layer's input [B, T, D] in the model dtype: the tokens' embedding (scaled by
    sqrt(D) with ``scale_embeddings``), or ``inputs_BTD`` when given."""
    c = config
    if inputs_BTD is not None:
        return jnp.asarray(inputs_BTD).astype(c.jnp_dtype)
    h = jnp.take(params["embed"], tokens_BT, axis=0).astype(c.jnp_dtype)
    if c.scale_embeddings:
        h = h * jnp.asarray(np.sqrt(c.hidden_size), c.jnp_dtype)
    return h


def _positions(config: ModelConfig, cache, tree, B: int, T: int):
    """(positions_BT, committed lengths_B or None without a cache), the cache checked against
    the model and the block."""
    c = config
    t_T = jnp.arange(T, dtype=jnp.int32)
    if cache is None:
        return jnp.broadcast_to(t_T[None, :], (B, T)), None
    if cache.num_layers != c.num_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model {c.num_layers}")
    if cache.per_layer == c.scan_layers:
        raise ValueError(
            f"a {'per-layer' if cache.per_layer else 'stacked'} cache given to a model with "
            f"scan_layers={c.scan_layers}: make the cache with model.init_cache")
    if cache.batch_size != B:
        raise ValueError(f"cache batch {cache.batch_size} != tokens batch {B}")
    lengths = cache.lengths_B.astype(jnp.int32)
    positions = lengths[:, None] + (
        t_T[None, :] if tree is None else jnp.asarray(tree.rel_positions_BT, jnp.int32))
    return positions, lengths


def _block(config: ModelConfig, cache, tree, B: int, T: int) -> _Block:
    """The `_Block` of a trunk call (positions from `_positions`).

    Layer variants: (window, local RoPE) per layer; each distinct one gets its visibility and
    RoPE tables once. A model without windows has one variant: the plain program.
    """
    c = config
    positions, lengths = _positions(c, cache, tree, B, T)
    write_at, tree_mask = lengths, None            # tree_mask: None (causal) or the tree's
    limit = None if cache is None else getattr(cache, "attend_limit", None)
    if limit is not None and tree is not None:
        raise ValueError("a cache with an attend limit (a prefill chunk) cannot take a tree block")
    if tree is not None:
        tree_mask = tree_attention_mask(tree, lengths, cache.capacity)
        write_at = lengths + tree.offset
    variant_of = [(w, bool(w) and c.has_local_rope) for w in c.layer_windows]
    variants = sorted(set(variant_of))
    past_capacity = None if cache is None or limit == 0 else (cache.capacity if limit is None else limit)
    masks, ropes = [], []
    for w, local in variants:
        if w:
            masks.append(window_mask(tree_mask, positions, lengths if past_capacity else None,
                                     past_capacity, w))
        else:
            masks.append(tree_mask)
        ropes.append(rope_cos_sin(c, positions, local))
    # Write-then-attend: each unrolled layer writes its block into its own buffer, then attends
    # over the buffer's slots. Not for a prefill chunk's bounded read or the CPU decode kernel
    # (which reads the committed slots and the block's own keys). (XLA:CPU copies the buffers
    # under it, so the CPU profile keeps it off.)
    write_first = (c.write_then_attend and not c.scan_layers and cache is not None and limit is None
                   and not (c.cpu_attention and c.plain_attention))
    if write_first:
        masks = [written_visibility(m, lengths, write_at, T, cache.capacity) for m in masks]
    return _Block(lengths_B=lengths, write_at_B=write_at, limit=limit, past_capacity=past_capacity,
                  write_first=write_first, offset=0 if tree is None else int(tree.offset), masks=tuple(masks),
                  ropes=tuple(ropes), variant_L=tuple(variants.index(v) for v in variant_of))


def _run_layer(config: ModelConfig, block: _Block, lp, h_BTD, k_BKSH, v_BKHS, mask, cos_sin):
    """`_layer` over this layer's cache buffers (the committed slots it may read) and ``block``."""
    if block.past_capacity is None:        # nothing committed to attend to
        past = None
    elif block.limit is not None:
        past = (k_BKSH[:, :, :block.limit], v_BKHS[..., :block.limit], block.lengths_B)
    else:
        past = (k_BKSH, v_BKHS, block.lengths_B)
    return _layer(config, lp, h_BTD, *cos_sin, past, mask, block.write_at_B if block.write_first else None,
                  block.offset, block.rows)


def _scan_variant_picker(block: _Block, B: int, T: int):
    """(pick, index_L) for the scanned layers: ``pick(i)`` is (mask, (cos, sin)) of the layer
    whose scanned input is ``i`` (``index_L[layer]``, None with a single variant). With several
    variants the visibilities (causal made explicit) and RoPE tables are stacked and indexed by
    layer."""
    masks, ropes, past_capacity = block.masks, block.ropes, block.past_capacity
    if len(masks) == 1:
        return (lambda i: (masks[0], ropes[0])), None
    full = [m if m is not None else causal_mask_for(block.lengths_B if past_capacity else None, T,
                                                    past_capacity)
            for m in masks]
    stacked_past = None if past_capacity is None else jnp.stack(
        [jnp.broadcast_to(m[0], (B, T, past_capacity)) for m in full])
    stacked_new = jnp.stack([jnp.broadcast_to(m[1], (B, T, T)) for m in full])
    stacked_cos = jnp.stack([r[0] for r in ropes])
    stacked_sin = jnp.stack([r[1] for r in ropes])

    def pick(i):
        mask = (None if stacked_past is None else stacked_past[i], stacked_new[i])
        return mask, (stacked_cos[i], stacked_sin[i])

    return pick, jnp.asarray(block.variant_L, jnp.int32)


def _scanned_layers(config: ModelConfig, layers, h_BTD, cache, block: _Block, collect):
    """The stacked layers under one `lax.scan`: (output, {layer: its output for layers in
    ``collect``}, k_buf, v_buf: the cache's buffers with the block written, None without a cache)."""
    B, T = h_BTD.shape[:2] if block.rows is None else (block.rows.batch, block.rows.width)
    pick, index_L = _scan_variant_picker(block, B, T)

    def body(h, xs):
        lp, k_BKSH, v_BKHS, i = xs
        mask, cos_sin = pick(i)
        h, new_kv = _run_layer(config, block, lp, h, k_BKSH, v_BKHS, mask, cos_sin)
        return h, (new_kv, h) if collect else new_kv

    xs = (layers, None, None, index_L) if cache is None else (layers, cache.k, cache.v, index_L)
    h_BTD, ys = jax.lax.scan(body, h_BTD, xs)      # kv: [L, B, T, K, H]
    (k_new, v_new), h_L = ys if collect else (ys, None)
    collected = {i: h_L[i] for i in collect}
    if cache is None:
        return h_BTD, collected, None, None
    return (h_BTD, collected, *write_kv(cache.k, cache.v, k_new, v_new, block.write_at_B))


def _unrolled_layers(config: ModelConfig, layers, h_BTD, cache, block: _Block, collect):
    """The per-layer dicts in a Python loop; returns what `_scanned_layers` does (the buffers
    as tuples of per-layer buffers)."""
    collected, ks, vs = {}, [], []
    for i, lp in enumerate(layers):
        mask, cos_sin = block.masks[block.variant_L[i]], block.ropes[block.variant_L[i]]
        if cache is None:
            h_BTD, _ = _run_layer(config, block, lp, h_BTD, None, None, mask, cos_sin)
        else:
            k_i, v_i = cache.layer(i)
            h_BTD, (k, v) = _run_layer(config, block, lp, h_BTD, k_i, v_i, mask, cos_sin)
            # Each layer writes its own buffer (after reading it, unless it wrote first): in
            # place when donated.
            k_i, v_i = (k, v) if block.write_first else write_kv(k_i, v_i, k, v, block.write_at_B)
            ks.append(k_i)
            vs.append(v_i)
        if i in collect:
            collected[i] = h_BTD
    return h_BTD, collected, tuple(ks), tuple(vs)


def _updated_cache(cache, k_buf, v_buf, lengths_B, tree, num_valid_B, B: int, T: int):
    """The cache after a trunk call: the written buffers, and the committed length advanced by
    ``num_valid_B`` (default T), or unchanged for a tree block (tentative entries)."""
    if tree is not None:
        return cache.replace(k=k_buf, v=v_buf, lengths_B=lengths_B)
    if cache is None:
        return None
    n = T if num_valid_B is None else num_valid_B
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    return cache.replace(k=k_buf, v=v_buf, lengths_B=lengths_B + n)


# ---------------------------------------------------------------------------------------
# The model object (protocol implementation).
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Llama:
    """The decoder as a protocol model: frozen and hashable (a static `jax.jit` argument).

    ``apply`` jitted with the cache donated (``jax.jit(model.apply, donate_argnums=(2,))``)
    updates the cache in place. The config's layout fields pick the layer loop, the parameter
    layout and the cache layout (`init_cache`); see the module docstring.
    """
    config: ModelConfig

    # -- protocol -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch_size, c.num_kv_heads, capacity, c.head_dim,
                             c.jnp_dtype, per_layer=not c.scan_layers)

    def apply(self, params, tokens_BT, cache, num_valid_B=None, tree=None, rows: PackedRows | None = None):
        """Logits [B, T, V] (float32) and the updated cache; see `trunk`. With ``rows``
        (`specjax.models.packing`): only the listed positions are computed, the others' logits
        are zeros."""
        if rows is None:
            h, cache = self.hidden_states(params, tokens_BT, cache, num_valid_B, tree)
            return self.logits_from_hidden(params, h), cache
        h, _, cache = self.trunk(params, tokens_BT, cache, num_valid_B, tree, rows=rows)
        return rows.unpack(self.logits_from_hidden(params, self.final_norm(params, h))), cache

    def apply_with_features(self, params, tokens_BT, cache, num_valid_B=None, tree=None,
                            layers: tuple[int, ...] = (-1,), rows: PackedRows | None = None):
        """`apply` plus the hidden features a draft head reads: (logits [B, T, V], features
        [B, T, len(layers) * D], cache). Features are the residual stream after each listed
        layer (0-based; -1 = the last layer's output before the final norm), concatenated in
        the order given, in the model's dtype. One forward: the same program as `apply` with
        the chosen layers' outputs kept. ``rows`` as in `apply` (unused positions' features are
        zeros too)."""
        h, feats, cache = self.trunk(params, tokens_BT, cache, num_valid_B, tree, collect=layers, rows=rows)
        logits = self.logits_from_hidden(params, self.final_norm(params, h))
        feats = jnp.concatenate(feats, axis=-1)
        if rows is not None:
            logits, feats = rows.unpack(logits), rows.unpack(feats)
        return logits, feats, cache

    # -- parameters -----------------------------------------------------------------------
    def init_params(self, key) -> dict:
        """Random parameters (normal(0.02) weights, unit norms) in this config's layout."""
        return _relayout(_init_canonical(self.config, key), self.config)

    def prepare_params(self, params) -> dict:
        """Params of any layout (canonical, per-layer, fused or not) in this config's layout.

        Call once, outside the jitted step; idempotent. `params` itself is left intact (its
        arrays are shared with the result where the layout already matches).
        """
        return _relayout(_copy_dicts(params), self.config)

    def check_params(self, params) -> None:
        """Raise ValueError unless `params` are in this config's layout, with this config's shapes
        for ``embed``, ``final_norm`` and every layer tensor (a trace-time check, free at run time)."""
        c = self.config
        missing = [k for k in ("embed", "final_norm", "layers") if k not in params]
        if missing:
            raise ValueError(f"params lack {missing}: not the parameters of a Llama model")
        want = jax.tree.map(lambda s: s[0], _layout_specs(c), is_leaf=_is_spec)
        layers = params["layers"]
        layers = tuple(layers) if isinstance(layers, list) else layers
        if jax.tree.structure(layers) != jax.tree.structure(want["layers"], is_leaf=_is_shape) or \
                (c.scan_layers and jnp.shape(layers["attn_norm"])[:1] != (c.num_layers,)):
            raise ValueError(self._layout_error(layers, want["layers"]))
        got = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": layers}
        if c.linear.head_copy:
            if "head_linear" not in params:
                raise ValueError(f"params lack 'head_linear' (the LM head in linear op {c.linear_op!r}'s stored form); "
                                 "convert the params once: params = model.prepare_params(params)")
            got["head_linear"] = params["head_linear"]
        for (path, x), (_, shape) in zip(jax.tree_util.tree_leaves_with_path(got),
                                         jax.tree_util.tree_leaves_with_path(
                                             {k: want[k] for k in got}, is_leaf=_is_shape)):
            if tuple(jnp.shape(x)) != shape:
                # a plain matrix where the op's stored form is expected, or another op's form: another layout
                held = kernels.stored_op(x)
                expected = c.linear if c.linear.is_stored(jax.ShapeDtypeStruct(shape, jnp.result_type(x))) else None
                form = "a plain matrix" if held is None else f"stored by linear op {held.name!r}"
                layout = (f" (another layout: {form}, this model's linear_op={c.linear_op!r}; convert the params once, "
                          "outside the jitted step: params = model.prepare_params(params))"
                          if held is not expected and not c.scan_layers else "")
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(x))}; this "
                    f"model's config expects {shape}{layout}")

    def _layout_error(self, layers, want_layers) -> str:
        c = self.config
        if c.scan_layers:
            want, first_want = f"a dict of arrays stacked over {c.num_layers} layers", want_layers
            first = layers if isinstance(layers, dict) else None
        else:
            want, first_want = f"a tuple of {c.num_layers} per-layer dicts", want_layers[0]
            dicts = [lp for lp in layers if isinstance(lp, dict)] if isinstance(layers, tuple) else []
            first = next((lp for lp in dicts if set(lp) != set(first_want)), dicts[0] if dicts else None)
        want += ", projections fused (wqkv, w_gate_up)" if c.fuse_projections else \
            ", projections unfused (wq, wk, wv, w_gate, w_up)"
        want += f", stored by linear op {c.linear_op!r}" if c.linear_op != "xla" else ""
        keys = ""   # the right kind of container with the wrong tensors in it: name them
        if isinstance(first, dict) and ("wqkv" in first) == c.fuse_projections:
            missing, extra = sorted(set(first_want) - set(first)), sorted(set(first) - set(first_want))
            if missing or extra:
                keys = f" (tensors missing: {missing}, unexpected: {extra})"
        return (f"params['layers'] is {_describe(layers)}{keys}; this model (scan_layers="
                f"{c.scan_layers}, fuse_projections={c.fuse_projections}, linear_op="
                f"{c.linear_op!r}) reads {want}. Convert the "
                f"params once, outside the jitted step: params = model.prepare_params(params)")

    def param_logical_axes(self) -> dict:
        return param_logical_axes(self.config)

    # -- pieces ---------------------------------------------------------------------------
    def hidden_states(self, params, tokens_BT, cache, num_valid_B=None, tree=None):
        """Final hidden states [B, T, D] (after the final RMSNorm) and the updated cache; see
        `trunk`."""
        h, _, cache = self.trunk(params, tokens_BT, cache, num_valid_B, tree)
        return self.final_norm(params, h), cache

    def final_norm(self, params, h_BTD):
        """The final norm of the trunk's output (what the LM head reads)."""
        return norm(self.config, h_BTD, params["final_norm"])

    def trunk(self, params, tokens_BT, cache, num_valid_B=None, tree=None, collect: tuple[int, ...] = (),
              inputs_BTD=None, rows: PackedRows | None = None):
        """The decoder layers: (last layer's output [B, T, D] before the final norm, the outputs
        of the layers in ``collect`` (0-based, -1 = last; a tuple of [B, T, D]), updated cache).
        ``inputs_BTD`` replaces the token embedding as the first layer's input (a draft head's
        own layer; ``tokens_BT`` is then ignored and may be None).

        Without ``tree``: token t of row b at slot and position ``lengths_B[b] + t``, causal,
        ``lengths_B`` advanced by ``num_valid_B`` (default T). With a `TreeBlock` (needs a
        cache; ``num_valid_B`` must be None): positions ``lengths_B + tree.rel_positions_BT``,
        the tree's visibility (`tree_attention_mask`), entries written at slots
        ``lengths_B + tree.offset + t`` and ``lengths_B`` returned unchanged (tentative entries,
        committed by `KVCache.commit_path`). Capacity is the caller's to check.

        With ``rows`` (a `PackedRows` over [B, T], chains only): the position-wise parts run on
        the listed positions, and the output and the collected layers are packed, [1, N, D]
        (``rows.unpack`` gives [B, T, D] with zeros at the other positions).
        """
        c = self.config
        self.check_params(params)
        tokens_BT, B, T = _block_shape(c, tokens_BT, inputs_BTD)
        collect = _layer_indices(c, collect)
        if tree is not None:
            _check_tree(tree, cache, num_valid_B, B, T)
        if rows is not None:
            if tree is not None:
                raise ValueError("rows= packs a chain block's positions; a tree block (tree=) is computed whole")
            if (rows.batch, rows.width) != (B, T):
                raise ValueError(f"rows= packs a [{rows.batch}, {rows.width}] block, the tokens are [{B}, {T}]")
        h = _embed(c, params, tokens_BT, inputs_BTD)
        block = _block(c, cache, tree, B, T)
        if rows is not None:
            h, block = rows.pack(h), dataclasses.replace(block, rows=rows)
        layers = _scanned_layers if c.scan_layers else _unrolled_layers
        h, collected, k_buf, v_buf = layers(c, params["layers"], h, cache, block, collect)
        feats = tuple(collected[i] for i in collect)
        return h, feats, _updated_cache(cache, k_buf, v_buf, block.lengths_B, tree, num_valid_B, B, T)

    def logits_from_hidden(self, params, h_BTD):
        """The LM head: float32 logits [B, T, V] from final hidden states (soft-capped with
        ``final_softcap``)."""
        return softcap(self._head(params, h_BTD), self.config.final_softcap)

    def _head(self, params, h_BTD):
        op = self.config.linear
        if op.head_copy:
            if "head_linear" not in params:
                raise ValueError(f"the head of a model with linear_op={self.config.linear_op!r} needs "
                                 f"params['head_linear'] (model.prepare_params)")
            return op.apply(h_BTD, params["head_linear"], self.config.vocab_size)
        if self.config.tie_embeddings:
            return jnp.einsum("btd,vd->btv", h_BTD, params["embed"].astype(h_BTD.dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h_BTD, params["lm_head"].astype(h_BTD.dtype),
                          preferred_element_type=jnp.float32)
