"""Mixture-of-experts families: Mixtral (Mistral's attention, 8 experts of which 2 per token,
weights renormalized) and Qwen3-MoE (Qwen3's attention, ``norm_topk_prob`` deciding the
renormalization). Every layer is sparse; a Qwen3-MoE checkpoint with dense layers
(``mlp_only_layers``, ``decoder_sparse_step`` > 1) is refused by name. (transformers 5 writes
Qwen3-MoE's expert count as ``num_local_experts``, earlier files as ``num_experts``.)"""

from specjax.models import families as f
from specjax.models.config import UnsupportedArchitectureError

_MIXTRAL_NAMES = {"router": "model.layers.{i}.block_sparse_moe.gate.weight",
                  "we_gate": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
                  "we_up": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
                  "we_down": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"}


def _read_mixtral(cfg):
    f.no_bias(cfg)
    return {"mlp_activation": f.activation(cfg), "num_experts": int(cfg["num_local_experts"]),
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
            "num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]), "experts_per_token": int(cfg["num_experts_per_tok"]),
            "normalize_topk": bool(cfg.get("norm_topk_prob", False))}


def _write_qwen3_moe(config):
    return {"moe_intermediate_size": config.ffn_size, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.experts_per_token, "norm_topk_prob": config.normalize_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
            "use_sliding_window": False}


MIXTRAL = f.register(f.Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), _read_mixtral, _write_mixtral,
                              hf_names=_MIXTRAL_NAMES, features=frozenset({"experts", "sliding_window"})))
QWEN3_MOE = f.register(f.Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _read_qwen3_moe,
                                _write_qwen3_moe, features=frozenset({"experts", "qk_norm"})))
