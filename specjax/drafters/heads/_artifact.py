"""A draft head stored beside its target: only the head's own tensors.

Directory layout::

    head.json           format version, head config (kind, feature layers, heads, head size),
                        the target's dimensions it was made for, sha256 of the tensors, info
    head.safetensors    the head's own tensors (floats in bfloat16 by default; ``head_ids`` int32)

The embedding, final norm and LM head are the target's, taken at load time (`head_params`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.heads import _eagle3_layer
from specjax.drafters.heads._config import HeadConfig, head_kinds, head_params, init_head_params
from specjax.models.config import CheckpointError, CorruptCheckpointError, MissingTensorError
from specjax.models.draft_artifact import read_description, read_tensors, write_tensors
from specjax.models.reduced_head import check_vocab_map

FORMAT = "specjax-head-1"


def save_head(directory, hc: HeadConfig, own: dict, *, dtype: str = "bfloat16", info: dict | None = None) -> dict:
    """Write a head's own parameters and config; returns the description written to head.json."""
    d = pathlib.Path(directory)
    sha = write_tensors(d / "head.safetensors", {k: own[k] for k in hc.own_param_names}, dtype)
    t = hc.target
    desc = {"format": FORMAT, "head": hc.to_dict(), "dtype": dtype, "sha256": sha,
            "bytes": (d / "head.safetensors").stat().st_size,
            "target_dims": {"vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "num_layers": t.num_layers},
            "info": info or {}}
    (d / "head.json").write_text(json.dumps(desc, indent=1, default=str))
    return desc


def is_head_dir(directory) -> bool:
    return (pathlib.Path(directory) / "head.json").is_file()


def head_kind(directory) -> str:
    """The kind (`specjax.drafters.heads.head_kinds`) of a saved head, from its checked head.json
    (`CheckpointError` naming the file when it is missing or broken)."""
    d = pathlib.Path(directory)
    if not is_head_dir(d):
        raise CheckpointError(f"{d} holds no head.json (not a draft-head directory)")
    desc = read_description(d / "head.json", FORMAT, ("head",))
    kind = desc["head"].get("kind") if isinstance(desc["head"], dict) else None
    if kind not in head_kinds():
        raise CheckpointError(f"{d / 'head.json'}: head kind {kind!r} is not one of {head_kinds()}")
    return kind


def load_head(directory, target, target_params, *, dtype: str | None = None):
    """(drafter, params) of a head saved by `save_head` for this target (checked: format,
    sha256, the target's vocabulary, width and depth)."""
    d = pathlib.Path(directory)
    if not is_head_dir(d):
        raise CheckpointError(f"{d} holds no head.json (not a draft-head directory)")
    desc = read_description(d / "head.json", FORMAT, ("head", "sha256", "target_dims"))
    blob_path = d / "head.safetensors"
    if not blob_path.is_file():
        raise MissingTensorError(f"{d} has head.json but no head.safetensors")
    tc = target.config
    want = {"vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size, "num_layers": tc.num_layers}
    if desc["target_dims"] != want:
        raise ValueError(f"head {d} was made for a target with {desc['target_dims']}, this target has {want}")
    h = desc["head"]
    if not isinstance(h, dict):
        raise CorruptCheckpointError(f"{d}/head.json: 'head' must be an object, got {h!r}")
    if not isinstance(h.get("input_norm", False), bool):
        raise CorruptCheckpointError(f"{d}/head.json: 'input_norm' must be true or false, got {h['input_norm']!r}")
    try:
        layer = None if h.get("layer") is None else _eagle3_layer.layer_from_dict(h["layer"], tc)
        hc = HeadConfig.make(h["kind"], tc, num_heads=int(h["num_heads"]), head_size=h["head_size"],
                             feature_layers=tuple(h["feature_layers"]), input_norm=h.get("input_norm", False),
                             layer=layer, own_embedding=bool(h.get("own_embedding", False)))
        # The target's layout at inference (a published EAGLE-3 head runs the plain one).
        run = dataclasses.replace(hc, linear_op=tc.linear_op if hc.spec.can_store else "xla")
    except (KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{d}/head.json: incomplete head description ({e!r})") from None
    own = read_tensors(blob_path, desc["sha256"], jnp.dtype(dtype or tc.dtype))
    missing = [n for n in hc.own_param_names if n not in own]
    if missing:
        raise MissingTensorError(f"{blob_path} lacks the head tensors {missing}")
    # Shapes against a fresh head of this config: a mismatch would otherwise surface as a shape
    # error deep inside the first jitted round.
    ids = None if hc.head_size is None else np.arange(hc.head_size)
    want = jax.eval_shape(lambda: init_head_params(hc, jax.random.key(0), head_ids=ids))
    got = {k: own[k] for k in want}
    if jax.tree.structure(got) != jax.tree.structure(want):
        names = lambda t: sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t))  # noqa: E731
        raise MissingTensorError(f"{blob_path}: head tensors {names(got)}, a {hc.kind} head needs {names(want)}")
    for (path, w), (_, g) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)):
        if tuple(w.shape) != tuple(np.shape(g)):
            raise CorruptCheckpointError(f"{blob_path}: tensor {jax.tree_util.keystr(path)} has shape "
                                         f"{tuple(np.shape(g))}, a {hc.kind} head for this target needs {tuple(w.shape)}")
    if hc.head_size is not None:
        check_vocab_map(np.asarray(own["head_ids"]), tc.vocab_size, hc.head_size, f"{blob_path} 'head_ids'")
    params = head_params(run, own, target_params)
    return run.spec.drafter(run), params
