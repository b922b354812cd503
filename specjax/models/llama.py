"""Llama-family decoder (Llama / SmolLM2 / Qwen2): a Flax NNX module for init, a pure apply.

Parameters are a plain nested dict (the pure form of the NNX state), with every per-layer
tensor stacked along a leading layer axis, in both scan and unrolled mode::

    embed        [V, D]                 token embedding (also the head when tied)
    final_norm   [D]
    lm_head      [D, V]                 only when not tied
    layers/attn_norm [L, D]   wq [L, D, H*hd]   wk, wv [L, D, K*hd]   wo [L, H*hd, D]
           bq [L, H*hd]  bk, bv [L, K*hd]        (only with attention_bias, Qwen2 style)
           mlp_norm [L, D]    w_gate, w_up [L, D, F]   w_down [L, F, D]

Projections are stored input-major ([in, out]) so ``x @ w`` needs no transpose; heads are
laid out head-major inside the H*hd axis (the Hugging Face order). RoPE uses the HF
"rotate_half" convention (dims i and i + hd/2 form a pair).

With ``config.fuse_projections``, `Llama.prepare_params` concatenates along the output axis
``wqkv = [wq | wk | wv]`` (and ``bqkv``) and ``w_gate_up = [w_gate | w_up]``: two matmuls per
layer instead of five read the same bytes in longer streams (~20% faster layers at batch 1
on a 2-core CPU). `canonical_params` turns any form back into the stacked, unfused one.

`Llama(config)` is the frozen, hashable model object of `specjax.models._protocol`:
``apply(params, tokens_BT, cache, num_valid_B=None) -> (logits_BTV, cache)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models._protocol import CacheCapacityError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, write_kv

PyTree = Any


# ---------------------------------------------------------------------------------------
# Parameter specification: shapes, logical axes and init, one source of truth.
# ---------------------------------------------------------------------------------------
def param_specs(config: ModelConfig) -> dict:
    """Nested dict path -> (shape, logical axes, init kind) for every parameter."""
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
    if c.attention_bias:
        layers["bq"] = ((L, Q), ("layers", "heads"), "normal")
        layers["bk"] = ((L, KV), ("layers", "kv"), "normal")
        layers["bv"] = ((L, KV), ("layers", "kv"), "normal")
    specs = {
        "embed": ((V, D), ("vocab", "embed"), "normal"),
        "layers": layers,
        "final_norm": ((D,), ("embed",), "ones"),
    }
    if not c.tie_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"), "normal")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def param_shapes(config: ModelConfig) -> dict:
    return jax.tree.map(lambda s: s[0], param_specs(config), is_leaf=_is_spec)


def param_logical_axes(config: ModelConfig) -> dict:
    """A pytree parallel to the params holding each leaf's logical axis names."""
    return jax.tree.map(lambda s: s[1], param_specs(config), is_leaf=_is_spec)


def _add_param(obj, name, spec, dtype, rngs, std):
    shape, axes, kind = spec
    if kind == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    setattr(obj, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))


class _Group(nnx.Module):
    """A bag of parameters (attributes set from a spec dict)."""

    def __init__(self, specs: dict, dtype, rngs: nnx.Rngs, std: float):
        for name, spec in specs.items():
            if _is_spec(spec):
                _add_param(self, name, spec, dtype, rngs, std)
            else:
                setattr(self, name, _Group(spec, dtype, rngs, std))


class LlamaModule(nnx.Module):
    """The NNX form of the decoder: random init, sharding metadata, and a convenience call.

    The hot path is the pure `Llama.apply` over ``nnx.to_pure_dict(nnx.split(module)[1])``;
    calling the module just routes there.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        self.config = config
        dtype = config.jnp_dtype
        for name, spec in param_specs(config).items():
            if _is_spec(spec):
                _add_param(self, name, spec, dtype, rngs, init_std)
            else:
                setattr(self, name, _Group(spec, dtype, rngs, init_std))

    def __call__(self, tokens_BT, cache=None, num_valid_B=None):
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return Llama(self.config).apply(params, tokens_BT, cache, num_valid_B)


# ---------------------------------------------------------------------------------------
# Building blocks (pure functions).
# ---------------------------------------------------------------------------------------
def rms_norm(x, weight, eps: float):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in float32 (as HF Llama/Qwen2)."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(dtype)


def rope_cos_sin(config: ModelConfig, positions_BT):
    """cos, sin [B, T, head_dim] in float32 for integer positions [B, T]."""
    inv = jnp.asarray(config.inv_freq())                                   # [hd/2]
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTNH, cos_BTH, sin_BTH):
    half = x_BTNH.shape[-1] // 2
    x = x_BTNH.astype(jnp.float32)
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BTH[:, :, None, :] + rot * sin_BTH[:, :, None, :]
    return out.astype(x_BTNH.dtype)


def attention(q_BTNH, k_new_BTKH, v_new_BTKH, past=None):
    """Grouped-query attention of T queries over cached slots and the T new tokens.

    ``past`` is None (plain causal attention over the new tokens) or
    ``(k_BKSH, v_BKHS, lengths_B)``: the layer's cache *before* this call (layouts: see
    `specjax.models.kv_cache`); slot s of row b
    is visible iff ``s < lengths_B[b]``. New token t' is visible to query t iff t' <= t.
    Query t therefore sees exactly positions < lengths_B[b] + t + 1. The cache is only
    read here; the caller writes the new entries afterwards (`write_kv`: per layer right after
    this read, or once for all layers after a `lax.scan`), an in-place update when donated. Returns [B, T, N*H].
    """
    B, T, N, H = q_BTNH.shape
    K = k_new_BTKH.shape[2]
    G = N // K
    # A causally masked position gets weight exactly 0, but 0 * NaN = NaN: a NaN value vector
    # at a later (e.g. rejected draft) position would poison every earlier query. Zero it; a
    # position whose own state is NaN still yields NaN logits through the residual stream.
    v_new_BTKH = jnp.nan_to_num(v_new_BTKH, nan=0.0, posinf=0.0, neginf=0.0)
    neg = jnp.finfo(jnp.float32).min
    q = q_BTNH.reshape(B, T, K, G, H)
    scale = 1.0 / np.sqrt(H)
    s_new = jnp.einsum("btkgh,bskh->bkgts", q, k_new_BTKH,
                       preferred_element_type=jnp.float32) * scale
    t_T = jnp.arange(T)
    s_new = jnp.where((t_T[None, :] <= t_T[:, None])[None, None, None], s_new, neg)
    if past is None:
        probs = jax.nn.softmax(s_new, axis=-1)
        out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_new_BTKH.dtype), v_new_BTKH,
                         preferred_element_type=jnp.float32)
        return out.reshape(B, T, N * H).astype(q_BTNH.dtype)
    k_BKSH, v_BKHS, lengths_B = past
    S = k_BKSH.shape[2]
    s_past = jnp.einsum("btkgh,bksh->bkgts", q.astype(k_BKSH.dtype), k_BKSH,
                        preferred_element_type=jnp.float32) * scale
    visible_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    s_past = jnp.where(visible_BS[:, None, None, None, :], s_past, neg)
    probs = jax.nn.softmax(jnp.concatenate([s_past, s_new], axis=-1), axis=-1)
    p_past, p_new = probs[..., :S], probs[..., S:]
    out = jnp.einsum("bkgts,bkhs->btkgh", p_past.astype(v_BKHS.dtype), v_BKHS,
                     preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgts,bskh->btkgh", p_new.astype(v_new_BTKH.dtype), v_new_BTKH,
                           preferred_element_type=jnp.float32)
    return out.reshape(B, T, N * H).astype(q_BTNH.dtype)


def _linear(x, w, b=None):
    y = jnp.einsum("...d,df->...f", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _layer(config: ModelConfig, p: dict, h_BTD, cos, sin, past):
    """One decoder layer. ``past`` = (k_BKSH, v_BKHS, lengths_B) of this layer, or None.

    Returns the new hidden states and this call's (k, v) [B, T, K, H] in the cache dtype.
    """
    c = config
    B, T, _ = h_BTD.shape
    kv_dtype = c.jnp_dtype
    x = rms_norm(h_BTD, p["attn_norm"], c.rms_eps)
    if "wqkv" in p:
        qkv = _linear(x, p["wqkv"], p.get("bqkv"))
        q, k, v = qkv[..., :c.q_size], qkv[..., c.q_size:c.q_size + c.kv_size], qkv[..., c.q_size + c.kv_size:]
    else:
        q, k, v = (_linear(x, p["w" + n], p.get("b" + n)) for n in "qkv")
    q = q.reshape(B, T, c.num_heads, c.head_dim)
    k = k.reshape(B, T, c.num_kv_heads, c.head_dim)
    v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin).astype(kv_dtype)
    v = v.astype(kv_dtype)
    attn = attention(q, k, v, past)
    h_BTD = h_BTD + _linear(attn, p["wo"])
    x = rms_norm(h_BTD, p["mlp_norm"], c.rms_eps)
    if "w_gate_up" in p:
        gate_up = _linear(x, p["w_gate_up"])
        gate, up = gate_up[..., :c.ffn_size], gate_up[..., c.ffn_size:]
    else:
        gate, up = _linear(x, p["w_gate"]), _linear(x, p["w_up"])
    h_BTD = h_BTD + _linear(jax.nn.silu(gate) * up, p["w_down"])
    return h_BTD, (k, v)


def as_pure_params(params: PyTree) -> dict:
    """Accept the pure dict or an `nnx.State` (as returned by `nnx.split`)."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return params


# ---------------------------------------------------------------------------------------
# The model object (protocol implementation).
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Llama:
    """The decoder as a protocol model: frozen and hashable (a static `jax.jit` argument).

    ``apply`` jitted with the cache donated (``jax.jit(model.apply, donate_argnums=(2,))``)
    updates the cache in place. ``scan_layers=True``: `lax.scan` over stacked layers and a
    stacked cache; compiles in about a second, but on XLA CPU every step slices each layer's
    weights out of the stacked arrays inside the matmul fusion, which runs ~3x slower at
    batch 1. ``scan_layers=False``: an unrolled loop over per-layer params and a per-layer
    cache (`init_cache` picks the layout); slower to compile, the fast path on CPU.
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

    def init_params(self, key) -> dict:
        """Random parameters (normal(0.02) weights, unit norms) as a pure nested dict."""
        module = self.module(key)
        return as_pure_params(nnx.split(module)[1])

    def module(self, key) -> LlamaModule:
        return LlamaModule(self.config, rngs=nnx.Rngs(params=key))

    def apply(self, params, tokens_BT, cache, num_valid_B=None):
        h, cache = self.hidden_states(params, tokens_BT, cache, num_valid_B)
        return self.logits_from_hidden(params, h), cache

    # -- pieces ---------------------------------------------------------------------------
    def hidden_states(self, params, tokens_BT, cache, num_valid_B=None):
        """Final hidden states [B, T, D] (after the final RMSNorm) and the updated cache."""
        c = self.config
        p = as_pure_params(params)
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens_BT must be [batch, time], got shape {tokens_BT.shape}")
        B, T = tokens_BT.shape
        h = jnp.take(p["embed"], tokens_BT, axis=0).astype(c.jnp_dtype)
        t_T = jnp.arange(T, dtype=jnp.int32)
        if cache is None:
            positions = jnp.broadcast_to(t_T[None, :], (B, T))
            lengths = None
        else:
            if cache.num_layers != c.num_layers:
                raise ValueError(f"cache has {cache.num_layers} layers, the model {c.num_layers}")
            if cache.batch_size != B:
                raise ValueError(f"cache batch {cache.batch_size} != tokens batch {B}")
            lengths = cache.lengths_B.astype(jnp.int32)
            positions = lengths[:, None] + t_T[None, :]
        cos, sin = rope_cos_sin(c, positions)
        layers = p["layers"]

        def run_layer(lp, h, k_BKSH, v_BKHS):
            past = None if cache is None else (k_BKSH, v_BKHS, lengths)
            return _layer(c, lp, h, cos, sin, past)

        if isinstance(layers, (list, tuple)):
            if len(layers) != c.num_layers:
                raise ValueError(f"params hold {len(layers)} layers, the config {c.num_layers}")
            if c.scan_layers:
                layers = stack_layers(layers)
        per_layer_cache = cache is not None and cache.per_layer
        if c.scan_layers:
            def body(h, xs):
                lp, k_BKSH, v_BKHS = xs
                h, new_kv = run_layer(lp, h, k_BKSH, v_BKHS)
                return h, new_kv

            stacked = None if cache is None else cache.stacked()
            xs = (layers, None, None) if cache is None else (layers, stacked.k, stacked.v)
            h, (k_new, v_new) = jax.lax.scan(body, h, xs)      # [L, B, T, K, H]
            if cache is not None:
                k_buf, v_buf = write_kv(stacked.k, stacked.v, k_new, v_new, lengths)
                if per_layer_cache:    # (a per-layer cache given to a scan model: kept per layer)
                    k_buf = tuple(k_buf[i] for i in range(c.num_layers))
                    v_buf = tuple(v_buf[i] for i in range(c.num_layers))
        else:
            ks, vs = [], []
            for i in range(c.num_layers):
                # Per-layer dicts (see `unstack_layers`) are much faster here than slicing
                # stacked arrays inside the jit: XLA CPU fuses a slice into its consumer dot
                # and then loses the fast matmul path.
                lp = layers[i] if isinstance(layers, (list, tuple)) else \
                    jax.tree.map(lambda x: x[i], layers)
                if cache is None:
                    h, _ = run_layer(lp, h, None, None)
                    continue
                k_i, v_i = cache.layer(i)
                h, (k, v) = run_layer(lp, h, k_i, v_i)
                if per_layer_cache:
                    # Each layer writes its own buffer after reading it: in place when donated.
                    k_i, v_i = write_kv(k_i, v_i, k, v, lengths)
                    ks.append(k_i)
                    vs.append(v_i)
                else:
                    ks.append(k)
                    vs.append(v)
            if cache is not None:
                if per_layer_cache:
                    k_buf, v_buf = tuple(ks), tuple(vs)
                else:
                    # A stacked cache in the unrolled loop: XLA CPU schedules the static slices
                    # early and copies the donated buffer before this write (use per-layer).
                    k_buf, v_buf = write_kv(cache.k, cache.v, jnp.stack(ks), jnp.stack(vs), lengths)

        h = rms_norm(h, p["final_norm"], c.rms_eps)
        if cache is not None:
            n = T if num_valid_B is None else num_valid_B
            n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
            cache = cache.replace(k=k_buf, v=v_buf, lengths_B=lengths + n)
        return h, cache

    def logits_from_hidden(self, params, h_BTD):
        """The LM head: float32 logits [B, T, V] from final hidden states."""
        p = as_pure_params(params)
        if self.config.tie_embeddings:
            return jnp.einsum("btd,vd->btv", h_BTD, p["embed"].astype(h_BTD.dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h_BTD, p["lm_head"].astype(h_BTD.dtype),
                          preferred_element_type=jnp.float32)

    # -- conveniences ---------------------------------------------------------------------
    def prepare_params(self, params) -> dict:
        """The fastest parameter form for this config (call once, outside the jitted step).

        Canonical params stack every layer tensor along a leading layer axis. With
        ``scan_layers=False`` this returns per-layer dicts (``params['layers']`` a tuple), which
        the unrolled loop reads without slicing; with ``scan_layers=True`` it returns the
        stacked form. With ``fuse_projections`` the projections are fused (see the module
        docstring), else unfused. `apply` accepts every form in both modes.
        """
        p = dict(as_pure_params(params))
        c = self.config
        layers = p["layers"]
        per_layer = isinstance(layers, (list, tuple))
        if c.scan_layers and per_layer:
            layers = stack_layers(layers)
        elif not c.scan_layers and not per_layer:
            layers = unstack_layers({"layers": layers})["layers"]
        convert = fuse_layer if c.fuse_projections else functools.partial(unfuse_layer, config=c)
        p["layers"] = convert(layers) if c.scan_layers else tuple(convert(lp) for lp in layers)
        return p

    def cast_params(self, params, dtype: str | None = None) -> dict:
        dt = jnp.dtype(dtype or self.config.dtype)
        return jax.tree.map(lambda x: jnp.asarray(x, dt), as_pure_params(params))

    def param_logical_axes(self) -> dict:
        return param_logical_axes(self.config)

    def with_config(self, **changes) -> "Llama":
        return Llama(self.config.replace(**changes))


_FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_layer(lp: dict) -> dict:
    """One layer's (or the stacked layers') dict with fused projections (no-op if fused)."""
    out = dict(lp)
    for fused, parts in _FUSED.items():
        if all(n in out for n in parts):
            out[fused] = jnp.concatenate([out.pop(n) for n in parts], axis=-1)
    return out


def unfuse_layer(lp: dict, config: ModelConfig) -> dict:
    """The inverse of `fuse_layer` (no-op if unfused)."""
    c = config
    sizes = {"wqkv": (c.q_size, c.kv_size, c.kv_size), "bqkv": (c.q_size, c.kv_size, c.kv_size),
             "w_gate_up": (c.ffn_size, c.ffn_size)}
    out = dict(lp)
    for fused, parts in _FUSED.items():
        if fused in out:
            arr = out.pop(fused)
            splits = np.cumsum(sizes[fused])[:-1].tolist()
            out.update(zip(parts, jnp.split(arr, splits, axis=-1)))
    return out


def canonical_params(params, config: ModelConfig) -> dict:
    """Stacked layers, unfused projections: the form of `param_specs` (export, storage)."""
    p = dict(as_pure_params(params))
    p["layers"] = unfuse_layer(stack_layers(p["layers"]), config)
    return p


def stack_layers(layers):
    """Per-layer dicts (a list/tuple) -> one dict of arrays with a leading layer axis."""
    if not isinstance(layers, (list, tuple)):
        return layers
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(params) -> dict:
    """Params with ``params['layers']`` as a tuple of per-layer dicts (for unrolled apply)."""
    p = dict(as_pure_params(params))
    layers = p["layers"]
    if isinstance(layers, (list, tuple)):
        return p
    n = jax.tree.leaves(layers)[0].shape[0]
    p["layers"] = tuple(jax.tree.map(lambda x: x[i], layers) for i in range(n))
    return p


def truncate_layers(params, config: ModelConfig, k: int):
    """The first k layers with the same embeddings, final norm and head (early-exit draft).

    Slicing only (stacked params: a slice of every layer array; per-layer params: the first
    k entries). Returns (params, config with num_layers=k).
    """
    if not 1 <= k <= config.num_layers:
        raise ValueError(f"k must be in [1, {config.num_layers}], got {k}")
    p = dict(as_pure_params(params))
    if isinstance(p["layers"], (list, tuple)):
        p["layers"] = tuple(p["layers"][:k])
    else:
        p["layers"] = jax.tree.map(lambda x: x[:k], p["layers"])
    return p, config.replace(num_layers=k)


def pad_prompts(token_lists, pad_id: int = 0, multiple: int = 1):
    """Right-pad token lists into (tokens_BT int32, lengths_B int32) numpy arrays."""
    lengths = np.asarray([len(t) for t in token_lists], np.int32)
    T = int(lengths.max(initial=1))
    T = max(1, -(-T // multiple) * multiple)
    out = np.full((len(token_lists), T), pad_id, np.int32)
    for i, t in enumerate(token_lists):
        out[i, :len(t)] = np.asarray(t, np.int32)
    return out, lengths


def prefill(model: Llama, params, token_lists, capacity: int, pad_id: int = 0, apply_fn=None):
    """Ragged prefill of a batch of prompts into a fresh cache.

    Returns (logits_BTV, cache, lengths_B); the next-token logits of row b are at
    ``logits[b, lengths_B[b] - 1]``. Raises `CacheCapacityError` for a prompt longer than the
    cache (checked on the host; XLA would silently clamp the writes).
    """
    tokens, lengths = pad_prompts(token_lists, pad_id)
    longest = int(lengths.max(initial=0))
    if longest > capacity or tokens.shape[1] > capacity:
        raise CacheCapacityError(
            f"prompt of {longest} tokens does not fit a cache of capacity {capacity}")
    cache = model.init_cache(len(token_lists), capacity)
    fn = apply_fn or jax.jit(model.apply)
    logits, cache = fn(params, jnp.asarray(tokens), cache, jnp.asarray(lengths))
    return logits, cache, lengths


# ---------------------------------------------------------------------------------------
# One entry point for every checkpoint kind.
# ---------------------------------------------------------------------------------------
def load(name_or_path: str = "smollm2-135m-instruct", dtype: str = "float32",
         scan_layers: bool = True, fuse_projections: bool = False):
    """(model, params) from a known name, a GGUF file, or a Hugging Face checkpoint dir.

    Known names go through `specjax.models.registry.resolve` (fetched and sha256-checked).
    Params come in the fastest form for the config (``model.prepare_params``): layers
    stacked along a leading axis for ``scan_layers=True``, a tuple of per-layer dicts for
    ``scan_layers=False``; with ``fuse_projections`` the projections fused (see the module
    docstring). `truncate_layers`, `export_hf` and `specjax.sharding` take every form.
    """
    model, params = _load(name_or_path, dtype, scan_layers)
    if fuse_projections:
        model = model.with_config(fuse_projections=True)
        if isinstance(params["layers"], (list, tuple)):
            # Layer by layer, each unfused layer released as soon as it is fused (no second copy).
            layers = list(params.pop("layers"))
            for i in range(len(layers)):
                layers[i] = fuse_layer(layers[i])
            params["layers"] = tuple(layers)
        else:
            params = model.prepare_params(params)
    return model, params


def _load(name_or_path, dtype, scan_layers):
    import pathlib

    from specjax.models import registry
    from specjax.models.config import CheckpointError
    from specjax.models.gguf_loader import load_gguf
    from specjax.models.hf_loader import load_hf

    path = registry.resolve(str(name_or_path))
    path = pathlib.Path(path)
    if path.is_dir():
        return load_hf(path, dtype=dtype, scan_layers=scan_layers)
    if path.suffix == ".safetensors" or path.name == "config.json":
        return load_hf(path.parent, dtype=dtype, scan_layers=scan_layers)
    with open(path, "rb") as f:
        magic = f.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
        return load_gguf(path, dtype=dtype, scan_layers=scan_layers)
    raise CheckpointError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")


load_model = load
