"""Llama (1/2/3.x, SmolLM2): the decoder's defaults. Its GGUF files (``general.architecture``
``llama``) are also what llama.cpp's converter writes for Mistral (no sliding window: llama.cpp
has none for ``llama``), which therefore reads as Llama; a ``llama`` file with experts
(``llama.expert_count`` > 0) is Mixtral's (`specjax.models.families._moe`)."""

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
                            features=frozenset({"attention_bias"}),
                            gguf_match=lambda meta: not meta.get("expert_count")))
