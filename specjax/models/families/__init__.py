"""Model families: how each architecture's checkpoints name and configure the one decoder.

Every supported architecture runs through `specjax.models.Llama`, whose `ModelConfig` carries the
features that tell families apart (q/k norms, (1 + w) norms, sandwich norms, GeGLU, embedding
scale, soft-capping, sliding windows, a local RoPE, experts). A `Family` says how a Hugging Face
``config.json`` sets those features, which tensor names differ from Llama's, and what
``config.json`` an export writes; and, for a family llama.cpp writes, which
``general.architecture`` its GGUF files carry and how their metadata sets the features (what
llama.cpp's runtime derives instead of reading, the family reproduces). One module per family
registers one; the registry is keyed by ``ModelConfig.arch``.

A new family whose layers the decoder already computes is one module here. One that needs a
new computation adds a feature to `ModelConfig` and `specjax.models.llama` first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from specjax.models.config import ConfigValueError, ModelConfig, UnsupportedArchitectureError


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                                   # ModelConfig.arch
    hf_architectures: tuple[str, ...]           # the first is what an export writes
    model_types: tuple[str, ...]                # config.json "model_type" values (the first: export)
    # config.json -> the family's ModelConfig fields beyond the common ones (raises
    # UnsupportedArchitectureError naming an option it cannot run)
    read_config: Callable[[Mapping[str, Any]], dict]
    # ModelConfig -> the family's config.json entries beyond the common ones
    write_config: Callable[[ModelConfig], dict]
    # canonical tensor key -> Hugging Face name where the family differs from Llama's
    hf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_arch: str | None = None                # general.architecture of its GGUF files (None: no GGUF)
    # GGUF metadata -> the family's ModelConfig fields beyond the common ones, given the metadata
    # (a `specjax.models.gguf_loader.GGUFMeta`) and the common fields already read (raises
    # UnsupportedArchitectureError naming an option it cannot run); None: none
    read_gguf: Callable[[Any, Mapping[str, Any]], dict] | None = None
    # among the families sharing a gguf_arch, whether a file is this family's (None: always)
    gguf_match: Callable[[Any], bool] | None = None
    # the optional decoder features (`FEATURES`) its checkpoints can express; an export of a
    # config that uses another is refused by name
    features: frozenset = frozenset()


# ModelConfig's optional features, each with the test of whether a config uses it
FEATURES: dict[str, Callable[[ModelConfig], bool]] = {
    "attention_bias": lambda c: c.attention_bias,
    "qk_norm": lambda c: c.qk_norm,
    "norm_offset": lambda c: c.norm_offset != 0.0,
    "sandwich_norms": lambda c: c.sandwich_norms,
    "gelu_tanh": lambda c: c.mlp_activation == "gelu_tanh",
    "scale_embeddings": lambda c: c.scale_embeddings,
    "query_pre_attn_scalar": lambda c: c.query_pre_attn_scalar is not None,
    "attn_softcap": lambda c: c.attn_softcap is not None,
    "final_softcap": lambda c: c.final_softcap is not None,
    "sliding_window": lambda c: bool(c.sliding_window),
    "local_rope": lambda c: c.local_rope_theta is not None,
    "experts": lambda c: bool(c.num_experts),
}


def used_features(config: ModelConfig) -> frozenset:
    return frozenset(name for name, used in FEATURES.items() if used(config))


def check_expressible(config: ModelConfig) -> Family:
    """The family of ``config.arch``, when its checkpoints can express every feature the config
    uses; else UnsupportedArchitectureError naming the features (an export would drop them)."""
    family = get(config.arch)
    missing = sorted(used_features(config) - family.features)
    if missing:
        raise UnsupportedArchitectureError(
            f"a {family.hf_architectures[0]} checkpoint cannot express {', '.join(missing)}: export this model "
            f"with the arch of a family that has them ({', '.join(f.name for f in _FAMILIES.values() if set(missing) <= f.features) or 'none'})")
    return family


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in _FAMILIES and _FAMILIES[family.name] != family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def get(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unknown model family {name!r} (supported: {', '.join(_FAMILIES)})") from None


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def gguf_archs() -> tuple[str, ...]:
    """The ``general.architecture`` values of the GGUF files specjax reads."""
    return tuple(dict.fromkeys(f.gguf_arch for f in _FAMILIES.values() if f.gguf_arch))


def for_gguf(arch: str | None, meta) -> Family:
    """The family of a GGUF file of architecture ``arch`` (its ``general.architecture``)."""
    for f in _FAMILIES.values():
        if f.gguf_arch is not None and f.gguf_arch == arch and (f.gguf_match is None or f.gguf_match(meta)):
            return f
    raise UnsupportedArchitectureError(
        f"unsupported architecture {arch!r} in GGUF file {getattr(meta, 'path', None)}: specjax loads "
        f"{', '.join(gguf_archs())}")


def for_hf_config(cfg: Mapping[str, Any]) -> Family:
    """The family of a parsed config.json: by ``architectures``, else by ``model_type``."""
    archs = cfg.get("architectures") or []
    for a in archs:
        for f in _FAMILIES.values():
            if a in f.hf_architectures:
                return f
    if not archs:
        for f in _FAMILIES.values():
            if cfg.get("model_type") in f.model_types:
                return f
    supported = ", ".join(a for f in _FAMILIES.values() for a in f.hf_architectures)
    raise UnsupportedArchitectureError(
        f"unsupported architecture {archs or cfg.get('model_type')!r}: specjax loads {supported}")


# ---------------------------------------------------------------------------------------
# Readers and writers of config.json entries several families share
# ---------------------------------------------------------------------------------------
def rope_from_hf(params: Mapping[str, Any] | None, legacy: Mapping[str, Any] | None = None,
                 default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a ``rope_parameters`` entry (transformers 5) or
    the older ``rope_theta`` + ``rope_scaling`` keys of ``legacy``; unsupported types raise."""
    params = dict(params or {})
    legacy = legacy or {}
    theta = float(params.get("rope_theta", legacy.get("rope_theta", default_theta)))
    scaling = legacy.get("rope_scaling")
    if params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("linear", "llama3"):
            raise UnsupportedArchitectureError(f"unsupported rope scaling type {kind!r}")
    return theta, scaling or None


def rope_to_hf(theta: float, scaling) -> dict:
    rope = {"rope_theta": float(theta), "rope_type": "default"}
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        rope.update(scaling)
    return rope


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def activation(cfg: Mapping[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    """The MLP gate's activation from ``cfg[key]`` as a ModelConfig.mlp_activation."""
    act = cfg.get(key) or default
    if act not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"unsupported activation {act!r} ({key}; supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[act]


def windows(cfg: Mapping[str, Any], num_layers: int, pattern: Callable[[int], bool] | None = None,
            default_window: int | None = None, use_layer_types: bool = True) -> dict:
    """sliding_window and window_layers from ``sliding_window`` (``default_window`` when the key
    is absent) and ``layer_types`` (unless ``use_layer_types`` is False; else ``pattern(i)``:
    layer i is windowed; else every layer when a window is set)."""
    window = cfg.get("sliding_window", default_window) or 0
    types = cfg.get("layer_types") if use_layer_types else None
    if types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedArchitectureError(f"unsupported attention layer types {unknown} (layer_types)")
        if len(types) != num_layers:
            raise UnsupportedArchitectureError(f"layer_types has {len(types)} entries for {num_layers} layers")
        flags = tuple(t == "sliding_attention" for t in types)
    elif pattern is not None:
        flags = tuple(bool(pattern(i)) for i in range(num_layers))
    else:
        flags = None
    if not window or (flags is not None and not any(flags)):
        return {"sliding_window": 0, "window_layers": None}
    if flags is not None and all(flags):
        flags = None
    return {"sliding_window": int(window), "window_layers": flags}


def same_window_everywhere(config: ModelConfig, family: str) -> None:
    """Refuse to export per-layer windows to a family whose layers all share one window."""
    if config.window_layers is not None and not all(config.window_layers):
        raise UnsupportedArchitectureError(f"{family} windows every layer alike; this model windows only layers "
                                           f"{[i for i, w in enumerate(config.layer_windows) if w]}")


def layer_types(config: ModelConfig) -> list[str]:
    return ["sliding_attention" if w else "full_attention" for w in config.layer_windows]


def gguf_windows(meta, num_layers: int, period: int, default_window: int = 0) -> dict:
    """sliding_window and window_layers from GGUF metadata: ``attention.sliding_window`` (else
    ``default_window``; 0: none) and ``attention.sliding_window_pattern``, else ``period``. As llama.cpp's
    ``llama_hparams::set_swa_pattern`` (src/llama-hparams.cpp): with a period n, layer i is
    windowed unless i % n == n - 1 (n = 1: no layer, n = 0: every layer); an array of booleans
    marks the windowed layers (gguf's ``add_sliding_window_pattern``: true = sliding)."""
    window = int(meta.get("attention.sliding_window", default_window) or 0)
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise UnsupportedArchitectureError(
                f"attention.sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        flags = tuple(bool(x) for x in pattern)
    else:
        n = int(pattern)
        if n < 0:
            raise ConfigValueError("attention.sliding_window_pattern", n,
                                   "must be >= 0 (n: each n-th layer global; 0: every layer windowed)")
        flags = tuple(n == 0 or i % n < n - 1 for i in range(num_layers))
    if not window or not any(flags):
        return {"sliding_window": 0, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if all(flags) else flags}


def no_bias(cfg: Mapping[str, Any]) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise UnsupportedArchitectureError(f"{key}=true is not supported for {cfg.get('model_type')!r}")


from specjax.models.families import _gemma, _llama, _mistral, _moe, _qwen  # noqa: E402,F401  (the built-in families)
