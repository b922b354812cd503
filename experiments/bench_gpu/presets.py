"""Size presets: Llama-shaped `ModelConfig`s with the shapes of real checkpoints, and random
weights initialised directly on the device.

The shapes follow the checkpoints' Hugging Face ``config.json``:

* ``smollm2``: SmolLM2-135M(-Instruct): 30 layers, hidden 576, 9 heads / 3 KV heads of 64,
  FFN 1536, vocab 49152, tied embeddings, RoPE theta 1e5.
* ``1b``: Llama-3.2-1B: 16 layers, hidden 2048, 32 heads / 8 KV heads of 64, FFN 8192, vocab
  128256, tied embeddings, RoPE theta 5e5 with llama3 scaling (factor 32, low 1, high 4,
  original context 8192).
* ``3b``: Llama-3.2-3B: 28 layers, hidden 3072, 24 heads / 8 KV heads of 128, FFN 8192, vocab
  128256, tied, same RoPE as 1b.
* ``8b``: Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, FFN 14336, vocab
  128256, untied head, RoPE theta 5e5 with llama3 scaling factor 8.
* ``tiny``: 4 layers of width 64 (CI on CPU).

`KNOWN_PARAMS` holds the published parameter counts the presets must reproduce (checked by
tests/test_bench_gpu.py from the shapes alone, nothing allocated).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from specjax.models import Llama, ModelConfig
from specjax.models.llama import param_specs

_LLAMA3_ROPE_1B_3B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_8B = {**_LLAMA3_ROPE_1B_3B, "factor": 8.0}

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_size=128, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_position=2048),
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    ffn_size=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True, max_position=8192),
    "1b": dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               ffn_size=8192, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B_3B, rms_eps=1e-5,
               tie_embeddings=True, max_position=131072),
    "3b": dict(vocab_size=128256, hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
               ffn_size=8192, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B_3B, rms_eps=1e-5,
               tie_embeddings=True, max_position=131072),
    "8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn_size=14336, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_8B, rms_eps=1e-5,
               tie_embeddings=False, max_position=131072),
}

# Published parameter counts (Hugging Face model cards / safetensors metadata).
KNOWN_PARAMS = {
    "smollm2": 134_515_008,       # SmolLM2-135M
    "1b": 1_235_814_400,          # Llama-3.2-1B
    "3b": 3_212_749_824,          # Llama-3.2-3B
    "8b": 8_030_261_248,          # Llama-3.1-8B
}
CHECKPOINT_NAMES = {"tiny": None, "smollm2": "SmolLM2-135M", "1b": "Llama-3.2-1B",
                    "3b": "Llama-3.2-3B", "8b": "Llama-3.1-8B"}


def preset_config(size: str, dtype: str = "float32", scan_layers: bool = True) -> ModelConfig:
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(PRESETS)}")
    return ModelConfig(**PRESETS[size], dtype=dtype, scan_layers=scan_layers)


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def param_count(config: ModelConfig) -> int:
    """Parameters counted from the shapes (nothing allocated); the tied embedding once."""
    leaves = jax.tree.leaves(param_specs(config), is_leaf=_is_spec)
    return int(sum(math.prod(shape) for shape, _, _ in leaves))


def param_bytes(config: ModelConfig) -> int:
    return param_count(config) * jnp.dtype(config.dtype).itemsize


@functools.partial(jax.jit, static_argnames=("shape", "kind", "dtype", "std"))
def _init_leaf(key, *, shape, kind, dtype, std):
    if kind == "ones":
        return jnp.ones(shape, dtype)
    # Drawn in the target dtype inside one jitted program: the leaf is created on the default
    # device with no float32 (or host) copy of it.
    return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)


def random_params(config: ModelConfig, key, std: float = 0.02) -> dict:
    """Random weights in `config.dtype` on the default device: normal(0, std) projections and
    embeddings, unit norms; the canonical pure-dict form (layers stacked on a leading axis).

    One jitted program per leaf, so the peak is the parameters plus one leaf's temporaries
    (an 8B float32 model never exists on the host)."""
    specs = param_specs(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    dtype = jnp.dtype(config.dtype)
    out = []
    for i, (shape, _, kind) in enumerate(leaves):
        out.append(_init_leaf(jax.random.fold_in(key, i), shape=tuple(shape), kind=kind, dtype=dtype,
                              std=float(std)))
    return jax.tree.unflatten(treedef, out)


def build_target(size: str, dtype: str, seed: int = 0, scan_layers: bool = True, std: float = 0.02):
    """(Llama, params) for a size preset, random weights on the default device."""
    config = preset_config(size, dtype, scan_layers)
    model = Llama(config)
    params = random_params(config, jax.random.key(seed), std)
    return model, model.prepare_params(params)
