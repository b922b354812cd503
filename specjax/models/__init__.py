"""Models: the Llama-family decoder, its KV cache, checkpoint loaders, tokenizer and exporter.

Modules: `config` (ModelConfig, loader errors), `llama` (the decoder, its parameter layouts
and tree attention), `kv_cache` (the KV cache, `TreeBlock`, committing an accepted tree path),
`names` (canonical / Hugging Face / GGUF tensor names), `gguf_loader` and `hf_loader`
(checkpoint -> config and canonical params), `loading` (`load`, `load_with_tokenizer`),
`packing` (`PackedRows`: a block call that computes only the positions each row uses),
`tokenizer`, `export`, `registry` (named checkpoints), `reduced_head` and `draft_artifact`
(distilled drafts).
"""

from specjax.models._protocol import CacheCapacityError, DecoderModel
from specjax.models.config import (CheckpointError, CorruptCheckpointError, MissingTensorError,
                                   ModelConfig, TensorShapeError, UnsupportedArchitectureError)
from specjax.models.export import export_hf
from specjax.models.kv_cache import KVCache, TreeBlock
from specjax.models.llama import (Llama, canonical_params, param_logical_axes, param_shapes,
                                  stack_layers, truncate_layers)
from specjax.models.loading import load, load_with_tokenizer
from specjax.models.packing import PackedRows
from specjax.models.prefill import PREFILL_CHUNK, prefill
from specjax.models.registry import DEFAULT_MODEL, resolve
from specjax.models.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

__all__ = [
    "CacheCapacityError", "DecoderModel",
    "CheckpointError", "CorruptCheckpointError", "MissingTensorError", "ModelConfig",
    "TensorShapeError", "UnsupportedArchitectureError",
    "KVCache", "TreeBlock", "export_hf",
    "Llama", "canonical_params", "param_logical_axes", "param_shapes",
    "stack_layers", "truncate_layers",
    "load", "load_with_tokenizer", "PackedRows", "PREFILL_CHUNK", "prefill",
    "DEFAULT_MODEL", "resolve",
    "IncrementalDecoder", "Tokenizer", "load_tokenizer",
]
