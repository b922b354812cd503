"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(width), RMSNorms scaling by (1 + w),
norms before and after attention and MLP, GeGLU, scores scaled by query_pre_attn_scalar**-0.5,
alternating sliding-window and global layers. Gemma 2 soft-caps attention scores and logits;
Gemma 3 norms queries and keys and gives its windowed layers their own RoPE base.

GGUF (``general.architecture`` ``gemma2`` / ``gemma3``), as llama.cpp writes and runs it
(convert_hf_to_gguf.py's Gemma2Model / Gemma3Model; src/llama-model.cpp's hyperparameters for
LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3, src/models/gemma2*.cpp / gemma3*.cpp):

* the converter adds 1 to every ``*norm.weight`` (Gemma's RMSNorm scales by 1 + w), so a GGUF
  Gemma reads with ``norm_offset=0``; its norms still multiply in float32
  (`specjax.models.llama.norm`: Gemma-style ``sandwich_norms`` models always do), as
  transformers and llama.cpp compute them;
* the query scale is not stored: llama.cpp scales queries by 1/sqrt(n_embd / n_head) for the
  27B models, which it recognises by their layer count (46 for Gemma 2, 62 for Gemma 3), and by
  1/sqrt(head_dim) otherwise (gemma_pytorch's config; ``query_pre_attn_scalar`` is that divisor);
* windows: ``{arch}.attention.sliding_window`` (Gemma 2: 4096 when absent; Gemma 3: no window
  when absent or 0), every layer windowed but each n-th, n = 2 for Gemma 2 and 6 for Gemma 3
  (hard-coded in llama.cpp; ``{arch}.attention.sliding_window_pattern`` when a file has it);
* soft-capping: Gemma 2's ``attn_logit_softcapping`` / ``final_logit_softcapping`` (50 / 30,
  llama.cpp's defaults, when absent); Gemma 3 none on attention, on the logits only when
  ``final_logit_softcapping`` is stored;
* RoPE: ``rope.freq_base`` and linear ``rope.scaling`` are the global layers'; Gemma 3's windowed
  layers use base 10000 unscaled (hard-coded in llama.cpp; ``rope.freq_base_swa`` when stored);
* Gemma 2's output head is always the embedding (llama.cpp loads no ``output.weight`` and its
  converter drops ``lm_head.weight``); Gemma 3's is ``output.weight`` when present;
* Q/K rows are stored unpermuted (NEOX-style RoPE).
"""

from specjax.models import families as f
from specjax.models.config import ConfigValueError, UnsupportedArchitectureError

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
            "head_dim": 256 if cfg.get("head_dim") is None else int(cfg["head_dim"]),   # 0: refused by name
            "attn_softcap": cfg.get("attn_logit_softcapping", softcaps[0]),
            "final_softcap": cfg.get("final_logit_softcapping", softcaps[1])}


def _number(x):
    return int(x) if float(x).is_integer() else float(x)      # transformers' config type-checks an int


def _write_common(config):
    if config.norm_offset != 1.0 or not config.sandwich_norms or not config.scale_embeddings:
        raise UnsupportedArchitectureError(
            "a Gemma export needs norm_offset=1, sandwich_norms and scale_embeddings (a Gemma read from "
            "GGUF has norm_offset=0, the 1 folded into its norm weights)")
    return {"hidden_activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.mlp_activation, config.mlp_activation),
            "query_pre_attn_scalar": _number(config.query_pre_attn_scalar or config.head_dim),
            "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.final_softcap,
            "sliding_window": config.sliding_window or None, "layer_types": f.layer_types(config),
            "attention_bias": False}


# ---- GGUF -----------------------------------------------------------------------------------
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}      # llama.cpp's LLM_TYPE_27B for the two archs


def _gguf_common(meta, common):
    # llama.cpp: f_attention_scale = 27B ? 1/sqrt(n_embd / n_head) (integer division) : 1/sqrt(head_dim)
    if common["num_layers"] == _LAYERS_27B[meta.arch]:
        scalar = common["hidden_size"] // common["num_heads"]
    else:
        scalar = common["head_dim"]
    return {"norm_offset": 0.0, "sandwich_norms": True, "scale_embeddings": True, "mlp_activation": "gelu_tanh",
            "query_pre_attn_scalar": float(scalar)}


def _cap(value):
    return float(value) if value else None          # 0: none (a positive cap or None)


def _gguf_gemma2(meta, common):
    out = {**_gguf_common(meta, common), "tie_embeddings": True,
           "attn_softcap": _cap(meta.get("attn_logit_softcapping", 50.0)),
           "final_softcap": _cap(meta.get("final_logit_softcapping", 30.0)),
           **f.gguf_windows(meta, common["num_layers"], period=2, default_window=4096)}
    local = meta.get("rope.freq_base_swa")
    if local is not None:
        if common["rope_scaling"]:
            raise UnsupportedArchitectureError(
                "a Gemma 2 GGUF with rope.freq_base_swa and rope scaling (llama.cpp scales its windowed "
                "layers' RoPE too) is not supported")
        out["local_rope_theta"] = float(local)
    return out


def _gguf_gemma3(meta, common):
    return {**_gguf_common(meta, common), "qk_norm": True,
            "final_softcap": _cap(meta.get("final_logit_softcapping")),
            **f.gguf_windows(meta, common["num_layers"], period=6),
            "local_rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}


def _read_gemma2(cfg):
    return {**_common(cfg, (50.0, 30.0)),
            **f.windows(cfg, int(cfg["num_hidden_layers"]), pattern=lambda i: (i + 1) % 2, default_window=4096)}


def _read_gemma3(cfg):
    """Gemma 3's fields. Without ``layer_types`` the windows follow ``sliding_window_pattern``
    (every n-th layer global, n >= 1: 0 or less is refused by name, as transformers divides by
    it); with ``layer_types`` the pattern is not used (nor checked), as in transformers."""
    L = int(cfg["num_hidden_layers"])
    every = int(cfg.get("sliding_window_pattern", 6))
    if cfg.get("layer_types") is None and every < 1:
        raise ConfigValueError("sliding_window_pattern", every,
                               "must be >= 1 (every n-th layer attends globally; 1: every layer)")
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
                             hf_names=_NAMES, gguf_arch="gemma2", read_gguf=_gguf_gemma2, features=_FEATURES))
GEMMA3 = f.register(f.Family("gemma3_text", ("Gemma3ForCausalLM",), ("gemma3_text",), _read_gemma3, _write_gemma3,
                             hf_names=_NAMES, gguf_arch="gemma3", read_gguf=_gguf_gemma3,
                             features=_FEATURES | {"qk_norm", "local_rope"}))
