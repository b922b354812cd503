"""Logical axis names -> mesh axes, and helpers to place params / KV caches on a mesh.

Params and caches carry *logical* axis names (`specjax.models.param_logical_axes`, for the
parameter layout of a model's config, and `specjax.models.kv_cache.logical_axes`):

    batch, sequence, layers, embed, heads, kv, head_dim, mlp, expert, vocab

A rule table (plain data, first match wins) maps each logical name to a mesh axis name, a
tuple of mesh axis names, or None (replicated). `logical_to_spec` turns a tuple of logical
names into a `PartitionSpec`, dropping mesh axes the mesh lacks or has only once, mesh axes already used by
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

AXES = ("data", "fsdp", "model")

# data parallel over the batch, tensor (model) parallel over heads / mlp / vocab.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("sequence", None),
    ("layers", None),
    ("embed", None),
    ("heads", "model"),
    ("kv", "model"),
    ("head_dim", None),
    ("expert", "model"),        # expert parallel: an expert's weights whole on one shard
    ("mlp", "model"),
    ("vocab", "model"),
)
# everything replicated except the batch
DATA_PARALLEL_RULES: tuple[tuple[str, Any], ...] = (("batch", ("data", "fsdp")),)
# The trainer: the global batch over data x fsdp, parameters and optimizer state FSDP-sharded
# over "fsdp" along the model width ("embed"), tensor parallel over "model" as for decoding.
# Parameters without logical names (a head's own weights) follow `fsdp_spec`.
TRAIN_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("sequence", None),
    ("layers", None),
    ("embed", "fsdp"),
    ("heads", "model"),
    ("kv", "model"),
    ("head_dim", None),
    ("expert", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
)


def make_mesh(data: int = 1, model: int | None = None, devices=None, *, fsdp: int = 1) -> Mesh:
    """A ("data", "fsdp", "model") mesh; ``model`` defaults to the devices left after ``data``
    and ``fsdp``. Axes of size 1 are kept (specs never name them, see `logical_to_spec`)."""
    devices = list(devices if devices is not None else jax.devices())
    if model is None:
        model = len(devices) // (data * fsdp)
    if min(data, fsdp, model) < 1 or data * fsdp * model > len(devices):
        raise ValueError(f"mesh data={data} fsdp={fsdp} model={model} needs {data * fsdp * model} devices, "
                         f"have {len(devices)}")
    n = data * fsdp * model
    try:        # the device order of the interconnect (TPU slices), when JAX knows it
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh((data, fsdp, model), devices[:n])
    except Exception:  # noqa: BLE001 - CPU and odd shapes: the plain order
        grid = np.asarray(devices[:n], dtype=object).reshape(data, fsdp, model)
    return Mesh(grid, AXES)


def mesh_from_config(c, devices=None) -> Mesh:
    """The mesh of a config's ``mesh`` block (``data``, ``fsdp``, ``model``; one of them may be
    -1 = the devices the others leave). Their product must be the number of devices: a mesh
    that leaves devices idle is an error naming the numbers, not a silent smaller run."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = {k: int(c[k]) for k in AXES}
    free = [k for k, v in sizes.items() if v == -1]
    bad = [f"{k}={v}" for k, v in sizes.items() if v == 0 or v < -1]
    if bad or len(free) > 1:
        raise ValueError(f"mesh: {', '.join(bad) or ', '.join(f'{k}=-1' for k in free)}: each of "
                         f"{'/'.join(AXES)} must be >= 1, and at most one may be -1 (the rest)")
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh {sizes}: {len(devices)} devices are not a multiple of {fixed}")
        sizes[free[0]] = len(devices) // fixed
    if int(np.prod(list(sizes.values()))) != len(devices):
        raise ValueError(f"mesh data={sizes['data']} fsdp={sizes['fsdp']} model={sizes['model']} covers "
                         f"{int(np.prod(list(sizes.values())))} devices, this job has {len(devices)} "
                         f"(use -1 for one axis to take the rest)")
    return make_mesh(sizes["data"], sizes["model"], devices, fsdp=sizes["fsdp"])


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
            if m in used or (mesh is not None and (m not in mesh.shape or mesh.shape[m] == 1)):
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
    return put(params, shardings_for(params, param_logical_axes(config), mesh, rules))


def shard_cache(cache, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Place a `KVCache` on ``mesh`` (batch on "data", kv heads on "model" by default)."""
    return put(cache, shardings_for(cache, logical_axes(cache), mesh, rules))


def replicate(tree, mesh: Mesh):
    """Every array leaf of ``tree`` replicated over ``mesh``."""
    repl = NamedSharding(mesh, PartitionSpec())
    return put(tree, jax.tree.map(lambda _: repl, tree))


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


# ------------------------------------------------------------------------------ the trainer

FSDP_MIN_SIZE = 1 << 14      # leaves smaller than this stay replicated (norm scales, biases)


def fsdp_spec(shape: Sequence[int], mesh: Mesh, min_size: int = FSDP_MIN_SIZE) -> PartitionSpec:
    """For a parameter without logical names: its largest dimension that the "fsdp" axis
    divides, sharded over "fsdp" (ZeRO-3 style); small or indivisible leaves replicated."""
    n = mesh.shape.get("fsdp", 1)
    if n == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return PartitionSpec()
    dims = [i for i in np.argsort([-d for d in shape], kind="stable") if shape[i] % n == 0]
    if not dims:
        return PartitionSpec()
    spec = [None] * len(shape)
    spec[int(dims[0])] = "fsdp"
    return PartitionSpec(*spec)


def param_shardings(params, mesh: Mesh, rules: Rules = TRAIN_RULES, config=None):
    """NamedShardings for a parameter tree: by the logical-axis rules for the top-level entries
    that are in the Llama layout of ``config`` (when given), by `fsdp_spec` for the rest."""
    named = {}
    if config is not None:
        named = param_logical_axes(config)

    def one(path, x):
        node = named
        for k in path:
            key = getattr(k, "key", getattr(k, "idx", None))
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        if isinstance(node, tuple) and len(node) == np.ndim(x) and all(a is None or isinstance(a, str) for a in node):
            return NamedSharding(mesh, logical_to_spec(node, rules, mesh, np.shape(x)))
        return NamedSharding(mesh, fsdp_spec(np.shape(x), mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def train_state_shardings(state, optimizer, mesh: Mesh, rules: Rules = TRAIN_RULES, config=None):
    """Shardings for a distillation `TrainState`: the trainable parameters by `param_shardings`,
    every optimizer-state entry that mirrors a parameter (Adam's moments, accumulated
    gradients) like that parameter (`optax.tree_map_params`), the rest (counters) and the
    step and PRNG key replicated."""
    import optax
    repl = NamedSharding(mesh, PartitionSpec())
    p_sh = param_shardings(state.params, mesh, rules, config)
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, state.opt_state, p_sh,
                                   transform_non_params=lambda _: repl)
    return state.replace(step=repl, params=p_sh, opt_state=opt_sh, key=repl)


def put(tree, shardings):
    """``tree`` (host or single-device arrays, the same values in every process) placed with
    ``shardings``: each process builds only its own shards (`jax.make_array_from_callback`), so
    this works across processes as on one. In a single process it is `jax.device_put` (no host copy)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sh):
        if x is None:
            return None
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            # typed PRNG keys: their raw data placed the same way (a trailing key dimension)
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sh), impl=jax.random.key_impl(x))
        a = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
        return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    return jax.tree.map(one, tree, shardings, is_leaf=lambda x: x is None)


def batch_shardings(batch, mesh: Mesh, rules: Rules = TRAIN_RULES):
    """A training batch (a dict of [B, ...] arrays): rows over the "batch" rule's axes when they
    divide B, else replicated."""
    return {k: NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (np.ndim(v) - 1), rules, mesh,
                                                   np.shape(v)))
            for k, v in batch.items()}


def to_host(tree):
    """Every array leaf as a host numpy array holding its global value; across processes the
    shards are gathered (`multihost_utils.process_allgather`), so every process gets the whole
    array."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def load_sharded(path, mesh: Mesh, rules: Rules = DEFAULT_RULES, dtype: str = "bfloat16", **layout):
    """(model, params) of a Hugging Face checkpoint read straight onto ``mesh``: every tensor
    placed by the logical-axis rules as it is read, each device's block read from the
    safetensors files slice by slice (`specjax.models.hf_loader.read_hf_placed`), so a checkpoint
    larger than one host's memory loads as long as each host holds its shards. The params are in
    the canonical layout (``scan_layers=True``); ``layout`` may set other `ModelConfig` fields
    that keep it (e.g. ``attention_op``)."""
    from specjax.models.hf_loader import read_hf_placed

    def sharding_of(key, shape, axes):
        return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))

    fixed = {"scan_layers", "fuse_projections", "linear_op"} & set(layout)
    if fixed:
        raise ValueError(f"load_sharded reads the canonical layout (scan_layers=True, unfused, linear_op='xla'); "
                         f"{sorted(fixed)} cannot be set here (convert afterwards with model.prepare_params)")
    config, params = read_hf_placed(path, sharding_of, dtype=dtype)
    config = config.replace(scan_layers=True, fuse_projections=False, linear_op="xla", **layout)
    return Llama(config), params


# ---------------------------------------------------------------------------------------
# The decoding engine's placement (`specjax.decoding.Engine` calls these)
# ---------------------------------------------------------------------------------------
def place_weights(model, params, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """A Llama model's params by the logical-axis rules (`shard_params`); anything else (a head's
    own weights, a drafter's tables) replicated; None stays None."""
    if params is None:
        return None
    if isinstance(model, Llama):
        try:
            return shard_params(params, model, mesh, rules)
        except ValueError:      # not this model's parameter layout (e.g. a head's own weights)
            pass
    return replicate(params, mesh)


def place_rows(arrays, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Arrays whose first dimension is the batch, their rows over the batch rule's axes."""
    batch_size = np.shape(jax.tree.leaves(arrays)[0])[0]
    return put(arrays, row_shardings(arrays, batch_size, mesh, rules))


def constrain_loop_state(state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """A decoding loop state (`specjax.decoding.LoopState`) pinned to ``mesh``: rows over the
    batch axes, the batch-wide entries (the adaptive policy, the per-candidate round counts)
    replicated (`row_shardings` would put any array whose first dimension equals the batch size
    on "data")."""
    shared = (state.policy, state.metrics.gamma_rounds_Z)
    rows = constrain_rows(state.replace(policy=None, metrics=state.metrics.replace(gamma_rounds_Z=None)),
                          state.lengths_B.shape[0], mesh, rules)
    policy, counts = jax.lax.with_sharding_constraint(shared, NamedSharding(mesh, PartitionSpec()))
    return rows.replace(policy=policy, metrics=rows.metrics.replace(gamma_rounds_Z=counts))
