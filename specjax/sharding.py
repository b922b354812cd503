"""Logical axis names -> mesh axes, and helpers to place params / KV caches on a mesh.

Params and caches carry *logical* axis names (see `specjax.models.param_logical_axes` and
`specjax.models.kv_cache.logical_axes`; the NNX module stores the same names as each
`nnx.Param`'s ``out_sharding`` metadata):

    batch, sequence, layers, embed, heads, kv, head_dim, mlp, vocab

A rule table (plain data, first match wins) maps each logical name to a mesh axis name, a
tuple of mesh axis names, or None (replicated). `logical_to_spec` turns a tuple of logical
names into a `PartitionSpec`, dropping mesh axes the mesh lacks, mesh axes already used by
an earlier dimension, and shardings that do not divide the dimension (e.g. 9 heads on 2
devices stay replicated). Placement is `jax.device_put` with `NamedSharding`; jitted code
then runs SPMD (GSPMD inserts the collectives), so the math does not change.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, Any]]

# data parallel over the batch, tensor (model) parallel over heads / mlp / vocab.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("sequence", None),
    ("layers", None),
    ("embed", None),
    ("heads", "model"),
    ("kv", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("vocab", "model"),
)
# everything replicated except the batch
DATA_PARALLEL_RULES: tuple[tuple[str, Any], ...] = (("batch", "data"),)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; ``model`` defaults to the devices left after ``data``."""
    devices = list(devices if devices is not None else jax.devices())
    if model is None:
        model = len(devices) // data
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, "
                         f"have {len(devices)}")
    grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, ("data", "model"))


def _lookup(rules: Rules, name):
    for logical, mesh_axes in rules:
        if logical == name:
            return mesh_axes
    return None


def logical_to_spec(axes: Sequence[str | None], rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for a tensor whose dims have logical names ``axes``."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        target = _lookup(rules, name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        names = (target,) if isinstance(target, str) else tuple(target)
        keep = []
        for m in names:
            if m in used or (mesh is not None and m not in mesh.shape):
                continue
            keep.append(m)
        if mesh is not None and shape is not None and keep:
            size = int(np.prod([mesh.shape[m] for m in keep]))
            if shape[i] % size:
                keep = []
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def params_logical_axes(config, params) -> Any:
    """Logical axes matching ``params`` (stacked, or per-layer as from `unstack_layers`)."""
    from specjax.models.llama import as_pure_params, param_logical_axes
    axes = param_logical_axes(config)
    p = as_pure_params(params)
    # Fused projections (`fuse_projections`) take the axes of their first part: the fused output
    # axis is split like heads / mlp (correct under any split; XLA reshards the q|k|v slices).
    layer_axes = dict(axes["layers"])
    for fused, first in (("wqkv", "wq"), ("bqkv", "bq"), ("w_gate_up", "w_gate")):
        if first in layer_axes:
            layer_axes[fused] = layer_axes[first]
    sample = p["layers"][0] if isinstance(p["layers"], (list, tuple)) else p["layers"]
    layer_axes = {k: layer_axes[k] for k in sample}
    if isinstance(p["layers"], (list, tuple)):
        per_layer = jax.tree.map(lambda a: a[1:], layer_axes, is_leaf=_is_axes)
        return {**axes, "layers": type(p["layers"])(per_layer for _ in p["layers"])}
    return {**axes, "layers": layer_axes}


def shardings_for(tree, axes_tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """NamedShardings for every array leaf of ``tree`` given a parallel tree of axis names."""
    leaves, treedef = jax.tree.flatten(tree)
    axes_leaves = treedef.flatten_up_to(axes_tree)
    out = [NamedSharding(mesh, logical_to_spec(a, rules, mesh, np.shape(x)))
           for x, a in zip(leaves, axes_leaves)]
    return jax.tree.unflatten(treedef, out)


def shard_params(params, config, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Place params on ``mesh`` following the logical-axis rules."""
    from specjax.models.llama import as_pure_params
    config = getattr(config, "config", config)
    p = as_pure_params(params)
    return jax.device_put(p, shardings_for(p, params_logical_axes(config, p), mesh, rules))


def shard_cache(cache, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Place a `KVCache` on ``mesh`` (batch on "data", kv heads on "model" by default)."""
    from specjax.models.kv_cache import logical_axes
    return jax.device_put(cache, shardings_for(cache, logical_axes(cache), mesh, rules))
