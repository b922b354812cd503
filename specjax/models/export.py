"""Write a specjax model as a Hugging Face checkpoint directory (config.json + safetensors).

The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` as the
family's class (`specjax.models.families`: LlamaForCausalLM for arch "llama", ...), and with
`specjax.models.load` again. `write_directory` writes a whole checkpoint directory into a
temporary directory beside the destination and renames it into place at the end (the command
line's `specjax export`), so a full disk never leaves a partial checkpoint behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp

from specjax.models import families
from specjax.models.config import ModelConfig
from specjax.models.llama import canonical_params
from specjax.models.names import tensor_names

def hf_config_dict(config: ModelConfig) -> dict:
    """config.json for `config`: the entries every family shares, then the family's own."""
    family = families.check_expressible(config)
    d = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.model_types[0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[config.mlp_activation],
        "max_position_embeddings": config.max_position,
        "rms_norm_eps": float(config.rms_eps),
        "rope_parameters": families.rope_to_hf(config.rope_theta, config.rope_scaling_dict),
        "tie_word_embeddings": bool(config.tie_embeddings),
        "dtype": config.dtype,
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    d.update(family.write_config(config))
    if config.bos_token_id is not None:
        d["bos_token_id"] = config.bos_token_id
    if config.eos_token_id is not None:
        eos = config.eos_token_id
        d["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    return d


def hf_state_dict(config: ModelConfig, params) -> dict[str, jax.Array]:
    """HF tensor name -> array in PyTorch [out, in] orientation (params dtype)."""
    p = canonical_params(params, config)
    out = {}
    for t in tensor_names(config):
        if t.per_expert:
            arr = p["layers"][t.key]
            for i in range(config.num_layers):
                for j in range(config.num_experts):
                    out[t.expert(j).hf.format(i=i)] = arr[i, j].T if t.transpose else arr[i, j]
        elif t.per_layer:
            arr = p["layers"][t.key]
            for i in range(config.num_layers):
                out[t.hf.format(i=i)] = arr[i].T if t.transpose else arr[i]
        else:
            out[t.hf] = p[t.key].T if t.transpose else p[t.key]
    return out


class ExportError(RuntimeError):
    """A checkpoint directory that could not be written (full disk, no permission); the
    destination was left as it was."""


def write_tensors(tensors: dict, path) -> None:
    """Write `tensors` (HF name -> array) as one safetensors file at `path`."""
    from safetensors.flax import save_file
    save_file(tensors, str(path), metadata={"format": "pt"})


def _sibling_dir(out_dir: pathlib.Path) -> pathlib.Path:
    """A new empty directory beside `out_dir` (same file system, so renaming it there is
    atomic), created with the usual permissions (umask applied)."""
    k = 0
    while True:
        tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}-{k}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            k += 1


def write_directory(out_dir, write) -> pathlib.Path:
    """Write a directory all at once: ``write(tmp)`` fills a new directory beside `out_dir`,
    which is then renamed to `out_dir` (absent, or an empty directory it replaces). On any
    failure the temporary directory is removed and `out_dir` is as it was; an OSError (a full
    disk, no permission) becomes an ExportError naming `out_dir`."""
    out_dir = pathlib.Path(out_dir)
    tmp = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling_dir(out_dir)
        write(tmp)
        os.replace(tmp, out_dir)
        return out_dir
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            at = f" at {e.filename}" if e.filename and tmp is None else ""     # e.g. its parent directory
            raise ExportError(f"{out_dir}: could not write the checkpoint ({e.strerror or e}{at}); the destination "
                              f"is as it was (no partial checkpoint)") from e
        raise


def export_hf(model_or_config, params, out_dir, dtype: str | None = None) -> pathlib.Path:
    """Write ``config.json`` and ``model.safetensors`` for `model_or_config` into out_dir
    (`write_directory` makes the whole directory appear at once).

    ``dtype`` ('float32' | 'bfloat16') overrides the stored dtype (default: the config's).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dt = jnp.dtype(config.dtype)
    tensors = {k: jnp.asarray(v, dt) for k, v in hf_state_dict(config, params).items()}
    write_tensors(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    gen = {"do_sample": False}
    if config.bos_token_id is not None:
        gen["bos_token_id"] = config.bos_token_id
    if config.eos_token_id is not None:
        eos = config.eos_token_id
        gen["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir
