"""Every parameter's canonical key, Hugging Face name and GGUF name: one table for the loaders
and the exporter.

Canonical params are what the loaders return and `specjax.models.Llama.prepare_params` starts
from: a dict of the top-level tensors plus ``layers``, a dict of arrays stacked along a leading
layer axis, projections input-major ([in, out], so ``x @ w``). Checkpoints store projections
PyTorch-style ([out, in]); `TENSORS` records, for each tensor, both names and whether it is
transposed on the way in. Which tensors a configuration has, and their shapes, come from
`specjax.models.llama.param_specs`. `assemble` builds canonical params from any checkpoint given a
getter of stored tensors.

llama.cpp's converter stores the Q and K projections of *llama*-architecture models with the
rows of each head interleaved (its RoPE pairs dims 2i, 2i+1 where Hugging Face pairs i, i+hd/2);
`unpermute_qk` undoes that, so the weights match the HF "rotate_half" convention (transformers
does the same when it loads a GGUF). Every other GGUF architecture (qwen2/3, qwen3moe, gemma2/3)
is stored unpermuted.

Experts: a Hugging Face checkpoint stores one tensor per expert ("{j}" in the name), llama.cpp's
converter one merged tensor per layer (``blk.N.ffn_gate_exps.weight``: the experts' [out, in]
matrices stacked along a leading expert axis); `assemble` reads either.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from specjax.models import families
from specjax.models.config import ModelConfig, TensorShapeError
from specjax.models.llama import param_shapes


@dataclasses.dataclass(frozen=True)
class TensorName:
    key: str                 # canonical key: top level, or inside params["layers"] for a layer tensor
    hf: str                  # Hugging Face name; "{i}" stands for the layer index
    gguf: str                # GGUF name; "{i}" stands for the layer index
    transpose: bool          # stored [out, in], canonical [in, out]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf

    def expert(self, j: int) -> "TensorName":
        """The name of expert j's tensor."""
        return dataclasses.replace(self, hf=self.hf.replace("{j}", str(j)), gguf=self.gguf.replace("{j}", str(j)))


_HF = "model.layers.{i}."
TENSORS: tuple[TensorName, ...] = (
    TensorName("embed", "model.embed_tokens.weight", "token_embd.weight", False),
    TensorName("final_norm", "model.norm.weight", "output_norm.weight", False),
    TensorName("lm_head", "lm_head.weight", "output.weight", True),
    TensorName("attn_norm", _HF + "input_layernorm.weight", "blk.{i}.attn_norm.weight", False),
    TensorName("wq", _HF + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", True),
    TensorName("wk", _HF + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", True),
    TensorName("wv", _HF + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", True),
    TensorName("wo", _HF + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True),
    TensorName("bq", _HF + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", False),
    TensorName("bk", _HF + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", False),
    TensorName("bv", _HF + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", False),
    TensorName("mlp_norm", _HF + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", False),
    TensorName("w_gate", _HF + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", True),
    TensorName("w_up", _HF + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", True),
    TensorName("w_down", _HF + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True),
    TensorName("q_norm", _HF + "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", False),
    TensorName("k_norm", _HF + "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", False),
    TensorName("post_attn_norm", _HF + "post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", False),
    TensorName("post_mlp_norm", _HF + "post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight", False),
    # mixture of experts: "{j}" is the expert (stacked along the axis after the layer's); the
    # Hugging Face names are Qwen3-MoE's, Mixtral's come from its family; the GGUF names (one
    # merged tensor [experts, out, in] per layer) are both's
    TensorName("router", _HF + "mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", True),
    TensorName("we_gate", _HF + "mlp.experts.{j}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight", True),
    TensorName("we_up", _HF + "mlp.experts.{j}.up_proj.weight", "blk.{i}.ffn_up_exps.weight", True),
    TensorName("we_down", _HF + "mlp.experts.{j}.down_proj.weight", "blk.{i}.ffn_down_exps.weight", True),
)


def tensor_names(config: ModelConfig) -> tuple[TensorName, ...]:
    """The tensors a model of `config` has: those of `param_specs` (q/k/v biases only with
    ``attention_bias``, an ``lm_head`` only when the head is not tied to the embedding), with
    the Hugging Face names of its family (`specjax.models.families`)."""
    shapes = param_shapes(config)
    renamed = families.get(config.arch).hf_names
    return tuple(dataclasses.replace(t, hf=renamed.get(t.key, t.hf)) for t in TENSORS
                 if t.key in (shapes["layers"] if t.per_layer else shapes))


def assemble(config: ModelConfig, get: Callable[[TensorName, int | None], tuple[np.ndarray, str]],
             merged_experts: bool = False) -> dict:
    """Canonical params (in ``config.dtype``) from a checkpoint.

    ``get(tensor, layer)`` (``layer`` None for a top-level tensor) returns the stored array (HF
    orientation, any float dtype) and the name to show in errors, or raises
    `specjax.models.MissingTensorError`. Shapes are checked against the configuration. Expert
    tensors are asked for one expert at a time (`TensorName.expert`), or with
    ``merged_experts`` once per layer, all experts stacked ([experts, out, in], as GGUF has them).
    """
    dtype = jnp.dtype(config.dtype)
    shapes = param_shapes(config)

    def fetch(t: TensorName, i):
        if t.per_expert and not merged_experts:
            return np.stack([fetch(t.expert(j), i) for j in range(config.num_experts)])
        arr, shown = get(t, i)
        want = shapes["layers"][t.key][1:] if t.per_layer else shapes[t.key]   # canonical [in, out]
        lead = ()
        if t.key.startswith("we_"):                                           # one expert's, after
            lead, want = (want[:1] if merged_experts else ()), want[1:]       # [experts] when merged
        want = lead + (want[::-1] if t.transpose else want)                   # stored [out, in]
        if tuple(arr.shape) != want:
            raise TensorShapeError(
                f"tensor {shown!r} has shape {tuple(arr.shape)}, expected {want} "
                f"for the configuration")
        arr = np.asarray(arr, dtype=np.float32)
        return np.swapaxes(arr, -1, -2) if t.transpose else arr

    params, layers = {}, {}
    for t in tensor_names(config):
        if t.per_layer:
            stacked = np.stack([fetch(t, i) for i in range(config.num_layers)])
            layers[t.key] = jnp.asarray(stacked, dtype)
        else:
            params[t.key] = jnp.asarray(fetch(t, None), dtype)
    params["layers"] = layers
    return params


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: [pairs, 2] -> [2, pairs])."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (inverse of `unpermute_qk`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
