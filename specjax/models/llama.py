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

`Llama(config)` is the frozen, hashable model object of `specjax.models._protocol`:
``apply(params, tokens_BT, cache, num_valid_B=None) -> (logits_BTV, cache)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models._protocol import CacheCapacityError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, write_kv

PyTree = Any

CACHE_LOGICAL_AXES = KVCache(
    k_LBKSH=("layers", "batch", "kv", "sequence", "head_dim"),
    v_LBKSH=("layers", "batch", "kv", "sequence", "head_dim"),
    lengths_B=("batch",),
)


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
    ``(k_BKSH, v_BKSH, lengths_B)``: the layer's cache *before* this call; slot s of row b
    is visible iff ``s < lengths_B[b]``. New token t' is visible to query t iff t' <= t.
    Query t therefore sees exactly positions < lengths_B[b] + t + 1. The cache is only
    read here (the new entries are written once, for all layers, after the layer loop),
    which keeps the cache update a single in-place write. Returns [B, T, N*H].
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
    k_BKSH, v_BKSH, lengths_B = past
    S = k_BKSH.shape[2]
    s_past = jnp.einsum("btkgh,bksh->bkgts", q.astype(k_BKSH.dtype), k_BKSH,
                        preferred_element_type=jnp.float32) * scale
    visible_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    s_past = jnp.where(visible_BS[:, None, None, None, :], s_past, neg)
    probs = jax.nn.softmax(jnp.concatenate([s_past, s_new], axis=-1), axis=-1)
    p_past, p_new = probs[..., :S], probs[..., S:]
    out = jnp.einsum("bkgts,bksh->btkgh", p_past.astype(v_BKSH.dtype), v_BKSH,
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
    """One decoder layer. ``past`` = (k_BKSH, v_BKSH, lengths_B) of this layer, or None.

    Returns the new hidden states and this call's (k, v) [B, T, K, H] in the cache dtype.
    """
    c = config
    B, T, _ = h_BTD.shape
    kv_dtype = c.jnp_dtype
    x = rms_norm(h_BTD, p["attn_norm"], c.rms_eps)
    q = _linear(x, p["wq"], p.get("bq")).reshape(B, T, c.num_heads, c.head_dim)
    k = _linear(x, p["wk"], p.get("bk")).reshape(B, T, c.num_kv_heads, c.head_dim)
    v = _linear(x, p["wv"], p.get("bv")).reshape(B, T, c.num_kv_heads, c.head_dim)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin).astype(kv_dtype)
    v = v.astype(kv_dtype)
    attn = attention(q, k, v, past)
    h_BTD = h_BTD + _linear(attn, p["wo"])
    x = rms_norm(h_BTD, p["mlp_norm"], c.rms_eps)
    gate = _linear(x, p["w_gate"])
    up = _linear(x, p["w_up"])
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
    updates the cache in place. ``scan_layers=True`` (lax.scan over stacked layers) compiles
    in about a second and, on XLA CPU, keeps the cache update copy-free; the unrolled loop
    compiles slower and currently makes XLA copy the cache once per step.
    """
    config: ModelConfig

    # -- protocol -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch_size, c.num_kv_heads, capacity, c.head_dim,
                             c.jnp_dtype)

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
            if cache.k_LBKSH.shape[0] != c.num_layers:
                raise ValueError(f"cache has {cache.k_LBKSH.shape[0]} layers, the model "
                                 f"{c.num_layers}")
            if cache.k_LBKSH.shape[1] != B:
                raise ValueError(f"cache batch {cache.k_LBKSH.shape[1]} != tokens batch {B}")
            lengths = cache.lengths_B.astype(jnp.int32)
            positions = lengths[:, None] + t_T[None, :]
        cos, sin = rope_cos_sin(c, positions)
        layers = p["layers"]

        def run_layer(lp, h, k_BKSH, v_BKSH):
            past = None if cache is None else (k_BKSH, v_BKSH, lengths)
            return _layer(c, lp, h, cos, sin, past)

        if isinstance(layers, (list, tuple)):
            if len(layers) != c.num_layers:
                raise ValueError(f"params hold {len(layers)} layers, the config {c.num_layers}")
            if c.scan_layers:
                layers = stack_layers(layers)
        if c.scan_layers:
            def body(h, xs):
                lp, k_BKSH, v_BKSH = xs
                h, new_kv = run_layer(lp, h, k_BKSH, v_BKSH)
                return h, new_kv

            if cache is None:
                xs = (layers, None, None)
            else:
                xs = (layers, cache.k_LBKSH, cache.v_LBKSH)
            h, (k_new, v_new) = jax.lax.scan(body, h, xs)      # [L, B, T, K, H]
            if cache is not None:
                k_buf = write_kv(cache.k_LBKSH, k_new, lengths)
                v_buf = write_kv(cache.v_LBKSH, v_new, lengths)
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
                else:
                    h, (k, v) = run_layer(lp, h, cache.k_LBKSH[i], cache.v_LBKSH[i])
                    ks.append(k)
                    vs.append(v)
            if cache is not None:
                # NB: XLA CPU currently schedules the 30 static cache slices early and then
                # copies the donated buffer before this write; the scan path does not.
                k_buf = write_kv(cache.k_LBKSH, jnp.stack(ks), lengths)
                v_buf = write_kv(cache.v_LBKSH, jnp.stack(vs), lengths)

        h = rms_norm(h, p["final_norm"], c.rms_eps)
        if cache is not None:
            n = T if num_valid_B is None else num_valid_B
            n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
            cache = cache.replace(k_LBKSH=k_buf, v_LBKSH=v_buf, lengths_B=lengths + n)
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
        stacked form. `apply` accepts both forms in both modes.
        """
        p = as_pure_params(params)
        if self.config.scan_layers:
            return {**p, "layers": stack_layers(p["layers"])} \
                if isinstance(p["layers"], (list, tuple)) else p
        return unstack_layers(p)

    def cast_params(self, params, dtype: str | None = None) -> dict:
        dt = jnp.dtype(dtype or self.config.dtype)
        return jax.tree.map(lambda x: jnp.asarray(x, dt), as_pure_params(params))

    def param_logical_axes(self) -> dict:
        return param_logical_axes(self.config)

    def with_config(self, **changes) -> "Llama":
        return Llama(self.config.replace(**changes))


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
         scan_layers: bool = True):
    """(model, params) from a known name, a GGUF file, or a Hugging Face checkpoint dir.

    Known names go through `specjax.models.registry.resolve` (fetched and sha256-checked).
    Params come in the fastest form for the config (``model.prepare_params``): layers
    stacked along a leading axis for ``scan_layers=True``, a tuple of per-layer dicts for
    ``scan_layers=False``. `truncate_layers`, `export_hf` and `specjax.sharding` take both.
    """
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
