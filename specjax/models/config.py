"""`ModelConfig`: the static description of a Llama-family decoder (Llama, SmolLM2, Qwen2).

The config is a frozen, hashable dataclass so a model built from it can be a static argument
of `jax.jit`. Everything that changes the traced computation lives here (shapes, RoPE
variant, dtype, scan vs unrolled layers); nothing here is an array.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_DTYPES = ("float32", "bfloat16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _freeze(value: Any) -> Any:
    """Make a JSON-like value hashable (dicts -> sorted item tuples, lists -> tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float = 10000.0
    # The checkpoint's rope-scaling entry, frozen into sorted (key, value) pairs; None = plain
    # RoPE. Supported "rope_type"/"type": default, linear (factor), llama3 (factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False          # Qwen2-style bias on q/k/v projections
    dtype: str = "float32"                # params and KV cache
    scan_layers: bool = True              # lax.scan over stacked layers, else unrolled loop
    fuse_projections: bool = False        # prepared params hold wqkv = [wq|wk|wv], w_gate_up = [w_gate|w_up]
    # projections (and a copy of the head) stored as 32-column panels for specjax.kernels'
    # CPU matmul; needs scan_layers=False (see specjax.models.llama, "Layout")
    packed_projections: bool = False
    # decode steps and verification blocks (<= kernels.ATTENTION_MAX_TOKENS new tokens, no tree)
    # attend through specjax.kernels.decode_attention: reads each cached key and value once per
    # key/value head and only the committed slots; off: the reference einsum over the capacity
    cpu_attention: bool = False
    max_position: int = 8192
    arch: str = "llama"                   # "llama" | "qwen2" (what the exporter writes)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.packed_projections and self.scan_layers:
            raise ValueError("packed_projections=True needs scan_layers=False (per-layer params): a scan "
                             "would slice every layer's panels out of stacked arrays inside the step")
        _ = self.rope_type  # validates rope_scaling

    # ---- derived -------------------------------------------------------------------------
    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        d = self.rope_scaling_dict
        if not d:
            return "default"
        kind = d.get("rope_type", d.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {kind!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return kind

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2] in float32, with the checkpoint's scaling.

        Follows the Hugging Face conventions (rotate_half pairing of dims i and i+head_dim/2):
        inv_freq_i = 1 / theta^(2i/d); "linear" divides by `factor`; "llama3" is the
        wavelength-dependent blend of Llama 3.1 (low frequencies divided by `factor`, high
        ones kept, a smooth interpolation in between).
        """
        d = self.head_dim
        exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        inv = (1.0 / (np.float32(self.rope_theta) ** exps)).astype(np.float32)
        kind = self.rope_type
        sc = self.rope_scaling_dict or {}
        if kind == "linear":
            inv = (inv / np.float32(sc["factor"])).astype(np.float32)
        elif kind == "llama3":
            factor = float(sc["factor"])
            low = float(sc.get("low_freq_factor", 1.0))
            high = float(sc.get("high_freq_factor", 4.0))
            old_ctx = float(sc.get("original_max_position_embeddings", 8192))
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = (2 * math.pi / inv).astype(np.float32)
            scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
            smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
            smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def num_params(self) -> int:
        D, F, L, V = self.hidden_size, self.ffn_size, self.num_layers, self.vocab_size
        per_layer = 2 * D + D * self.q_size + 2 * D * self.kv_size + self.q_size * D + 3 * D * F
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        return V * D * (1 if self.tie_embeddings else 2) + D + L * per_layer


# ---------------------------------------------------------------------------------------
# Loader errors (shared by the GGUF and Hugging Face loaders).
# ---------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """Base class of every checkpoint loading error."""


class MissingTensorError(CheckpointError):
    """A tensor the architecture needs is not in the checkpoint."""


class TensorShapeError(CheckpointError):
    """A tensor has the wrong shape for the configuration."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture (or a feature of it) is not implemented."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file could not be parsed (truncated or corrupt)."""
