"""A draft model stored beside its target: only the tensors the target does not already hold.

Directory layout::

    draft.json          format version, model config, head size, which tensors are shared
                        with the target, the stored tensors' sha256, the target's identity
    draft.safetensors   the stored tensors (e.g. the draft's layers and final norm, in
                        bfloat16), plus ``head_ids`` (int32) for a reduced head

Shared tensors (the embedding, and a head tied to the embedding) are taken from the target's
parameters at load time, so a draft stores its own layers, not the target's embedding.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.files import file_sha256
from specjax.models.config import CheckpointError, CorruptCheckpointError, MissingTensorError, ModelConfig
from specjax.models.llama import Llama, canonical_params
from specjax.models.reduced_head import ReducedHeadLlama, check_vocab_map

FORMAT = "specjax-draft-1"
SHARED_NAMES = ("embed", "head_from_embed")


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _unflatten(flat):
    out: dict = {}
    for name, v in flat.items():
        d = out
        parts = name.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def write_tensors(path, tree: dict, dtype: str = "bfloat16") -> str:
    """Write a nested dict of arrays as one safetensors file (dotted names; floats cast to
    `dtype`, integers kept), atomically (a temporary file renamed into place) and
    world-readable (shipped as package data). Returns the file's sha256."""
    from safetensors.numpy import save_file
    import ml_dtypes

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {}
    for name, v in _flatten(tree).items():
        a = np.asarray(jax.device_get(v))
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
        flat[name] = np.ascontiguousarray(a)
    tmp = path.with_name(path.name + ".tmp")
    save_file(flat, str(tmp))
    sha = file_sha256(tmp)
    tmp.chmod(0o644)
    tmp.replace(path)
    return sha


def read_tensors(path, expected_sha256: str, compute_dtype) -> dict:
    """The nested dict of a file written by `write_tensors`, checked against its sha256
    (`CorruptCheckpointError` naming the file otherwise); floats in `compute_dtype`."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    if file_sha256(path) != expected_sha256:
        raise CorruptCheckpointError(f"{path} does not match its recorded sha256 {expected_sha256}")
    flat = load_file(str(path))
    return _unflatten({k: (jnp.asarray(v) if v.dtype.kind in "iu" else jnp.asarray(v, compute_dtype))
                       for k, v in flat.items()})


def read_description(path, fmt: str, keys: tuple[str, ...]) -> dict:
    """The JSON description of a stored draft or head, checked: valid JSON, the expected format
    and the given keys present; `CheckpointError` naming the file otherwise."""
    path = pathlib.Path(path)
    try:
        desc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(desc, dict) or desc.get("format") != fmt:
        got = desc.get("format") if isinstance(desc, dict) else type(desc).__name__
        raise CheckpointError(f"{path}: unknown format {got!r}, expected {fmt}")
    missing = [k for k in keys if k not in desc]
    if missing:
        raise CorruptCheckpointError(f"{path} lacks {missing}")
    return desc


def save_draft(directory, model, params, *, shared: tuple[str, ...], dtype: str = "bfloat16",
               info: dict | None = None) -> dict:
    """Write the draft's non-shared tensors (cast to `dtype`; int tensors kept) and its config.

    shared: top-level param names taken from the target at load time ('embed'), plus
    'head_from_embed' when a reduced head is the target's embedding rows (then 'head' is not
    stored either). Returns the written description.
    """
    d = pathlib.Path(directory)
    p = canonical_params(params, model.config)
    drop = set(shared) - {"head_from_embed"}
    if "head_from_embed" in shared:
        drop.add("head")
    sha = write_tensors(d / "draft.safetensors", {k: v for k, v in p.items() if k not in drop}, dtype)
    desc = {
        "format": FORMAT,
        "config": dataclasses.asdict(model.config),
        "head_size": getattr(model, "head_size", 0),
        "shared": sorted(shared),
        "dtype": dtype,
        "sha256": sha,
        "bytes": (d / "draft.safetensors").stat().st_size,
        "info": info or {},
    }
    (d / "draft.json").write_text(json.dumps(desc, indent=1, default=str))
    return desc


def load_draft(directory, target, target_params, *, dtype: str | None = None, scan_layers: bool = False):
    """(model, params) of a draft saved by `save_draft`, its shared tensors from the target.

    Checks the stored tensors' sha256 and that the target's vocabulary and width match.
    A few-layer draft runs unrolled by default (``scan_layers=False``: per-layer params with
    fused projections and a per-layer cache): on XLA CPU a scan slices every layer's weights
    out of the stacked arrays each step.
    """
    d = pathlib.Path(directory)
    if not (d / "draft.json").is_file():
        raise CheckpointError(f"{d} holds no draft.json (not a draft directory)")
    desc = read_description(d / "draft.json", FORMAT, ("config", "sha256", "shared", "head_size"))
    cfg_d = dict(desc["config"])
    # Drafts written before `ModelConfig.linear_op` name the old layout flag, always False in a
    # saved draft (the weights are stored plain): read as the "xla" op.
    if cfg_d.pop("packed_projections", False):
        raise CheckpointError(f"{d / 'draft.json'}: its config stores packed weights; a saved draft holds plain ones")
    try:
        cfg = ModelConfig(**cfg_d)
    except TypeError as e:      # an unknown or a missing key
        raise CorruptCheckpointError(f"{d}/draft.json: its 'config' is not a model config ({e})") from None
    compute_dtype = dtype or target.config.dtype
    cfg = cfg.replace(dtype=compute_dtype, scan_layers=scan_layers, fuse_projections=not scan_layers,
                      linear_op="xla")
    if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.config.hidden_size:
        raise ValueError(f"draft {d} was made for vocab {cfg.vocab_size} / width {cfg.hidden_size}, the target has "
                         f"{target.vocab_size} / {target.config.hidden_size}")
    params = read_tensors(d / "draft.safetensors", desc["sha256"], compute_dtype)
    shared = set(desc["shared"])
    if "embed" in shared:
        params["embed"] = target_params["embed"]
    for name in ("layers", "final_norm"):
        if name not in params:
            raise MissingTensorError(f"{d}/draft.safetensors has no tensors for {name!r}")
    params = Llama(cfg).prepare_params(params)
    if desc["head_size"]:
        if "head_ids" not in params:
            raise MissingTensorError(f"{d}/draft.safetensors has no 'head_ids' for its reduced head")
        check_vocab_map(np.asarray(params["head_ids"]), target.vocab_size, int(desc["head_size"]),
                        f"{d}/draft.safetensors 'head_ids'")
        if "head_from_embed" in shared:
            params["head"] = jnp.take(params["embed"], params["head_ids"], axis=0)
        return ReducedHeadLlama(cfg, int(desc["head_size"])), params
    return Llama(cfg), params


def export_draft_hf(directory, target, target_params, out_dir, dtype: str | None = None) -> None:
    """Write a draft directory as a standalone Hugging Face Llama checkpoint, e.g. for
    transformers' assisted generation. A reduced-vocabulary head becomes a full-vocabulary one
    (`reduced_head.full_head`: the target's embedding rows), so the exported model drafts over
    every token; ``head_ids.json`` beside it lists the reduced head's tokens."""
    from specjax.models.export import export_hf
    from specjax.models.reduced_head import full_head

    model, params = load_draft(directory, target, target_params)
    head_ids = None
    if isinstance(model, ReducedHeadLlama):
        head_ids = [int(i) for i in np.asarray(params["head_ids"])]
        model, params = full_head(model, params)
    out = export_hf(model, params, out_dir, dtype=dtype)
    if head_ids is not None:
        (out / "head_ids.json").write_text(json.dumps({"head_ids": head_ids, "note": (
            "the draft was trained with q = 0 outside these tokens; this checkpoint's head covers the whole "
            "vocabulary")}) + "\n")
