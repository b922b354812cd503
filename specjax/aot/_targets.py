"""What `specjax aot` compiles for: TPU topologies and GPU hosts (their chips' memory, bandwidth
and peak rate) and target shapes (presets of published checkpoints' config.json, or a
config.json path).

TPU figures are the per-chip values of the Cloud TPU system-architecture pages (v4, v5e, v5p,
v6e): HBM capacity, HBM bandwidth, peak bf16 matrix rate, bidirectional ICI bandwidth. GPU
figures are NVIDIA's data-sheet values for the SXM parts (HBM capacity and bandwidth, dense
bf16 tensor rate, NVLink bandwidth). They are what the predicted step times are computed from.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                 # the generation as topology names spell it
    device_kind: str          # what libtpu calls the device
    hbm_bytes: float
    hbm_bytes_per_s: float
    peak_flops: float         # bf16
    ici_bytes_per_s: float    # bidirectional, per chip


CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GiB, 1228e9, 275e12, 300e9),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GiB, 819e9, 197e12, 400e9),
    "v5p": Chip("v5p", "TPU v5", 95 * GiB, 2765e9, 459e12, 1200e9),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GiB, 1638e9, 918e12, 800e9),
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 80e9, 3.35e12, 989e12, 900e9),
    "h200": Chip("h200", "NVIDIA H200 141GB HBM3e", 141e9, 4.8e12, 989e12, 900e9),
}
TPUS = ("v4", "v5e", "v5p", "v6e")
GPUS = ("h100", "h200")
_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
_GPU_HOST = re.compile(r"^(h100|h200):(\d+)$")


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """(chip, grid) of a topology name: a TPU slice such as ``v5e:2x2``, ``v5p:2x2x1`` or
    ``v6e:2x4``, or one GPU host ``h100:N`` / ``h200:N`` (N GPUs, grid ``(N,)``); ValueError
    naming it otherwise (before libtpu or the CUDA plugin is asked)."""
    g = _GPU_HOST.match(str(name))
    if g:
        if not 1 <= int(g.group(2)) <= 8:
            raise ValueError(f"topology {name!r}: one GPU host has 1 to 8 GPUs")
        return CHIPS[g.group(1)], (int(g.group(2)),)
    m = _TOPOLOGY.match(str(name))
    if not m:
        raise ValueError(f"topology {name!r}: expected <chip>:<grid> with chip one of {', '.join(TPUS)} and a "
                         f"grid like 2x2 or 2x2x1 (e.g. v5e:2x2, v5p:2x2x1, v6e:2x4), or a GPU host "
                         f"{'/'.join(GPUS)}:N (e.g. h100:1)")
    grid = tuple(int(d) for d in m.group(2).split("x"))
    if min(grid) < 1:
        raise ValueError(f"topology {name!r}: every grid dimension must be >= 1")
    return CHIPS[m.group(1)], grid


# Shapes of published checkpoints, as their config.json files give them (weights are never
# read: every program is compiled from shapes).
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
PRESETS = {
    "tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
             "intermediate_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "tie_word_embeddings": False},
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "intermediate_size": 8192, "rope_theta": 500000.0,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "rms_norm_eps": 1e-5,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "intermediate_size": 14336, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
                     "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 12288, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
                     "sliding_window": None, "tie_word_embeddings": False},
    "gemma-3-12b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
                    "hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "tie_word_embeddings": True},
}


def target_config(name: str, dtype: str):
    """The `ModelConfig` of a preset name or a config.json path (layout fields at their
    defaults); ValueError naming it for anything else."""
    from specjax.models.hf_loader import config_from_hf

    if name in PRESETS:
        cfg = PRESETS[name]
    else:
        path = pathlib.Path(name).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"target {name!r}: not a preset ({', '.join(PRESETS)}) nor a config.json file or "
                             f"a directory holding one")
        try:
            cfg = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"target {name!r}: {path} is not valid JSON ({e})") from None
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
        if not isinstance(cfg, dict):
            raise ValueError(f"target {name!r}: {path} does not hold a JSON object")
    try:
        return config_from_hf(dict(cfg), dtype=dtype)
    except (KeyError, TypeError) as e:
        raise ValueError(f"target {name!r}: its config.json lacks or mistypes {e}") from None
