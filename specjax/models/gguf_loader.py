"""Load a GGUF file (llama / qwen2 architectures) into specjax params.

Tensors are dequantized to float32 with `gguf.quants.dequantize` and cast to the config's
dtype. llama.cpp's converter stores the Q and K projections of *llama*-architecture models
with the rows of each head interleaved (its RoPE pairs dims 2i, 2i+1 where Hugging Face pairs
i, i+hd/2); we undo that permutation so the weights match the HF "rotate_half" convention
(transformers does the same when it loads a GGUF). qwen2 GGUFs are stored unpermuted.

Memory: the file is memory-mapped (`gguf.GGUFReader`), and tensors stored as float32 come out
of `dequantize` as read-only views of that mapping, which jax would alias instead of copying
(keeping the whole file mapped, and its pages resident, for as long as the parameter lives);
they are copied first. For ``scan_layers=False`` the stacked layer arrays are split into
per-layer arrays one tensor kind at a time, each stacked array dropped as soon as it is split,
so loading never holds two full copies of the layers.
"""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.models.config import (CorruptCheckpointError, MissingTensorError, ModelConfig,
                                   TensorShapeError, UnsupportedArchitectureError)
from specjax.models.hf_loader import params_from_hf_tensors

GGUF_ARCHS = ("llama", "qwen2")

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")          # model.layers.{i}.<rest>
    i, rest = parts[2], ".".join(parts[3:])
    return f"blk.{i}.{_LAYER[rest]}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: [pairs, 2] -> [2, pairs])."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (inverse of `unpermute_qk`)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path):
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


def config_from_gguf(reader, dtype: str = "float32", scan_layers: bool = True,
                     path=None) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r} in GGUF file {path}: specjax loads "
            f"{', '.join(GGUF_ARCHS)}")
    names = {t.name: t for t in reader.tensors}

    def req(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise CorruptCheckpointError(f"GGUF file {path} lacks metadata key {arch}.{key!s}")
        return v

    D = int(req("embedding_length"))
    H = int(req("attention.head_count"))
    K = int(_field(reader, f"{arch}.attention.head_count_kv", H))
    head_dim = int(_field(reader, f"{arch}.attention.key_length",
                          _field(reader, f"{arch}.rope.dimension_count", D // H)))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        if toks is not None:
            vocab = len(toks.data)
        elif "token_embd.weight" in names:
            vocab = int(names["token_embd.weight"].shape[-1])
        else:
            raise MissingTensorError(f"tensor 'token_embd.weight' is missing from GGUF file {path}")
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedArchitectureError(
                f"unsupported rope scaling {kind!r} in GGUF file {path}")
        scaling = {"rope_type": "linear",
                   "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    if "rope_freqs.weight" in names:
        raise UnsupportedArchitectureError(
            f"GGUF file {path} carries rope_freqs.weight (llama3-style RoPE frequency factors), "
            f"not supported by the GGUF loader; load the Hugging Face checkpoint instead")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=D, num_layers=int(req("block_count")),
        num_heads=H, num_kv_heads=K, head_dim=head_dim,
        ffn_size=int(req("feed_forward_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        dtype=dtype, scan_layers=scan_layers,
        max_position=int(_field(reader, f"{arch}.context_length", 8192)), arch=arch,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos))


def load_gguf(path, dtype: str = "float32", scan_layers: bool = True):
    """(Llama model, params) from a GGUF file (params in ``model.prepare_params`` form)."""
    import gguf
    from specjax.models.llama import Llama

    path = pathlib.Path(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype=dtype, scan_layers=scan_layers, path=path)
    tensors = {t.name: t for t in reader.tensors}
    permute = config.arch == "llama"

    def get(hf_name):
        name = gguf_name(hf_name)
        t = tensors.get(name)
        if t is None:
            raise MissingTensorError(f"tensor {name!r} is missing from GGUF file {path}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot dequantize tensor {name!r} ({t.tensor_type.name}) from {path}: {e}") from e
        arr = np.asarray(arr, np.float32)
        if np.may_share_memory(arr, reader.data):
            arr = arr.copy()            # a view of the mapped file: see the module docstring
        want_rows = int(t.shape[-1]) if len(t.shape) > 1 else None
        if want_rows is not None and arr.ndim == 2 and arr.shape[0] != want_rows:
            raise CorruptCheckpointError(f"tensor {name!r} in {path} decodes to {arr.shape}")
        if permute and arr.ndim == 2 and name.endswith(("attn_q.weight", "attn_k.weight")):
            n = config.num_heads if name.endswith("attn_q.weight") else config.num_kv_heads
            if arr.shape[0] % (2 * n):
                raise TensorShapeError(
                    f"tensor {name!r} has shape {arr.shape}, rows not divisible into {n} heads")
            arr = unpermute_qk(arr, n)
        return arr, name

    model = Llama(config)
    params = params_from_hf_tensors(config, get)
    if not scan_layers:
        params = split_layers_releasing(params)
    return model, model.prepare_params(params)


def split_layers_releasing(params: dict) -> dict:
    """`params` with ``params['layers']`` (a dict of arrays stacked along a leading layer axis)
    turned into a tuple of per-layer dicts, the form `Llama.prepare_params` gives for
    ``scan_layers=False``. Each stacked array is removed from `params` as soon as it is split,
    so at most one stacked tensor kind exists beside the per-layer arrays (`params` is consumed)."""
    stacked = params.pop("layers")
    num_layers = len(next(iter(stacked.values())))
    per_layer: list[dict] = [{} for _ in range(num_layers)]
    for key in list(stacked):
        arr = stacked.pop(key)
        for i in range(num_layers):
            per_layer[i][key] = arr[i]
        del arr
    params["layers"] = tuple(per_layer)
    return params
