"""Models: the Llama-family decoder, its KV cache, checkpoint loaders and exporter."""

from specjax.models._protocol import CacheCapacityError, DecoderModel, check_capacity
from specjax.models.config import (CheckpointError, CorruptCheckpointError, MissingTensorError,
                                   ModelConfig, TensorShapeError, UnsupportedArchitectureError)
from specjax.models.export import export_hf, hf_config_dict
from specjax.models.gguf_loader import load_gguf
from specjax.models.hf_loader import load_hf
from specjax.models.kv_cache import KVCache
from specjax.models.llama import (Llama, LlamaModule, load, load_model,
                                  pad_prompts, param_logical_axes, param_shapes, prefill,
                                  stack_layers, truncate_layers, unstack_layers)
from specjax.models.registry import DEFAULT_MODEL, resolve
from specjax.models.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

__all__ = [
    "CacheCapacityError", "DecoderModel", "check_capacity",
    "CheckpointError", "CorruptCheckpointError", "MissingTensorError", "ModelConfig",
    "TensorShapeError", "UnsupportedArchitectureError",
    "KVCache", "export_hf", "hf_config_dict", "load_gguf", "load_hf",
    "Llama", "LlamaModule", "load", "load_model", "pad_prompts",
    "param_logical_axes", "param_shapes", "prefill", "stack_layers", "truncate_layers", "unstack_layers",
    "DEFAULT_MODEL", "resolve",
    "IncrementalDecoder", "Tokenizer", "load_tokenizer",
]
