"""Published EAGLE-3 heads in the files other systems read and write.

Two layouts, each a Llama-style ``config.json`` beside the tensors (``model.safetensors``,
sharded safetensors with their index, or the reference's ``pytorch_model.bin``, read when torch
is installed); matrices are stored as torch writes them, [out, in]:

* ``"eagle"``: what the reference code (github SafeAILab/EAGLE, eagle/model/cnets.py `Model`)
  and SpecForge (`LlamaForCausalLMEagle3`) save. config.json is the one layer's LlamaConfig with
  ``architectures`` ["LlamaForCausalLMEagle3"], ``draft_vocab_size``, ``target_hidden_size`` and,
  from SGLang and SpecForge, ``eagle_config`` = {``eagle_aux_hidden_state_layer_ids``,
  ``use_aux_hidden_state``}. Tensors: ``fc.weight``; ``midlayer.input_layernorm.weight`` (the
  embedding's norm), ``midlayer.hidden_norm.weight`` (the fused feature's),
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.post_attention_layernorm.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``; ``norm.weight``; ``lm_head.weight`` [draft
  vocab, D]; ``d2t`` (int64 [draft vocab]: draft row i is target token ``i + d2t[i]``) and
  ``t2d`` (bool [target vocab]: the target tokens in the draft vocabulary); and
  ``embed_tokens.weight`` where the file carries the (frozen, the target's) embedding: the
  reference's module holds one, SpecForge's training checkpoints leave it out and its HF export
  writes it.
* ``"speculators"``: vLLM's speculators library (github vllm-project/speculators,
  `Eagle3SpeculatorConfig`): config.json with ``speculators_model_type`` "eagle3",
  ``speculators_config`` (algorithm, proposal methods, verifier), the layer's LlamaConfig as
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and the switches of its variants (``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``: all false is the published layer; vLLM reads a
  missing ``norm_before_residual`` as true, so it is always written). Tensors as above with
  ``layers.0.`` in place of ``midlayer.``.

Capture layers. Specjax numbers a feature by the layer whose output it is (0-based;
`HeadConfig.feature_layers`; Hugging Face's ``output_hidden_states[i + 1]``). The engines differ
by one:

* the reference code, and SGLang and vLLM by default, capture the *inputs* of layers 2, L // 2 and
  L - 3, i.e. specjax's (1, L//2 - 1, L - 4), the published head's default;
* SGLang / SpecForge's ``eagle_config.eagle_aux_hidden_state_layer_ids`` are layer *outputs*:
  specjax's numbers (SGLang adds one to get the layer whose input it keeps);
* vLLM's and speculators' ``eagle_aux_hidden_state_layer_ids`` are layer *inputs* (Hugging Face
  hidden-state indices): specjax's number + 1.

Every engine concatenates the three in ascending layer order. An "eagle" file is written with
both keys (``eagle_config``'s for SGLang, the top-level one for vLLM); reading, ``eagle_config``
wins and the two must agree.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.heads import _eagle3_layer
from specjax.drafters.heads._config import HeadConfig, head_params
from specjax.drafters.heads._eagle3_published import EAGLE3_PUBLISHED, EAGLE3_PUBLISHED_KIND
from specjax.drafters.heads._runtime import EagleHead, FeatureHeadDrafter
from specjax.models import ModelConfig, families
from specjax.models.config import (CheckpointError, CorruptCheckpointError, MissingTensorError, TensorShapeError,
                                   UnsupportedArchitectureError)
from specjax.models.export import write_directory
from specjax.models.reduced_head import check_draft_vocab_maps

LAYOUTS = ("eagle", "speculators")
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WRITE_DTYPES = ("float32", "bfloat16", "float16")
_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
# the layer's parameters (`_eagle3`) -> their names under the layer's prefix
_LAYER_NAMES = {"embed_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
                "mlp_norm": "post_attention_layernorm.weight", "wq": "self_attn.q_proj.weight",
                "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
                "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
# speculators' variants of the layer: each flag true is not the published layer
_SPECULATORS_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def _config(directory: pathlib.Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json (not an EAGLE-3 head directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(cfg).__name__}, not a config object")
    return cfg


def eagle3_layout(directory) -> str | None:
    """The layout (`LAYOUTS`) of a directory holding an EAGLE-3 head written by another system,
    by its config.json; None when it holds none (e.g. a specjax head.json directory)."""
    try:
        cfg = _config(pathlib.Path(directory))
    except CheckpointError:
        return None
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        return "speculators"
    archs = cfg.get("architectures") or []
    if "draft_vocab_size" in cfg or any("Eagle3" in str(a) for a in archs):
        return "eagle"
    return None


def _layer_config(cfg: dict, where, target: ModelConfig) -> ModelConfig:
    """The head layer's `ModelConfig` from its LlamaConfig entries (refusing what the published
    layer does not have)."""
    if not isinstance(cfg, dict):
        raise CorruptCheckpointError(f"{where}: the layer's config is a {type(cfg).__name__}, not an object")
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise UnsupportedArchitectureError(f"{where}: a {model_type!r} draft layer; the published EAGLE-3 layer is "
                                           f"a Llama layer (model_type 'llama')")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise UnsupportedArchitectureError(f"{where}: num_hidden_layers={cfg['num_hidden_layers']}; the published "
                                           f"EAGLE-3 head has one layer")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if cfg.get(key):
            raise UnsupportedArchitectureError(f"{where}: {key}=true; the published EAGLE-3 layer has none")
    if "sliding_attention" in (cfg.get("layer_types") or []):
        raise UnsupportedArchitectureError(f"{where}: a sliding-window draft layer; the published one attends to "
                                           f"the whole prefix")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedArchitectureError(f"{where}: hidden_act={cfg['hidden_act']!r}; the published layer's MLP "
                                           f"is SwiGLU (silu)")
    try:
        H, D = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        theta, scaling = families.rope_from_hf(cfg.get("rope_parameters"), cfg)
        return ModelConfig(vocab_size=target.vocab_size, hidden_size=D, num_layers=1, num_heads=H,
                           num_kv_heads=int(cfg.get("num_key_value_heads") or H),
                           head_dim=int(cfg.get("head_dim") or D // H),
                           ffn_size=int(cfg["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
                           rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), dtype=target.dtype,
                           max_position=int(cfg.get("max_position_embeddings", 8192)))
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CorruptCheckpointError(f"{where}: incomplete or invalid layer config ({e!r})") from None


def _integers(value, key: str, where) -> list[int]:
    """A config's list of integer ids, exactly: `CorruptCheckpointError` naming the key and the
    first value that is not an integer (``1.5`` was truncated to 1, ``"2"`` parsed, ``true``
    read as 1)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise CorruptCheckpointError(f"{where}: {key}={value!r} must be a list of integers")
    items = list(value)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise CorruptCheckpointError(f"{where}: {key}={items!r} must be a list of integers ({i!r} is not one)")
    return [int(i) for i in items]


def _positive_int(cfg: dict, key: str, where) -> int | None:
    """``cfg[key]`` as an integer >= 1 (None when absent or null); `CorruptCheckpointError`
    naming the key and value otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise CorruptCheckpointError(f"{where}: {key}={value!r} must be an integer >= 1")
    return int(value)


def _capture_layers(cfg: dict, layout: str, num_layers: int, where) -> tuple[int, ...]:
    """The target layers the head reads, in specjax's numbering (module doc)."""
    eagle_config = cfg.get("eagle_config") if layout == "eagle" else None
    outputs = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    inputs = cfg.get("eagle_aux_hidden_state_layer_ids")
    if outputs is not None:               # SGLang / SpecForge: layer outputs
        ids = _integers(outputs, "eagle_config.eagle_aux_hidden_state_layer_ids", where)
        if inputs is not None:
            vllm = _integers(inputs, "eagle_aux_hidden_state_layer_ids", where)
            if sorted(i - 1 for i in vllm) != sorted(ids):
                raise CorruptCheckpointError(
                    f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {ids} (layer outputs, SGLang) and "
                    f"eagle_aux_hidden_state_layer_ids {vllm} (layer inputs, vLLM: outputs {[i - 1 for i in vllm]}) "
                    f"name different layers")
    elif inputs is not None:              # vLLM / speculators: layer inputs
        ids = [i - 1 for i in _integers(inputs, "eagle_aux_hidden_state_layer_ids", where)]
    else:                                 # the reference's and the engines' default
        ids = list(EAGLE3_PUBLISHED_KIND.default_feature_layers(num_layers))
    ids = sorted(ids)
    if len(ids) != 3 or len(set(ids)) != 3 or ids[0] < 0 or ids[-1] >= num_layers:
        raise UnsupportedArchitectureError(
            f"{where}: capture layers {ids} (specjax numbering: outputs of 0-based layers; -1 would be the "
            f"embedding, vLLM's id 0) are not three distinct layers of this {num_layers}-layer target")
    return tuple(ids)


def _tensors(directory: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, pathlib.Path]]:
    """(name -> array, name -> the file it came from) of every tensor in the directory."""
    arrays, where = {}, {}
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"cannot parse {index}: {e!r}") from None
    else:
        files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors import safe_open
        for f in files:
            if not f.is_file():
                raise MissingTensorError(f"{index}: shard file {f} does not exist")
            try:
                with safe_open(str(f), framework="numpy") as h:
                    for name in h.keys():
                        arrays[name], where[name] = h.get_tensor(name), f
            except Exception as e:  # safetensors raises SafetensorError / OSError
                raise CorruptCheckpointError(f"cannot read safetensors file {f} (truncated or corrupt?): {e}") from e
        return arrays, where
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise MissingTensorError(f"{directory} holds no model.safetensors / *.safetensors / pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{bins[0]}: reading a pytorch_model.bin needs torch (pip install torch), or "
                              f"convert the file to safetensors") from None
    for f in bins:
        try:
            state = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read {f} (truncated or corrupt?): {e}") from e
        for name, t in state.items():
            arrays[name] = (t.float() if t.is_floating_point() else t).numpy()
            where[name] = f
    return arrays, where


def read_eagle3(directory, target: ModelConfig, *, dtype: str | None = None,
                feature_layers: tuple[int, ...] | None = None) -> tuple[HeadConfig, dict, np.ndarray | None]:
    """(head config, own parameters, the file's embedding or None) of an EAGLE-3 head in either
    layout, for ``target`` (its config). Checked: the layout, the layer (the published one, or
    `UnsupportedArchitectureError` naming the option), the target's vocabulary and width, every
    tensor's presence and shape (naming the tensor and file), and the vocabulary maps
    (`check_draft_vocab_maps`: `CorruptCheckpointError` naming the file). ``feature_layers``
    overrides the file's capture layers (specjax numbering)."""
    d = pathlib.Path(directory)
    layout = eagle3_layout(d)
    cfg_path = d / "config.json"
    if layout is None:
        cfg = _config(d)       # raises when missing or broken
        raise CheckpointError(f"{cfg_path} describes no EAGLE-3 head: neither the EAGLE / SpecForge layout "
                              f"(draft_vocab_size, architectures {EAGLE_ARCHITECTURE}) nor speculators' "
                              f"(speculators_config); architectures {cfg.get('architectures')!r}")
    cfg = _config(d)
    if layout == "speculators":
        if cfg.get("speculators_model_type") != "eagle3":
            raise UnsupportedArchitectureError(f"{cfg_path}: speculators_model_type "
                                               f"{cfg.get('speculators_model_type')!r}; specjax reads 'eagle3'")
        for flag in _SPECULATORS_VARIANTS:
            if cfg.get(flag):
                raise UnsupportedArchitectureError(f"{cfg_path}: {flag}=true is a speculators variant, not the "
                                                   f"published EAGLE-3 layer (specjax runs the published one)")
        layer_cfg = cfg.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise CorruptCheckpointError(f"{cfg_path}: no transformer_layer_config object")
    else:
        if cfg.get("fc_norm") or cfg.get("norm_before_residual"):
            flag = "fc_norm" if cfg.get("fc_norm") else "norm_before_residual"
            raise UnsupportedArchitectureError(f"{cfg_path}: {flag}=true is a variant, not the published "
                                               f"EAGLE-3 layer (specjax runs the published one)")
        if cfg.get("norm_output", True) is False:
            raise UnsupportedArchitectureError(f"{cfg_path}: norm_output=false (SpecForge: logits of the un-normed "
                                               f"output) is a variant, not the published EAGLE-3 head")
        layer_cfg = cfg
    V, Dt = target.vocab_size, target.hidden_size
    vocab = _positive_int(layer_cfg, "vocab_size", cfg_path)
    if vocab is not None and vocab != V:
        raise ValueError(f"{cfg_path}: a head for a target vocabulary of {vocab} tokens; this target has {V}")
    S = _positive_int(cfg, "draft_vocab_size", cfg_path) or V
    if S > V:
        raise CorruptCheckpointError(f"{cfg_path}: draft_vocab_size={S} is larger than the target's vocabulary ({V})")
    width = _positive_int(cfg, "target_hidden_size", cfg_path)
    if width is not None and width != Dt:
        raise ValueError(f"{cfg_path}: a head for a target of width {width}; this target has {Dt}")
    lc = _layer_config(layer_cfg, cfg_path, target)
    if lc.hidden_size != Dt:
        raise UnsupportedArchitectureError(f"{cfg_path}: the head's width {lc.hidden_size} differs from the target's "
                                           f"{Dt}; specjax runs heads that read the target's embedding")
    layers = (_capture_layers(cfg, layout, target.num_layers, cfg_path) if feature_layers is None
              else tuple(int(i) for i in feature_layers))

    arrays, where = _tensors(d)
    prefix = _PREFIX[layout]
    shapes = _eagle3_layer.layer_shapes(lc)
    want = {"fc.weight": (lc.hidden_size, 3 * Dt), "norm.weight": (lc.hidden_size,),
            "lm_head.weight": (S, lc.hidden_size)}
    for n, file_name in _LAYER_NAMES.items():
        want[prefix + file_name] = tuple(reversed(shapes[n]))
    optional = {"d2t": None, "t2d": None, "embed_tokens.weight": (V, lc.hidden_size)}
    unknown = sorted(set(arrays) - set(want) - set(optional))
    if unknown:
        raise UnsupportedArchitectureError(f"{d}: tensors {unknown[:6]} are not part of the published EAGLE-3 head "
                                           f"(a variant or a multi-layer head?)")
    missing = sorted(set(want) - set(arrays))
    if missing:
        raise MissingTensorError(f"{d}: the EAGLE-3 head lacks the tensors {missing}")
    for name, shape in {**want, "embed_tokens.weight": optional["embed_tokens.weight"]}.items():
        if name in arrays and tuple(arrays[name].shape) != shape:
            raise TensorShapeError(f"{where[name]}: tensor {name!r} has shape {tuple(arrays[name].shape)}, this head "
                                   f"for this target needs {shape}")
    if "d2t" in arrays:
        ids = check_draft_vocab_maps(arrays["d2t"], arrays.get("t2d"), V, S, str(where["d2t"]))
    elif S == V:
        ids = np.arange(V, dtype=np.int64)
        if "t2d" in arrays:
            check_draft_vocab_maps(np.zeros(S, np.int64), arrays["t2d"], V, S, str(where["t2d"]))
    else:
        raise MissingTensorError(f"{d}: no 'd2t' tensor, yet the draft vocabulary ({S} rows) is smaller than the "
                                 f"target's ({V}): the file does not say which tokens its rows are")

    compute = jnp.dtype(dtype or target.dtype)
    f = lambda name: jnp.asarray(np.asarray(arrays[name], np.float32), compute)  # noqa: E731
    layer = {n: (f(prefix + file_name).T if len(shapes[n]) == 2 else f(prefix + file_name))
             for n, file_name in _LAYER_NAMES.items()}
    own = {"fc": f("fc.weight").T, "layer": layer, "norm": f("norm.weight"), "lm_head": f("lm_head.weight"),
           "head_ids": jnp.asarray(ids, jnp.int32)}
    hc = HeadConfig.make(EAGLE3_PUBLISHED, target, head_size=S, feature_layers=layers,
                         layer=None if lc == _eagle3_layer.default_layer(target) else lc)
    return hc, own, arrays.get("embed_tokens.weight")


def load_eagle3(directory, target, target_params, *, dtype: str | None = None,
                feature_layers: tuple[int, ...] | None = None):
    """(drafter, params) of an EAGLE-3 head in either layout (`read_eagle3`), drafting through
    the engine like any head (`FeatureHeadDrafter`). A file's embedding equal to the target's
    (after casting the target's to the file's dtype) is dropped for the target's; one that
    differs becomes the head's own (`HeadConfig.own_embedding`)."""
    hc, own, embed = read_eagle3(directory, target.config, dtype=dtype, feature_layers=feature_layers)
    if embed is not None:
        mine = np.asarray(jax.device_get(target_params["embed"]))
        if not np.array_equal(mine.astype(embed.dtype), embed):
            hc = dataclasses.replace(hc, own_embedding=True)
            own["embed"] = jnp.asarray(np.asarray(embed, np.float32), jnp.dtype(dtype or target.config.dtype))
    return FeatureHeadDrafter(EagleHead(hc)), head_params(hc, own, target_params)


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------
def _llama_config(lc: ModelConfig, dtype: str) -> dict:
    scaling = lc.rope_scaling_dict
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"model_type": "llama", "hidden_size": lc.hidden_size, "intermediate_size": lc.ffn_size,
            "num_attention_heads": lc.num_heads, "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": lc.rms_eps,
            "max_position_embeddings": lc.max_position, "rope_theta": lc.rope_theta, "rope_scaling": scaling or None,
            "vocab_size": lc.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": dtype}


def eagle3_config(hc: HeadConfig, layout: str, *, dtype: str = "float32", verifier: str = "",
                  speculative_tokens: int = 3, include_embedding: bool = True) -> dict:
    """The config.json of a published EAGLE-3 head in `layout` (module doc). In the "eagle"
    layout ``target_hidden_size`` is written only with the embedding (``include_embedding``):
    the reference code (cnets.py `Model`, ``load_emb``) loads the target's embedding only when
    the key is absent, and otherwise expects ``embed_tokens.weight`` in the head's own file (a
    file without either would run with a random embedding). The head's width is the target's,
    so the key adds nothing else."""
    lc, t = hc.layer_config, hc.target
    layers = [int(i) for i in hc.feature_layers]
    if layout == "eagle":
        cfg = {"architectures": [EAGLE_ARCHITECTURE], **_llama_config(lc, dtype), "draft_vocab_size": hc.head_size,
               **({"target_hidden_size": t.hidden_size} if include_embedding else {}),
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers]}
    else:
        cfg = {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
               "speculators_config": {
                   "algorithm": "eagle3",
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                   "default_proposal_method": "greedy",
                   "verifier": {"name_or_path": verifier or None,
                                "architectures": [families.get(t.arch).hf_architectures[0]]}},
               "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_llama_config(lc, dtype)},
               "draft_vocab_size": hc.head_size, "target_hidden_size": t.hidden_size,
               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
               **{flag: False for flag in _SPECULATORS_VARIANTS}, "embed_requires_grad": False, "torch_dtype": dtype}
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(t, key)
        if value is not None:
            cfg[key] = list(value) if isinstance(value, tuple) else value
    return cfg


def eagle3_tensors(hc: HeadConfig, own: dict, layout: str, embed=None) -> dict[str, np.ndarray]:
    """The head's tensors under the layout's names ([out, in] matrices; d2t int64, t2d bool);
    ``embed``: an embedding to store as ``embed_tokens.weight`` (None: none). The draft
    vocabulary is written in ascending token order (the LM head's rows permuted with it: the
    same head), so ``d2t`` is >= 0 and non-decreasing, as SpecForge and the reference make and
    check it; a head built in code may hold its vocabulary in any order."""
    f = lambda x: np.asarray(jax.device_get(x), np.float32)  # noqa: E731
    prefix = _PREFIX[layout]
    shapes = _eagle3_layer.layer_shapes(hc.layer_config)
    ids = np.asarray(jax.device_get(own["head_ids"]), np.int64)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    out = {"fc.weight": f(own["fc"]).T, "norm.weight": f(own["norm"]), "lm_head.weight": f(own["lm_head"])[order]}
    for n, file_name in _LAYER_NAMES.items():
        w = f(own["layer"][n])
        out[prefix + file_name] = w.T if len(shapes[n]) == 2 else w
    out["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(hc.target.vocab_size, bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if embed is not None:
        out["embed_tokens.weight"] = f(embed)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_eagle3(directory, hc: HeadConfig, own: dict, target_params: dict | None = None, *, layout: str = "eagle",
                dtype: str = "float32", include_embedding: bool = True, verifier: str = "",
                speculative_tokens: int = 3) -> dict:
    """Write a published EAGLE-3 head (`HeadConfig` kind ``eagle3_published`` and its own
    parameters) in `layout` into `directory` (absent or empty; written into a temporary
    directory and renamed into place): config.json + model.safetensors, floats in `dtype`.
    ``include_embedding`` stores ``embed_tokens.weight`` (the head's own, else the target's from
    ``target_params``), so that loaders that want it (SpecForge's, speculators') find it;
    ``verifier``: the target's name or path, recorded in speculators_config. Returns the config."""
    import ml_dtypes
    from safetensors.numpy import save_file

    if hc.kind != EAGLE3_PUBLISHED:
        raise ValueError(f"only {EAGLE3_PUBLISHED} heads have these layouts, not {hc.kind!r} "
                         f"(save it with drafters.save_head)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(WRITE_DTYPES)}")
    embed = None
    if include_embedding:
        if hc.own_embedding:
            embed = own["embed"]
        elif target_params is None:
            raise ValueError("include_embedding=True needs target_params (the target's embedding is written)")
        else:
            embed = target_params["embed"]
    cfg = eagle3_config(hc, layout, dtype=dtype, verifier=verifier, speculative_tokens=speculative_tokens,
                        include_embedding=include_embedding)
    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {k: (v.astype(cast) if v.dtype.kind == "f" else v)
               for k, v in eagle3_tensors(hc, own, layout, embed).items()}
    nonfinite = [k for k, v in tensors.items() if v.dtype.kind == "f" and not np.all(np.isfinite(v.astype(np.float32)))]
    if nonfinite:
        raise FloatingPointError(f"not writing {directory}: tensors {nonfinite} are not finite in {dtype}")

    def write(tmp):
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    write_directory(pathlib.Path(directory), write)
    return cfg
