"""Logical axis names -> mesh axes, and helpers to place params / KV caches on a mesh.

Params and caches carry *logical* axis names (`specjax.models.param_logical_axes`, for the
parameter layout of a model's config, and `specjax.models.kv_cache.logical_axes`):

    batch, sequence, layers, embed, heads, kv, head_dim, mlp, vocab

A rule table (plain data, first match wins) maps each logical name to a mesh axis name, a
tuple of mesh axis names, or None (replicated). `logical_to_spec` turns a tuple of logical
names into a `PartitionSpec`, dropping mesh axes the mesh lacks, mesh axes already used by
an earlier dimension, and shardings that do not divide the dimension (e.g. 9 heads on 2
devices stay replicated). Placement is `jax.device_put` with `NamedSharding`; jitted code
then runs SPMD (GSPMD inserts the collectives), so the math does not change.

The decoding engine runs on a mesh when built with one (``Engine(..., mesh=)``): `Engine.place`
puts the weights (`shard_params`) and the batch rows on it, and the loop state is constrained
with `constrain_rows` after prefill and every round. Flax's `nn.logical_to_mesh` helpers
expect Linen-style annotations; the rule table here is the same idea in plain data, applied to
specjax's functional parameter and cache trees.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.models import Llama, param_logical_axes
from specjax.models.kv_cache import logical_axes

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


def shardings_for(tree, axes_tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """NamedShardings for every array leaf of ``tree`` given a parallel tree of axis names."""
    leaves, treedef = jax.tree.flatten(tree)
    axes_leaves = treedef.flatten_up_to(axes_tree)
    out = [NamedSharding(mesh, logical_to_spec(a, rules, mesh, np.shape(x)))
           for x, a in zip(leaves, axes_leaves)]
    return jax.tree.unflatten(treedef, out)


def shard_params(params, model_or_config, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Place params (in the layout of the model's config, see `Llama.prepare_params`) on
    ``mesh`` following the logical-axis rules."""
    config = getattr(model_or_config, "config", model_or_config)
    Llama(config).check_params(params)   # a clear error for params of another layout
    return jax.device_put(params, shardings_for(params, param_logical_axes(config), mesh, rules))


def shard_cache(cache, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Place a `KVCache` on ``mesh`` (batch on "data", kv heads on "model" by default)."""
    return jax.device_put(cache, shardings_for(cache, logical_axes(cache), mesh, rules))


def replicate(tree, mesh: Mesh):
    """Every array leaf of ``tree`` replicated over ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def row_shardings(tree, batch_size: int, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """NamedShardings for a decoding state: every `KVCache` in it by its logical axes (batch on
    "data", kv heads on "model"), every other array whose leading dimension is ``batch_size``
    with that dimension as "batch", everything else replicated."""
    from specjax.models.kv_cache import KVCache

    def one(x):
        if isinstance(x, KVCache):
            return shardings_for(x, logical_axes(x), mesh, rules)
        if np.ndim(x) >= 1 and np.shape(x)[0] == batch_size:
            axes = ("batch",) + (None,) * (np.ndim(x) - 1)
            return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, np.shape(x)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def constrain_rows(tree, batch_size: int, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """`row_shardings` as a sharding constraint inside jitted code (GSPMD keeps the rows on
    "data" and the caches' heads on "model" through the loop)."""
    return jax.lax.with_sharding_constraint(tree, row_shardings(tree, batch_size, mesh, rules))
