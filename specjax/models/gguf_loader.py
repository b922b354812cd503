"""Read a GGUF file: its `ModelConfig` and canonical params.

The architectures read are those llama.cpp's converter (convert_hf_to_gguf.py) writes for the
families of `specjax.models.families`: ``llama`` (Llama, SmolLM2, and Mistral, which llama.cpp
writes as ``llama`` without a sliding window; with ``llama.expert_count`` > 0 Mixtral),
``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma2``, ``gemma3``. Here the metadata every family shares
is read; each family's `Family.read_gguf` reads its own (and what llama.cpp derives instead of
storing: Gemma's query scale, Gemma 3's sliding pattern and local RoPE base, ...).

Tensors are found by their GGUF names (`specjax.models.names`; experts as one merged tensor per
layer), dequantized to float32 with `gguf.quants.dequantize`, un-permuted (Q/K of the ``llama``
architecture, see `names.unpermute_qk`) and cast to the config's dtype. The caller opens the file
once (`open_gguf`) and may read the tokenizer from the same reader
(`specjax.models.load_with_tokenizer`).

Memory: the file is memory-mapped (`gguf.GGUFReader`), and tensors stored as float32 come out
of `dequantize` as read-only views of that mapping, which jax would alias instead of copying
(keeping the whole file mapped, and its pages resident, for as long as the parameter lives);
they are copied first.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np

from specjax.models import families
from specjax.models.config import (ConfigValueError, CorruptCheckpointError, MissingTensorError, ModelConfig,
                                   TensorShapeError, UnsupportedArchitectureError, check_settings,
                                   refuse_extra_layers)
from specjax.models.names import TensorName, assemble, unpermute_qk

GGUF_ARCHS = families.gguf_archs()       # general.architecture values read
PERMUTED_QK_ARCHS = ("llama",)           # stored with llama.cpp's Q/K row permutation (`names.unpermute_qk`)


def open_gguf(path):
    """A `gguf.GGUFReader` for `path`; a file that does not parse is a `CorruptCheckpointError`."""
    import gguf
    path = pathlib.Path(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:   # the reader raises ValueError/IndexError/struct errors on junk
        raise CorruptCheckpointError(
            f"cannot parse GGUF file {path} (truncated or corrupt?): {type(e).__name__}: {e}") from e


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        value = f.contents()
    except Exception:
        return default
    if isinstance(value, float):
        # GGUF stores float32; take the shortest decimal that round-trips (1e-05, not
        # 9.999999747378752e-06), i.e. the value the converter was given.
        value = float(str(np.float32(value)))
    return value


class GGUFMeta:
    """A GGUF file's metadata as the family readers see it: ``get``/``require`` take keys
    without the ``{arch}.`` prefix (``"attention.sliding_window"``); ``has_tensor`` asks for a
    tensor by name."""

    def __init__(self, reader, path=None):
        self.reader = reader
        self.path = path
        self.arch = _field(reader, "general.architecture")
        self.tensor_names = frozenset(t.name for t in reader.tensors)

    def get(self, key: str, default=None):
        return _field(self.reader, f"{self.arch}.{key}", default)

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise CorruptCheckpointError(f"GGUF file {self.path} lacks metadata key {self.arch}.{key}")
        return v

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_names


def config_from_gguf(reader, dtype: str = "float32", path=None) -> ModelConfig:
    """The model's configuration from GGUF metadata (layout fields at their defaults): the
    entries every family shares here, the family's own from its `Family.read_gguf`.

    A setting out of range (`specjax.models.config.check_settings`: a head or layer count < 1, a
    ``rope.freq_base`` <= 0, a negative or NaN epsilon, ...) is a `CorruptCheckpointError` naming
    the metadata key, its value and the file, raised before any tensor is read (the head counts
    first: no ZeroDivisionError). ``rope.scaling.factor`` 0 reads as no scaling (factor 1), as
    llama.cpp's loader reads it (src/llama-model.cpp: ``ropescale == 0.0f ? 1.0f : 1.0f/ropescale``);
    a negative or non-finite factor is refused."""
    meta = GGUFMeta(reader, path)
    arch = meta.arch
    family = families.for_gguf(arch, meta)
    names = {t.name: t for t in reader.tensors}
    req = meta.require
    keys = dict(_GGUF_KEYS)
    try:
        D = int(req("embedding_length"))
        H = int(req("attention.head_count"))
        K = int(meta.get("attention.head_count_kv", H))
        if meta.get("attention.head_count_kv") is None:
            keys["num_kv_heads"] = "attention.head_count"
        check_settings({"hidden_size": D, "num_heads": H, "num_kv_heads": K})
        if meta.get("attention.key_length") is not None:
            head_dim = int(meta.get("attention.key_length"))
        elif meta.get("rope.dimension_count") is not None:
            head_dim, keys["head_dim"] = int(meta.get("rope.dimension_count")), "rope.dimension_count"
        else:
            head_dim, keys["head_dim"] = D // H, "embedding_length / attention.head_count"
        rot = meta.get("rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise UnsupportedArchitectureError(
                f"GGUF file {path} rotates {rot} of each head's {head_dim} dimensions "
                f"({arch}.rope.dimension_count): partial RoPE is not supported")
        vocab = meta.get("vocab_size")
        if vocab is None:
            toks = reader.fields.get("tokenizer.ggml.tokens")
            if toks is not None:
                vocab, keys["vocab_size"] = len(toks.data), "tokenizer.ggml.tokens (its length)"
            elif "token_embd.weight" in names:
                vocab = int(names["token_embd.weight"].shape[-1])
            else:
                raise MissingTensorError(f"tensor 'token_embd.weight' is missing from GGUF file {path}")
        scaling = None
        kind = meta.get("rope.scaling.type")
        if kind not in (None, "none"):
            if kind != "linear":
                raise UnsupportedArchitectureError(
                    f"unsupported rope scaling {kind!r} in GGUF file {path}")
            factor = meta.get("rope.scaling.factor")
            # llama.cpp: an absent factor, or 0, is no scaling
            scaling = {"rope_type": "linear", "factor": 1.0 if factor is None or factor == 0 else float(factor)}
        if "rope_freqs.weight" in names:
            raise UnsupportedArchitectureError(
                f"GGUF file {path} carries rope_freqs.weight (llama3-style RoPE frequency factors), "
                f"not supported by the GGUF loader; load the Hugging Face checkpoint instead")
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        fields = dict(
            vocab_size=int(vocab), hidden_size=D, num_layers=int(req("block_count")),
            num_heads=H, num_kv_heads=K, head_dim=head_dim,
            ffn_size=int(req("feed_forward_length")),
            rope_theta=float(meta.get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            dtype=dtype,
            max_position=int(meta.get("context_length", 8192)), arch=family.name,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos))
        # (a family may replace ffn_size: checked in ModelConfig)
        check_settings({k: v for k, v in fields.items() if k != "ffn_size"})
        if family.read_gguf is not None:
            fields.update(family.read_gguf(meta, dict(fields)))
        if arch == "qwen3moe" and meta.get("expert_feed_forward_length"):
            keys["ffn_size"] = "expert_feed_forward_length"
        return ModelConfig(**fields)
    except ConfigValueError as e:
        key = keys.get(e.field, e.field)
        key = key if key.startswith("tokenizer.") else f"{arch}.{key}"
        raise CorruptCheckpointError(f"{key}={e.shown} in GGUF file {path}: {e.rule}") from e


# GGUF metadata key (after "{arch}.") of each `ModelConfig` field; a key a family reader names
# in its ConfigValueError is itself
_GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "num_layers": "block_count",
              "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
              "head_dim": "attention.key_length", "ffn_size": "feed_forward_length",
              "rope_theta": "rope.freq_base", "rope_scaling.factor": "rope.scaling.factor",
              "rms_eps": "attention.layer_norm_rms_epsilon", "local_rope_theta": "rope.freq_base_swa",
              "num_experts": "expert_count", "experts_per_token": "expert_used_count",
              "sliding_window": "attention.sliding_window", "max_position": "context_length",
              "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping"}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.")


def read_gguf(reader, dtype: str = "float32", path=None) -> tuple[ModelConfig, dict]:
    """(config, canonical params) from an open GGUF reader (`open_gguf`). Tensors of layers
    beyond ``{arch}.block_count`` (``blk.N.*`` with N >= the count) are refused, naming the
    count and the layers found, before any tensor is read."""
    import gguf

    config = config_from_gguf(reader, dtype=dtype, path=path)
    tensors = {t.name: t for t in reader.tensors}
    # layers beyond the header's count: llama.cpp refuses a file whose tensor count differs
    # from what block_count needs; here they are named
    arch = _field(reader, "general.architecture")
    refuse_extra_layers(tensors, _GGUF_LAYER, config.num_layers,
                        f"{arch}.block_count={config.num_layers} in GGUF file {path}", "the file")
    permuted = arch in PERMUTED_QK_ARCHS
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads} if permuted else {}

    def get(t: TensorName, i):
        name = t.gguf.format(i=i)
        stored = tensors.get(name)
        if stored is None:
            raise MissingTensorError(f"tensor {name!r} is missing from GGUF file {path}")
        try:
            arr = gguf.quants.dequantize(stored.data, stored.tensor_type)
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot dequantize tensor {name!r} ({stored.tensor_type.name}) from {path}: {e}") from e
        arr = np.asarray(arr, np.float32)
        if np.may_share_memory(arr, reader.data):
            arr = arr.copy()            # a view of the mapped file: see the module docstring
        header = tuple(int(n) for n in reversed(stored.shape))    # GGUF lists dimensions innermost first
        if len(header) > 1 and arr.shape != header:
            raise CorruptCheckpointError(f"tensor {name!r} in {path} decodes to {arr.shape}, "
                                         f"its header says {header}")
        n = heads.get(t.key)
        if n is not None and arr.ndim == 2:
            if arr.shape[0] % (2 * n):
                raise TensorShapeError(
                    f"tensor {name!r} has shape {arr.shape}, rows not divisible into {n} heads")
            arr = unpermute_qk(arr, n)
        return arr, name

    return config, assemble(config, get, merged_experts=True)
