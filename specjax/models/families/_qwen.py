"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm, no biases); both may window some layers
(``use_sliding_window``, ``layer_types``)."""

from specjax.models import families as f
from specjax.models.config import UnsupportedArchitectureError


def _windows(cfg):
    if not cfg.get("use_sliding_window"):
        return {"sliding_window": 0, "window_layers": None}
    L = int(cfg["num_hidden_layers"])
    first = int(cfg.get("max_window_layers", L))
    return f.windows(cfg, L, pattern=lambda i: i >= first)


def _write_windows(config):
    if not config.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    return {"use_sliding_window": True, "sliding_window": config.sliding_window,
            "layer_types": f.layer_types(config), "max_window_layers": config.num_layers}


def _read_qwen2(cfg):
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias=True is not supported")
    return {"attention_bias": True, "mlp_activation": f.activation(cfg), **_windows(cfg)}


def _write_qwen2(config):
    if not config.attention_bias:
        raise UnsupportedArchitectureError("Qwen2ForCausalLM always has q/k/v biases; export this model with arch='llama'")
    return _write_windows(config)


def _read_qwen3(cfg):
    f.no_bias(cfg)
    return {"qk_norm": True, "mlp_activation": f.activation(cfg), **_windows(cfg)}


def _write_qwen3(config):
    return {"attention_bias": False, **_write_windows(config)}


QWEN2 = f.register(f.Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _read_qwen2, _write_qwen2, gguf_arch="qwen2",
                            features=frozenset({"attention_bias", "sliding_window"})))
QWEN3 = f.register(f.Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _read_qwen3, _write_qwen3, gguf_arch="qwen3",
                            read_gguf=lambda meta, common: {"qk_norm": True},
                            features=frozenset({"qk_norm", "sliding_window"})))
