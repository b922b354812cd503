"""`ModelConfig`: the static description of a decoder of any supported family (Llama, SmolLM2,
Qwen2/3, Mistral, Gemma 2/3).

The config is a frozen, hashable dataclass so a model built from it can be a static argument
of `jax.jit`. Everything that changes the traced computation lives here (shapes, RoPE
variant, dtype, scan vs unrolled layers); nothing here is an array.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "mixtral", "qwen3_moe")
SUPPORTED_DTYPES = ("float32", "bfloat16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


def _freeze(value: Any) -> Any:
    """Make a JSON-like value hashable (dicts -> sorted item tuples, lists -> tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class ConfigValueError(ValueError):
    """A setting out of its range: ``field`` names it (a `ModelConfig` field, ``rope_scaling.<key>``
    for an entry of the RoPE scaling, or a checkpoint's own key where a family reader raises it),
    ``value`` is its value and ``rule`` what it must be. The loaders re-raise it naming the
    checkpoint's key and file (`specjax.models.hf_loader.read_config`,
    `specjax.models.gguf_loader.config_from_gguf`)."""

    def __init__(self, field: str, value: Any, rule: str):
        self.field, self.value, self.rule = field, value, rule
        self.shown = _shown(value)            # the value as messages write it
        super().__init__(f"{field}={self.shown}: {rule}")

    def __reduce__(self):                     # (pickles across processes with its fields)
        return type(self), (self.field, self.value, self.rule)


def _shown(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    return repr(value)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _positive_number(field: str, v: Any, what: str = "must be a finite number > 0") -> None:
    if not (_is_number(v) and math.isfinite(float(v)) and float(v) > 0):
        raise ConfigValueError(field, v, what)


# the sizes every model has (>= 1), checked in this order: a count a later check divides by
# (num_heads % num_kv_heads, hidden_size // num_heads) is refused by name first
POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size")


def check_settings(values: Mapping[str, Any]) -> None:
    """The range checks of a `ModelConfig`'s numeric settings, on those of ``values`` (field ->
    value) that are present; a value out of range is a `ConfigValueError` naming the field.

    * ``vocab_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
      ``head_dim``, ``ffn_size``: integers >= 1; ``num_heads`` a multiple of ``num_kv_heads``,
      ``head_dim`` even (RoPE rotates pairs);
    * ``rope_theta`` (and ``local_rope_theta`` when set): finite and > 0 (0 gives NaN
      frequencies, a negative base NaN or wrong ones);
    * ``rope_scaling``: a supported type; "linear" and "llama3" need a ``factor``, finite and
      > 0; "llama3"'s ``low_freq_factor`` and ``high_freq_factor`` (defaults 1 and 4) finite,
      > 0, high > low, and ``original_max_position_embeddings`` (default 8192) > 0;
    * ``rms_eps``: finite and >= 0 (a negative epsilon can make the mean square negative: NaN);
    * ``sliding_window`` >= 0 (0: none); ``num_experts`` >= 0 and, with experts,
      ``experts_per_token`` in [1, num_experts];
    * ``attn_softcap``, ``final_softcap``, ``query_pre_attn_scalar``: None or > 0.

    Loaders call it on the settings they have read before a family reader uses them (so a
    count of 0 is refused by name, not met as a ZeroDivisionError), and `ModelConfig` on all of
    its own: every path (Hugging Face, GGUF, presets, a config built in code) gets the checks."""
    for name in POSITIVE_SIZES:
        if name in values:
            v = values[name]
            if not (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= 1):
                raise ConfigValueError(name, v, "must be an integer >= 1")
    if "num_heads" in values and "num_kv_heads" in values and values["num_heads"] % values["num_kv_heads"]:
        raise ConfigValueError("num_kv_heads", values["num_kv_heads"],
                               f"num_heads={values['num_heads']} is not a multiple of it")
    if "head_dim" in values and values["head_dim"] % 2:
        raise ConfigValueError("head_dim", values["head_dim"], "must be even for RoPE")
    if "rope_theta" in values:
        _positive_number("rope_theta", values["rope_theta"])
    if values.get("local_rope_theta") is not None:
        _positive_number("local_rope_theta", values["local_rope_theta"])
    if "rope_scaling" in values:
        check_rope_scaling(values["rope_scaling"])
    if "rms_eps" in values:
        v = values["rms_eps"]
        if not (_is_number(v) and math.isfinite(float(v)) and float(v) >= 0):
            raise ConfigValueError("rms_eps", v, "must be a finite number >= 0")
    if "sliding_window" in values:
        v = values["sliding_window"]
        if not (_is_number(v) and v >= 0):
            raise ConfigValueError("sliding_window", v, "must be >= 0 (0 = none)")
    if "num_experts" in values:
        n = values["num_experts"]
        if not (isinstance(n, (int, np.integer)) and n >= 0):
            raise ConfigValueError("num_experts", n, "must be an integer >= 0 (0: a dense MLP)")
        k = values.get("experts_per_token", 0)
        if n and not (isinstance(k, (int, np.integer)) and 1 <= k <= n):
            raise ConfigValueError("experts_per_token", k, f"must be in [1, num_experts={n}]")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        v = values.get(name)
        if v is not None:
            _positive_number(name, v, "must be positive or None")


def check_rope_scaling(scaling) -> None:
    """The checks of `check_settings` on a RoPE scaling entry (a mapping or frozen pairs; None:
    none): raises `ConfigValueError` naming ``rope_scaling.<key>``."""
    if scaling is None:
        return
    d = dict(scaling)
    if not d:
        return
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        return
    if d.get("factor") is None:
        raise ConfigValueError("rope_scaling.factor", None, f"a {kind!r} RoPE scaling needs a factor > 0")
    _positive_number("rope_scaling.factor", d["factor"])
    if kind == "llama3":
        low, high = d.get("low_freq_factor", 1.0), d.get("high_freq_factor", 4.0)
        _positive_number("rope_scaling.low_freq_factor", low)
        _positive_number("rope_scaling.high_freq_factor", high)
        if not high > low:
            raise ConfigValueError("rope_scaling.high_freq_factor", high,
                                   f"must be greater than low_freq_factor={_shown(low)}")
        _positive_number("rope_scaling.original_max_position_embeddings",
                         d.get("original_max_position_embeddings", 8192))


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
    # how the projections are stored and multiplied (`specjax.kernels.LINEAR_OPS`): "xla" (plain
    # matrices, XLA's dot) | "panels" (the CPU kernel's layout; needs scan_layers=False) | a
    # registered one (see specjax.models.llama, "Layout")
    linear_op: str = "xla"
    # decode steps and verification blocks (<= kernels.ATTENTION_MAX_TOKENS new tokens, no tree)
    # attend through specjax.kernels.decode_attention: reads each cached key and value once per
    # key/value head and only the committed slots; off: the reference einsum over the capacity
    cpu_attention: bool = False
    # the op that computes attention (`specjax.models.attention.ATTENTION_OPS`): "reference" (einsums,
    # every feature) | "dot_product" (jax.nn.dot_product_attention) | a registered one
    attention_op: str = "reference"
    # the reference op attends a cache-free causal call (a whole-sequence forward: features,
    # teacher states, training) this many queries at a time, each chunk over the keys up to its
    # end (`specjax.models.attention.AttentionSpec.causal_chunk`; 0: in one block)
    causal_chunk: int = 64
    # each layer writes its block's K and V into its cache buffer, then attends over the buffer's
    # slots (`specjax.models.attention`, write-then-attend): a verification block's rows and the
    # one-token steps that score the same tokens then reduce in the same order. Unrolled layers
    # only (the scanned layers write once, after the scan; the setting is ignored there, as it is
    # by the CPU decode kernel, cpu_attention, which attends first).
    write_then_attend: bool = False
    # with write-then-attend, blocks of up to 64 tokens sum each query's last T keys apart, in
    # position order (`specjax.models.attention`, "Token trees in low precision"): a token tree's
    # rows then compute what the steps compute, bit for bit. Set for runs that verify trees
    # (`specjax.build` does); it reads a window of the cache per row, which the TPU compiler
    # currently pays for with a copy of every cache buffer (experiments/aot/README.md).
    ordered_tail: bool = False
    max_position: int = 8192
    arch: str = "llama"                   # the family (`specjax.models.families`): what the exporter writes
    # ---- family features (the defaults are Llama's; `specjax.models.families` sets them) ----
    qk_norm: bool = False                 # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0              # norms scale by (norm_offset + w), computed in float32 (Gemma: 1;
                                          # a Gemma GGUF: 0, llama.cpp stores 1 + w)
    sandwich_norms: bool = False          # norms on the attention and MLP outputs too (Gemma 2/3; its
                                          # norms multiply in float32 even with norm_offset 0)
    mlp_activation: str = "silu"          # the gate's activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False        # the embedding times sqrt(hidden_size), in the model dtype (Gemma)
    query_pre_attn_scalar: float | None = None   # attention scores scaled by this**-0.5 (None: head_dim**-0.5)
    attn_softcap: float | None = None     # attention scores -> cap * tanh(score / cap) before the mask (Gemma 2)
    final_softcap: float | None = None    # the same on the output logits (Gemma 2)
    # sliding-window attention: a query at position i sees keys at positions j with
    # i - window < j <= i, in the layers `window_layers` marks (None: every layer); 0 = none
    sliding_window: int = 0
    window_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of the windowed layers, unscaled (Gemma 3); None: rope_theta
    # mixture of experts (Mixtral, Qwen3-MoE): > 0 replaces every layer's MLP by num_experts
    # experts of ffn_size, of which a router (softmax over experts) picks experts_per_token per
    # token; normalize_topk renormalizes the picked weights to sum to 1
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_topk: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.window_layers, list):
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        check_settings({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        linear = self.linear                  # an unknown name: ValueError naming the registered ops
        if linear.per_layer_only and self.scan_layers:
            raise ValueError(f"linear_op={self.linear_op!r} needs scan_layers=False (per-layer params): a scan "
                             f"would slice every layer's stored matrices out of stacked arrays inside the step")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
        if self.window_layers is not None and len(self.window_layers) != self.num_layers:
            raise ValueError(f"window_layers has {len(self.window_layers)} entries for {self.num_layers} layers")
        if self.num_experts and self.linear_op != "xla":
            raise ValueError(f"linear_op={self.linear_op!r} does not hold expert weights; "
                             f"a mixture-of-experts model needs linear_op='xla'")
        if self.causal_chunk < 0:
            raise ValueError(f"causal_chunk must be >= 0 (0: attend in one block), got {self.causal_chunk}")

    # ---- derived -------------------------------------------------------------------------
    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; a new ``num_layers`` keeps the first layers' windows unless
        ``window_layers`` is given too (`layers_config` picks other layers)."""
        n = changes.get("num_layers", self.num_layers)
        if "window_layers" not in changes and self.window_layers is not None and n != self.num_layers:
            changes["window_layers"] = tuple(self.window_layers[i] if i < self.num_layers else False
                                             for i in range(n))
        return dataclasses.replace(self, **changes)

    def layers_config(self, layer_ids, **changes) -> "ModelConfig":
        """The config of a model made of the given layers of this one (their windows kept)."""
        ids = [int(i) for i in layer_ids]
        windows = None if self.window_layers is None else tuple(self.window_layers[i] for i in ids)
        return self.replace(num_layers=len(ids), window_layers=windows, **changes)

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

    def layer_window(self, i: int) -> int:
        """Layer i's attention window (0 = the whole prefix)."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if self.window_layers is None or self.window_layers[i] else 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def has_local_rope(self) -> bool:
        """The windowed layers use their own RoPE (Gemma 3)."""
        return self.local_rope_theta is not None and any(self.layer_windows)

    @property
    def attention_scale(self) -> float:
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    @property
    def plain_attention(self) -> bool:
        """Causal softmax attention over the whole prefix at 1/sqrt(head_dim): what
        `specjax.kernels.decode_attention` computes."""
        return not any(self.layer_windows) and self.attn_softcap is None and self.query_pre_attn_scalar is None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear(self):
        """The linear op (`specjax.kernels.LinearOp`) named by ``linear_op``."""
        from specjax.kernels import get_linear_op
        return get_linear_op(self.linear_op)

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2] in float32, with the checkpoint's scaling.

        Follows the Hugging Face conventions (rotate_half pairing of dims i and i+head_dim/2):
        inv_freq_i = 1 / theta^(2i/d); "linear" divides by `factor`; "llama3" is the
        wavelength-dependent blend of Llama 3.1 (low frequencies divided by `factor`, high
        ones kept, a smooth interpolation in between).
        """
        d = self.head_dim
        exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        if local and self.local_rope_theta is not None:      # the windowed layers' own, unscaled RoPE
            return (1.0 / (np.float32(self.local_rope_theta) ** exps)).astype(np.float32)
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
        mlp = 3 * D * F if not self.num_experts else self.num_experts * (3 * D * F + D)
        per_layer = 2 * D + D * self.q_size + 2 * D * self.kv_size + self.q_size * D + mlp
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * D * self.sandwich_norms
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


def _spans(ids) -> str:
    """0-3, 7: sorted integers as ranges."""
    ids, out = sorted(ids), []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def refuse_extra_layers(names, pattern, num_layers: int, header: str, what: str) -> None:
    """A CorruptCheckpointError when tensor ``names`` hold layers (``pattern``'s group 1) >=
    ``num_layers``: ``header`` names the count's key and file, ``what`` the checkpoint."""
    found = {}
    for n in names:
        m = pattern.match(n)
        if m:
            found.setdefault(int(m.group(1)), n)
    extra = sorted(i for i in found if i >= num_layers)
    if extra:
        raise CorruptCheckpointError(
            f"{header}, but {what} holds tensors of layers {_spans(found)} (e.g. {found[extra[0]]!r}): "
            f"the header and the weights disagree on the layer count (reading {num_layers} would "
            f"truncate the model)")
