"""Llama (1/2/3.x, SmolLM2): the decoder's defaults."""

from specjax.models import families as f
from specjax.models.config import UnsupportedArchitectureError


def _read(cfg):
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias=True is not supported")
    # (LlamaAttention has no sliding window: a stray sliding_window key is ignored, as transformers does)
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "mlp_activation": f.activation(cfg)}


def _write(config):
    if config.sliding_window:
        raise UnsupportedArchitectureError("LlamaForCausalLM has no sliding-window attention; export as 'mistral'")
    return {"attention_bias": bool(config.attention_bias), "mlp_bias": False}


LLAMA = f.register(f.Family("llama", ("LlamaForCausalLM",), ("llama",), _read, _write, gguf_arch="llama",
                            features=frozenset({"attention_bias"})))
