"""Read a Hugging Face checkpoint directory (config.json + safetensors): its `ModelConfig` and
canonical params.

Reads every architecture of `specjax.models.families` (by ``architectures``, else by
``model_type``), single-file ``model.safetensors`` or sharded via ``model.safetensors.index.json``.
Tensors are found by their Hugging Face names (`specjax.models.names`).

Which files hold the weights (`_SafetensorsDir`), as transformers decides and never by guessing:

* ``model.safetensors`` when it exists: only that file (another ``*.safetensors`` beside it, a
  stale copy, is not read; transformers reads ``model.safetensors`` first, too);
* else ``model.safetensors.index.json``: its ``weight_map`` (a JSON object of tensor name ->
  file name); a tensor listed twice, or a ``weight_map`` that is not such an object, is refused;
* else every ``*.safetensors`` in the directory, and a tensor found in two of them is refused
  naming both files (no file silently wins).

A checkpoint holding layers beyond ``num_hidden_layers`` is refused naming the count and the
layers found (a model read with fewer layers than its weights describe is truncated, not the
checkpoint's). A setting out of range (`specjax.models.config.check_settings`) is refused
naming config.json's own key, its value and the file.
"""

from __future__ import annotations

import json
import pathlib
import re

from specjax.models import families
from specjax.models.config import (ConfigValueError, CorruptCheckpointError, MissingTensorError,
                                   ModelConfig, TensorShapeError, check_settings,
                                   refuse_extra_layers)
from specjax.models.names import TensorName, assemble



# ---------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------
def config_from_hf(cfg: dict, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The model's configuration from a parsed config.json (layout fields at their defaults):
    the entries every family shares here, the family's own from `specjax.models.families`.

    A setting out of range (`specjax.models.config.check_settings`: a count < 1, a RoPE base or
    factor <= 0, a negative or NaN ``rms_norm_eps``, ...) is a `CorruptCheckpointError` naming
    config.json's key, its value and ``where`` (the file), raised before any tensor is read;
    the counts a later entry divides by are checked first (no ZeroDivisionError)."""
    try:
        family = families.for_hf_config(cfg)
        H = int(cfg["num_attention_heads"])
        D = int(cfg["hidden_size"])
        check_settings({"hidden_size": D, "num_heads": H})
        # (an explicit head_dim or num_key_value_heads of 0 is refused, not replaced: transformers
        # falls back to hidden_size // heads and to the query heads only when the key is absent or null)
        head_dim = D // H if cfg.get("head_dim") is None else int(cfg["head_dim"])
        K = H if cfg.get("num_key_value_heads") is None else int(cfg["num_key_value_heads"])
        # transformers 5 writes RoPE settings as `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        theta, scaling = families.rope_from_hf(cfg.get("rope_parameters"), cfg)
        fields = dict(
            vocab_size=int(cfg["vocab_size"]), hidden_size=D, num_layers=int(cfg["num_hidden_layers"]),
            num_heads=H, num_kv_heads=K, head_dim=head_dim,
            ffn_size=int(cfg["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype, max_position=int(cfg.get("max_position_embeddings", 8192)), arch=family.name,
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
        # (a family may replace head_dim, ffn_size and the RoPE: those are checked in ModelConfig)
        check_settings({k: v for k, v in fields.items() if k not in ("head_dim", "ffn_size", "rope_theta",
                                                                      "rope_scaling")})
        fields.update(family.read_config(cfg))
        return ModelConfig(**fields)
    except ConfigValueError as e:
        raise CorruptCheckpointError(f"{_hf_key(cfg, e.field)}={e.shown} in {where}: {e.rule}") from e


def _hf_key(cfg: dict, field: str) -> str:
    """config.json's key of a `ModelConfig` field (a key a family reader named: itself)."""
    rope = cfg.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    prefix = "rope_parameters."
    if "full_attention" in rope or "sliding_attention" in rope:          # Gemma 3, transformers 5
        if field == "local_rope_theta":
            return "rope_parameters.sliding_attention.rope_theta"
        prefix, rope = "rope_parameters.full_attention.", rope.get("full_attention") or {}
    if field == "rope_theta":
        return prefix + "rope_theta" if "rope_theta" in rope else "rope_theta"
    if field.startswith("rope_scaling."):
        key = field.split(".", 1)[1]
        return prefix + key if rope.get("rope_type", rope.get("type", "default")) != "default" else field
    if field == "head_dim" and cfg.get("head_dim") is None:
        return "head_dim (hidden_size // num_attention_heads)"
    if field == "num_kv_heads" and cfg.get("num_key_value_heads") is None:
        return "num_attention_heads"
    if field == "ffn_size" and cfg.get("moe_intermediate_size") is not None:
        return "moe_intermediate_size"
    if field == "num_experts":
        return "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    return {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "ffn_size": "intermediate_size", "rms_eps": "rms_norm_eps",
            "experts_per_token": "num_experts_per_tok", "local_rope_theta": "rope_local_base_freq",
            "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping",
            "max_position": "max_position_embeddings"}.get(field, field)


# ---------------------------------------------------------------------------------------
# safetensors reading
# ---------------------------------------------------------------------------------------
def _no_duplicate_keys(where):
    """A json ``object_pairs_hook``: an object naming a key twice is refused naming the key."""
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CorruptCheckpointError(f"{where} lists {k!r} twice (a JSON object with a duplicate key): "
                                             f"which entry holds it is ambiguous")
            seen[k] = v
        return seen
    return hook


def weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files a load of checkpoint directory ``directory`` reads, by `_SafetensorsDir`'s rule,
    without opening any: ``model.safetensors``; else the index and the files it names; else
    every ``*.safetensors``. (What a digest of "the target's weights" should cover.)"""
    directory = pathlib.Path(directory)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (ValueError, AttributeError):
            return [index]
        names = sorted({f for f in weight_map.values() if isinstance(f, str)}) if isinstance(weight_map, dict) else []
        return [index] + [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


class _SafetensorsDir:
    """The tensors of a checkpoint directory and the file holding each (the rule is the module
    docstring's: ``model.safetensors``, else the index, else every ``*.safetensors`` with no
    tensor in two files)."""

    def __init__(self, directory: pathlib.Path):
        from safetensors import safe_open
        self._safe_open = safe_open
        self.dir = directory
        self._handles = {}
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        self.where: dict[str, pathlib.Path] = {}
        if single.is_file():
            for name in self._open(single).keys():
                self.where[name] = single
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text(), object_pairs_hook=_no_duplicate_keys(index))["weight_map"]
            except CorruptCheckpointError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"cannot parse {index}: {type(e).__name__}: {e}") from e
            if not isinstance(weight_map, dict):
                raise CorruptCheckpointError(
                    f"{index}: weight_map is a {type(weight_map).__name__}, not an object of tensor name -> file name")
            for name, fname in weight_map.items():
                if not isinstance(fname, str):
                    raise CorruptCheckpointError(
                        f"{index}: weight_map[{name!r}] is {fname!r}, not a file name")
                self.where[name] = directory / fname
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise MissingTensorError(f"no *.safetensors file in {directory}")
            for f in files:
                for name in self._open(f).keys():
                    if name in self.where:
                        raise CorruptCheckpointError(
                            f"tensor {name!r} is in both {self.where[name].name} and {f.name} in {directory} "
                            f"(no model.safetensors, no model.safetensors.index.json to say which is the "
                            f"checkpoint's): remove the stale copy or add an index")
                    self.where[name] = f

    def layers_beyond(self, num_layers: int) -> None:
        """Refuse tensors of layers >= ``num_layers`` (``model.layers.{i}.``): a CorruptCheckpointError
        naming config.json's count and the layers found."""
        refuse_extra_layers(self.where, _HF_LAYER, num_layers, f"num_hidden_layers={num_layers} in "
                             f"{self.dir / 'config.json'}", f"the checkpoint in {self.dir}")

    def _open(self, f: pathlib.Path):
        if f not in self._handles:
            try:
                # "flax" gives jax arrays, which (unlike numpy) carry bfloat16.
                self._handles[f] = self._safe_open(str(f), framework="flax")
            except Exception as e:  # safetensors raises SafetensorError / OSError
                raise CorruptCheckpointError(
                    f"cannot read safetensors file {f} (truncated or corrupt?): {e}") from e
        return self._handles[f]

    def file_of(self, name: str) -> pathlib.Path:
        """The file holding tensor ``name`` (MissingTensorError naming it when absent)."""
        f = self.where.get(name)
        if f is None:
            raise MissingTensorError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        if not f.is_file():
            raise MissingTensorError(f"tensor {name!r}: shard file {f} does not exist")
        return f

    def get(self, name: str):
        f = self.file_of(name)
        try:
            arr = self._open(f).get_tensor(name)
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from e
        return arr, name


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_hf(path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(config, canonical params) from a Hugging Face checkpoint directory."""
    directory = pathlib.Path(path)
    config = read_config(directory, dtype=dtype)
    store = _SafetensorsDir(directory)
    store.layers_beyond(config.num_layers)
    if config.tie_embeddings is False and "lm_head.weight" not in store.where:
        # Some checkpoints say untied but ship no head; fail loudly rather than guess.
        raise MissingTensorError(
            f"tensor 'lm_head.weight' is missing from the checkpoint in {directory} "
            f"(config says tie_word_embeddings=false)")

    def get(t: TensorName, i):
        return store.get(t.hf.format(i=i))

    return config, assemble(config, get)


# ---------------------------------------------------------------------------------------
# Reading straight onto devices, slice by slice
# ---------------------------------------------------------------------------------------
def read_config(path, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face checkpoint directory (no tensor read): a file that is
    not JSON, or not a model config, is a CorruptCheckpointError naming it; a setting the
    decoder cannot run is the ValueError of `ModelConfig` or the family naming it."""
    cfg_path = pathlib.Path(path) / "config.json"
    if not cfg_path.is_file():
        raise MissingTensorError(f"{path} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CorruptCheckpointError(f"cannot parse {cfg_path}: {e}") from e
    try:
        return config_from_hf(cfg, dtype=dtype, where=str(cfg_path))
    except (KeyError, TypeError, AttributeError) as e:   # a key missing or null, not a JSON object
        raise CorruptCheckpointError(f"{cfg_path} is not a model config: {type(e).__name__}: {e}") from e


def _slice_reader(store: "_SafetensorsDir", config: ModelConfig, t: TensorName, shape: tuple, dtype):
    """``read(index) -> np.ndarray``: the canonical tensor's block at ``index`` (a tuple of
    slices over ``shape``), read from the stored tensors' matching slices only (stored
    [out, in] where canonical is [in, out]; layers and experts stacked in front)."""
    import numpy as np

    lead = (1 if t.per_layer else 0) + (1 if t.per_expert else 0)
    stored_shape = shape[lead:][::-1] if t.transpose else shape[lead:]

    import jax
    cpu = jax.local_devices(backend="cpu")[0]

    def one(name: str, inner):
        f = store.file_of(name)
        try:
            sl = store._open(f).get_slice(name)
            got = tuple(sl.get_shape())
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from e
        if got != tuple(stored_shape):
            raise TensorShapeError(f"tensor {name!r} has shape {got}, expected {tuple(stored_shape)} "
                                   f"for the configuration")
        with jax.default_device(cpu):          # the slice stays in host memory (not via an accelerator)
            block = np.asarray(sl[tuple(inner[::-1]) if t.transpose else tuple(inner)])
        block = block.T if t.transpose else block
        return block.astype(dtype, copy=False)

    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        inner = index[lead:]
        if not lead:
            return one(t.hf, inner)
        layers = range(shape[0])[index[0]]
        if t.per_expert:
            experts = range(shape[1])[index[1]]
            return np.stack([np.stack([one(t.expert(j).hf.format(i=i), inner) for j in experts]) for i in layers])
        return np.stack([one(t.hf.format(i=i), inner) for i in layers])

    return read


def read_hf_placed(path, sharding_of, dtype: str = "bfloat16") -> tuple[ModelConfig, dict]:
    """(config, canonical params) of a Hugging Face checkpoint, each tensor placed as it is read:
    ``sharding_of(key, shape, logical_axes)`` gives its `jax.sharding.Sharding` and every device
    receives its block, read from the files slice by slice (`jax.make_array_from_callback`), so
    the host never holds a whole tensor of a sharded dimension, let alone the checkpoint. Stored
    bfloat16 stays bfloat16 when ``dtype`` is bfloat16 (no float32 copy); single-file or
    ``model-0000i-of-0000n.safetensors`` + index. The layout is the canonical one (stacked
    layers: ``scan_layers=True``), the accelerator profile."""
    import jax
    import jax.numpy as jnp

    from specjax.models.llama import param_specs
    from specjax.models.names import tensor_names

    directory = pathlib.Path(path)
    config = read_config(directory, dtype=dtype)
    store = _SafetensorsDir(directory)
    store.layers_beyond(config.num_layers)
    if config.tie_embeddings is False and "lm_head.weight" not in store.where:
        raise MissingTensorError(f"tensor 'lm_head.weight' is missing from the checkpoint in {directory} "
                                 f"(config says tie_word_embeddings=false)")
    specs = param_specs(config)
    np_dtype = jnp.dtype(config.dtype)
    params, layers = {}, {}
    for t in tensor_names(config):
        shape, axes, _ = specs["layers"][t.key] if t.per_layer else specs[t.key]
        read = _slice_reader(store, config, t, shape, np_dtype)
        arr = jax.make_array_from_callback(shape, sharding_of(t.key, shape, axes), read)
        (layers if t.per_layer else params)[t.key] = arr
    params["layers"] = layers
    return config, params
