"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(width), RMSNorms scaling by (1 + w),
norms before and after attention and MLP, GeGLU, scores scaled by query_pre_attn_scalar**-0.5,
alternating sliding-window and global layers. Gemma 2 soft-caps attention scores and logits;
Gemma 3 norms queries and keys and gives its windowed layers their own RoPE base."""

from specjax.models import families as f
from specjax.models.config import UnsupportedArchitectureError

# the sandwich norms' Hugging Face names (Llama's post_attention_layernorm is Gemma's pre-MLP norm)
_NAMES = {"mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
          "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
          "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight"}


def _common(cfg, softcaps: tuple):
    """The fields both Gemma generations share; ``softcaps``: the (attention, final) soft-caps
    transformers' config assumes when its keys are absent (an explicit null means none)."""
    f.no_bias(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("use_bidirectional_attention=true is not supported (a decoder only)")
    return {"norm_offset": 1.0, "sandwich_norms": True, "scale_embeddings": True,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "mlp_activation": f.activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "head_dim": int(cfg.get("head_dim") or 256),
            "attn_softcap": cfg.get("attn_logit_softcapping", softcaps[0]),
            "final_softcap": cfg.get("final_logit_softcapping", softcaps[1])}


def _number(x):
    return int(x) if float(x).is_integer() else float(x)      # transformers' config type-checks an int


def _write_common(config):
    if config.norm_offset != 1.0 or not config.sandwich_norms or not config.scale_embeddings:
        raise UnsupportedArchitectureError("a Gemma export needs norm_offset=1, sandwich_norms and scale_embeddings")
    return {"hidden_activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.mlp_activation, config.mlp_activation),
            "query_pre_attn_scalar": _number(config.query_pre_attn_scalar or config.head_dim),
            "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.final_softcap,
            "sliding_window": config.sliding_window or None, "layer_types": f.layer_types(config),
            "attention_bias": False}


def _read_gemma2(cfg):
    return {**_common(cfg, (50.0, 30.0)),
            **f.windows(cfg, int(cfg["num_hidden_layers"]), pattern=lambda i: (i + 1) % 2, default_window=4096)}


def _read_gemma3(cfg):
    L = int(cfg["num_hidden_layers"])
    every = int(cfg.get("sliding_window_pattern", 6))
    out = {**_common(cfg, (None, None)), "qk_norm": True,
           **f.windows(cfg, L, pattern=lambda i: (i + 1) % every, default_window=4096)}
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:      # transformers 5: one entry per layer type
        theta, scaling = f.rope_from_hf(rope.get("full_attention"), default_theta=1e6)
        local, local_scaling = f.rope_from_hf(rope.get("sliding_attention"), default_theta=1e4)
        if local_scaling:
            raise UnsupportedArchitectureError("RoPE scaling on Gemma 3's sliding layers is not supported")
    else:
        theta, scaling = f.rope_from_hf(rope or None, cfg, default_theta=1e6)
        local = float(cfg.get("rope_local_base_freq", 1e4))
    return {**out, "rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}


def _write_gemma3(config):
    out = _write_common(config)
    out["rope_parameters"] = {
        "full_attention": f.rope_to_hf(config.rope_theta, config.rope_scaling_dict),
        "sliding_attention": f.rope_to_hf(config.local_rope_theta or config.rope_theta, None)}
    return out


_FEATURES = frozenset({"norm_offset", "sandwich_norms", "gelu_tanh", "scale_embeddings", "query_pre_attn_scalar",
                       "attn_softcap", "final_softcap", "sliding_window"})
GEMMA2 = f.register(f.Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), _read_gemma2, _write_common,
                             hf_names=_NAMES, features=_FEATURES))
GEMMA3 = f.register(f.Family("gemma3_text", ("Gemma3ForCausalLM",), ("gemma3_text",), _read_gemma3, _write_gemma3,
                             hf_names=_NAMES, features=_FEATURES | {"qk_norm", "local_rope"}))
