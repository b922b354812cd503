"""Mixture-of-experts families: Mixtral (Mistral's attention, 8 experts of which 2 per token,
weights renormalized) and Qwen3-MoE (Qwen3's attention, ``norm_topk_prob`` deciding the
renormalization). Every layer is sparse; a Qwen3-MoE checkpoint with dense layers
(``mlp_only_layers``, ``decoder_sparse_step`` > 1) is refused by name. (transformers 5 writes
Qwen3-MoE's expert count as ``num_local_experts``, earlier files as ``num_experts``.)

GGUF, as llama.cpp writes and runs it (convert_hf_to_gguf.py's LlamaModel / Qwen2MoeModel;
src/llama-model.cpp, src/models/llama.cpp / qwen3moe.cpp): Mixtral is ``general.architecture``
``llama`` with ``llama.expert_count`` / ``llama.expert_used_count`` (its Q/K rows permuted like
any ``llama`` file), Qwen3-MoE is ``qwen3moe`` with ``qwen3moe.expert_feed_forward_length`` (the
experts' width; llama.cpp falls back to feed_forward_length / expert_used_count). Both store each
layer's experts merged (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, the
experts' matrices stacked) and the router as ``blk.N.ffn_gate_inp``. llama.cpp renormalizes the
top-k weights of both architectures unconditionally (build_moe_ffn's norm_w = true; its
converter writes no ``expert_weights_norm`` for them, so a Qwen3-MoE checkpoint with
norm_topk_prob=false runs renormalized there): specjax does the same unless a file states
``{arch}.expert_weights_norm``, which it then follows. Softmax routing only: another
``expert_gating_func``, an ``expert_weights_scale`` other than 1, shared experts or leading
dense layers are refused by name."""

from specjax.models import families as f
from specjax.models.config import ConfigValueError, UnsupportedArchitectureError

_MIXTRAL_NAMES = {"router": "model.layers.{i}.block_sparse_moe.gate.weight",
                  "we_gate": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
                  "we_up": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
                  "we_down": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"}


def _experts(key: str, n) -> int:
    """An expert count read from ``key``: >= 1 (every layer of these families is its experts;
    0 would leave a layer no MLP, and the checkpoint no dense one to read instead)."""
    n = int(n)
    if n < 1:
        raise ConfigValueError(key, n, "a mixture-of-experts model needs at least 1 expert")
    return n


def _read_mixtral(cfg):
    f.no_bias(cfg)
    return {"mlp_activation": f.activation(cfg), "num_experts": _experts("num_local_experts", cfg["num_local_experts"]),
            "experts_per_token": int(cfg["num_experts_per_tok"]), "normalize_topk": True,
            **f.windows(cfg, int(cfg["num_hidden_layers"]), use_layer_types=False)}    # every layer, as transformers


def _write_mixtral(config):
    if not config.normalize_topk:
        raise UnsupportedArchitectureError("Mixtral always renormalizes its top-k expert weights")
    f.same_window_everywhere(config, "Mixtral")
    return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.experts_per_token,
            "sliding_window": config.sliding_window or None, "router_jitter_noise": 0.0}


def _read_qwen3_moe(cfg):
    f.no_bias(cfg)
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedArchitectureError(
            "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedArchitectureError("Qwen3-MoE sliding-window attention is not supported")
    return {"qk_norm": True, "mlp_activation": f.activation(cfg), "ffn_size": int(cfg["moe_intermediate_size"]),
            "num_experts": (_experts("num_experts", cfg["num_experts"]) if cfg.get("num_experts") is not None
                            else _experts("num_local_experts", cfg["num_local_experts"])),
            "experts_per_token": int(cfg["num_experts_per_tok"]),
            "normalize_topk": bool(cfg.get("norm_topk_prob", False))}


def _write_qwen3_moe(config):
    return {"moe_intermediate_size": config.ffn_size, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.experts_per_token, "norm_topk_prob": config.normalize_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
            "use_sliding_window": False}


# ---- GGUF -----------------------------------------------------------------------------------
def _gguf_experts(meta):
    """num_experts, experts_per_token, normalize_topk from GGUF metadata (see the module docstring)."""
    gating = meta.get("expert_gating_func")
    if gating not in (None, 0, 1):                  # llama.cpp: 1 softmax, 2 sigmoid, 3 softmax of weights
        raise UnsupportedArchitectureError(
            f"{meta.arch}.expert_gating_func={gating} is not supported (specjax routes by a softmax)")
    scale = meta.get("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedArchitectureError(f"{meta.arch}.expert_weights_scale={scale} is not supported")
    for key in ("expert_shared_count", "expert_shared_feed_forward_length", "leading_dense_block_count"):
        if meta.get(key):
            raise UnsupportedArchitectureError(f"{meta.arch}.{key}={meta.get(key)} is not supported "
                                               f"(every layer's MLP is its routed experts only)")
    if meta.has_tensor("blk.0.ffn_gate.0.weight") and not meta.has_tensor("blk.0.ffn_gate_exps.weight"):
        raise UnsupportedArchitectureError(
            f"GGUF file {meta.path} stores one tensor per expert (blk.N.ffn_gate.J.weight, an early llama.cpp "
            f"layout); specjax reads the merged blk.N.ffn_gate_exps.weight: convert the model again")
    norm = meta.get("expert_weights_norm")
    n = _experts("expert_count", meta.require("expert_count"))
    k = int(meta.require("expert_used_count"))
    if not 1 <= k <= n:              # (checked here: Qwen3-MoE's default width divides by it)
        raise ConfigValueError("expert_used_count", k, f"must be in [1, expert_count={n}]")
    return {"num_experts": n, "experts_per_token": k,
            "normalize_topk": True if norm is None else bool(norm)}


def _gguf_mixtral(meta, common):
    return _gguf_experts(meta)          # llama.cpp sizes a `llama` file's experts by feed_forward_length


def _gguf_qwen3_moe(meta, common):
    out = {"qk_norm": True, **_gguf_experts(meta)}
    width = meta.get("expert_feed_forward_length")
    out["ffn_size"] = int(width) if width else common["ffn_size"] // out["experts_per_token"]
    return out


MIXTRAL = f.register(f.Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), _read_mixtral, _write_mixtral,
                              hf_names=_MIXTRAL_NAMES, gguf_arch="llama", read_gguf=_gguf_mixtral,
                              gguf_match=lambda meta: bool(meta.get("expert_count")),
                              features=frozenset({"experts", "sliding_window"})))
QWEN3_MOE = f.register(f.Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _read_qwen3_moe,
                                _write_qwen3_moe, gguf_arch="qwen3moe", read_gguf=_gguf_qwen3_moe,
                                features=frozenset({"experts", "qk_norm"})))
