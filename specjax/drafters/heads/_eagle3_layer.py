"""The published EAGLE-3 draft layer (Li et al. 2025) as pure functions: its parameters, one
forward, the cached call under specjax's slot convention, and the masks of training-time test.

What the published head computes, read from the reference implementation
(github SafeAILab/EAGLE, eagle/model/cnets.py: `Model` and its `LlamaDecoderLayeremb`); SpecForge
writes the same module (github sgl-project/SpecForge, specforge/modeling/draft/llama3_eagle.py:
`LlamaForCausalLMEagle3`) and vLLM's speculators library the same layer with all its optional
norms off (github vllm-project/speculators, src/speculators/models/eagle3):

* ``g = fc([f_low ; f_mid ; f_high])``: one bias-free linear map (3 D_t -> D) of the three
  target features, concatenated in layer order;
* one decoder layer ("midlayer"). Its attention reads the token's embedding and ``g`` side by
  side, each through its own RMS norm, the embedding first:
  ``x = [rms(e) * w_input_layernorm ; rms(g) * w_hidden_norm]`` (2D wide, so q_proj, k_proj and
  v_proj take 2D inputs), RoPE, causal attention, ``o_proj``; the residual adds the un-normed
  ``g``; then ``post_attention_layernorm`` and a SwiGLU MLP with its residual. No biases;
* the logits: ``lm_head(rms(h) * w_norm)`` over the draft vocabulary (the head's own
  ``draft_vocab_size`` rows; row i is target token ``i + d2t[i]``);
* the next drafting step feeds ``h`` itself (before the final norm) in place of ``g``.

Slots and positions. Specjax's heads keep the entry of token ``x_s`` (read with the feature
of position s - 1) at cache slot s. The reference has no entry for ``x_0``: its entry i is
``(x_{i+1}, f_i)`` at RoPE position i (cnets.py drops the first input id, and its drafting
steps continue at position ``len(input_ids) - 1``). Here slot s sits at RoPE position s - 1 and
no query but its own sees slot 0, so every other entry computes exactly the reference's. Slot 0
attends to itself alone (its feature is zero); only a one-token prompt drafts from it, where
the reference has no entry to draft from at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import ModelConfig
from specjax.models import llama as llama_lib
from specjax.models.attention import AttentionSpec, attention, tree_attention_mask
from specjax.models.kv_cache import KVCache, write_kv

NORMS = ("embed_norm", "hidden_norm", "mlp_norm")       # input_layernorm, hidden_norm, post_attention_layernorm
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def default_layer(target: ModelConfig) -> ModelConfig:
    """The head layer's dimensions when none are given: the target's (one Llama layer; no
    family features: the published layer is Llama's whatever the target's family)."""
    t = target
    return ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads,
                       num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, ffn_size=t.ffn_size,
                       rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, rms_eps=t.rms_eps, dtype=t.dtype,
                       max_position=t.max_position)


LAYER_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "rope_theta", "rms_eps",
                "max_position")


def layer_to_dict(lc: ModelConfig) -> dict:
    """The layer's dimensions as JSON (a head.json's ``layer``)."""
    d = {k: getattr(lc, k) for k in LAYER_FIELDS}
    d["rope_scaling"] = lc.rope_scaling_dict
    return d


def layer_from_dict(d: dict, target: ModelConfig) -> ModelConfig:
    """`layer_to_dict`'s inverse, for the given target (its vocabulary and dtype)."""
    return ModelConfig(vocab_size=target.vocab_size, num_layers=1, dtype=target.dtype,
                       rope_scaling=d.get("rope_scaling"), **{k: d[k] for k in LAYER_FIELDS})


def layer_shapes(lc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the layer's parameters ([in, out] matrices: x @ w)."""
    D, F = lc.hidden_size, lc.ffn_size
    shapes = {"wq": (2 * D, lc.q_size), "wk": (2 * D, lc.kv_size), "wv": (2 * D, lc.kv_size), "wo": (lc.q_size, D),
              "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    shapes.update({n: (D,) for n in NORMS})
    return shapes


def init_layer(lc: ModelConfig, key) -> dict:
    """Random layer parameters: normal(0.02) matrices (drawn in float32), unit norms."""
    shapes = layer_shapes(lc)
    keys = jax.random.split(key, len(MATRICES))
    p = {n: (llama_lib.INIT_STD * jax.random.normal(k, shapes[n], jnp.float32)).astype(lc.jnp_dtype)
         for n, k in zip(MATRICES, keys)}
    p.update({n: jnp.ones(shapes[n], lc.jnp_dtype) for n in NORMS})
    return p


def _dense(x, w):
    return jnp.einsum("...d,df->...f", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def layer(lc: ModelConfig, p: dict, e_BTD, g_BTD, cos, sin, past, visibility):
    """One published EAGLE-3 layer (module doc) on embeddings ``e`` and fused features ``g``.
    ``past`` = (k_BKSH, v_BKHS, lengths_B or None) or None, ``visibility`` as in
    `specjax.models.attention` (None: plain causal). Returns the layer's output [B, T, D] (what
    the next step reads as its feature, and the final norm and LM head score) and this call's
    (k, v) [B, T, K, H] in the cache dtype."""
    B, T, _ = g_BTD.shape
    dt = g_BTD.dtype
    eps = lc.rms_eps
    x = jnp.concatenate([llama_lib.rms_norm(e_BTD.astype(dt), p["embed_norm"], eps).astype(dt),
                         llama_lib.rms_norm(g_BTD, p["hidden_norm"], eps).astype(dt)], axis=-1)
    q = _dense(x, p["wq"]).reshape(B, T, lc.num_heads, lc.head_dim)
    k = _dense(x, p["wk"]).reshape(B, T, lc.num_kv_heads, lc.head_dim)
    v = _dense(x, p["wv"]).reshape(B, T, lc.num_kv_heads, lc.head_dim)
    q = llama_lib.apply_rope(q, cos, sin)
    k = llama_lib.apply_rope(k, cos, sin).astype(lc.jnp_dtype)
    v = v.astype(lc.jnp_dtype)
    spec = AttentionSpec(scale=lc.attention_scale, causal_chunk=lc.causal_chunk)
    attn = attention(q, k, v, past, visibility, spec=spec, op=lc.attention_op)
    h = g_BTD + _dense(attn, p["wo"])
    y = llama_lib.rms_norm(h, p["mlp_norm"], eps).astype(dt)
    h = h + _dense(jax.nn.silu(_dense(y, p["w_gate"])) * _dense(y, p["w_up"]), p["w_down"])
    return h, (k, v)


def init_cache(lc: ModelConfig, batch_size: int, capacity: int) -> KVCache:
    """The layer's cache: one layer, per-layer layout (read and written in place)."""
    return KVCache.zeros(1, batch_size, lc.num_kv_heads, capacity, lc.head_dim, lc.jnp_dtype, per_layer=True)


def cached_layer(lc: ModelConfig, p: dict, e_BTD, g_BTD, kv: KVCache, num_valid_B=None, tree=None):
    """The layer over its cache: (output [B, T, D], cache). Without ``tree``: the block's token
    t at slot ``kv.lengths_B + t`` and RoPE position one less, causal, slot 0 visible to itself
    only (module doc), lengths advanced by ``num_valid_B`` (default T). With a `TreeBlock`:
    the tree's visibility minus slot 0, positions ``lengths_B + rel_positions - 1``, entries at
    ``lengths_B + offset + t``, lengths unchanged (tentative entries, as `Llama.trunk`)."""
    B, T, _ = g_BTD.shape
    lengths = kv.lengths_B.astype(jnp.int32)
    k_buf, v_buf = kv.k[0], kv.v[0]
    S = kv.capacity
    t_T = jnp.arange(T, dtype=jnp.int32)
    if tree is None:
        slots_BT = lengths[:, None] + t_T[None, :]
        limit = S if kv.attend_limit is None else kv.attend_limit       # a prefill chunk's bound
        s_S = jnp.arange(limit, dtype=jnp.int32)
        past_B1S = ((s_S[None, :] < lengths[:, None]) & (s_S[None, :] >= 1))[:, None, :]
        causal_TT = t_T[None, :] <= t_T[:, None]
        new_BTT = causal_TT[None] & ((slots_BT[:, None, :] >= 1) | jnp.eye(T, dtype=bool)[None])
        visibility = (past_B1S, new_BTT)
        past = None if limit == 0 else (k_buf[:, :, :limit], v_buf[..., :limit], lengths)
        positions_BT = slots_BT - 1
        write_at = lengths
    else:
        if num_valid_B is not None:
            raise ValueError("tree= and num_valid_B cannot be combined: a tree call never advances the length")
        if kv.attend_limit is not None:
            raise ValueError("a cache with an attend limit (a prefill chunk) cannot take a tree block")
        past_BXS, new_BTT = tree_attention_mask(tree, lengths, S)
        visibility = (past_BXS & (jnp.arange(S) >= 1)[None, None, :], new_BTT)
        past = (k_buf, v_buf, lengths)
        positions_BT = lengths[:, None] + jnp.asarray(tree.rel_positions_BT, jnp.int32) - 1
        write_at = lengths + tree.offset
    cos, sin = llama_lib.rope_cos_sin(lc, positions_BT)
    h_BTD, (k, v) = layer(lc, p, e_BTD, g_BTD, cos, sin, past, visibility)
    k_buf, v_buf = write_kv(k_buf, v_buf, k, v, write_at)
    if tree is None:
        n = T if num_valid_B is None else num_valid_B
        lengths = lengths + jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    return h_BTD, kv.replace(k=(k_buf,), v=(v_buf,), lengths_B=lengths)


def first_step_visibility(T: int):
    """Training-time test, step 1 over a whole sequence (cache-free): causal, and slot 0 seen by
    itself only ((None, [1, T, T]))."""
    t_T = jnp.arange(T)
    return None, ((t_T[None, :] <= t_T[:, None]) & ((t_T[None, :] >= 1) | jnp.eye(T, dtype=bool)))[None]
