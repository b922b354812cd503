"""The programs `specjax aot` compiles, built from shapes alone (`jax.ShapeDtypeStruct`s carrying
the shardings the real run would give them) and lowered through the very entry points a run
jits: `Engine._prefill_jit` and `Engine._step_jit` for decoding, the target's ``apply`` with the
cache donated for a verification block, `distill.make_train_step` for training.

Each `Program` knows the bytes an ideal implementation would read per call (``ideal_bytes``,
per device): every weight it multiplies by once (the embedding table only through its gathered
rows unless it is also the output layer) plus the live KV entries once (``context`` tokens per
row, not the cache's capacity). Training steps have no such floor (their activations dominate);
their ideal is left empty.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from specjax import decoding, distill, drafters, models, sampling, sharding, trees

DECODE = ("prefill", "decode", "verify", "chain", "tree")
TRAIN = ("train_head", "train_draft")
PROGRAMS = DECODE + TRAIN


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes one set of programs is compiled for."""
    batch: int
    context: int            # committed tokens per row at the measured decode step
    capacity: int           # cache slots per row
    prompt: int             # prefill: prompt tokens per row
    verify_ks: tuple[int, ...]
    gamma: int              # chain: draft length
    tree: tuple[int, int, int]    # dynamic tree: depth, top-k, node budget
    train_batch: int
    train_seq: int
    draft_layers: int       # train_draft: a draft of the target's shapes with this many layers
    block_tokens: int = 0   # the profile's `GenerationConfig.block_tokens` (-1: target-only steps score a chain's block)


@dataclasses.dataclass
class Program:
    name: str
    lower: Callable[[], Any]      # -> the program lowered for its abstract arguments
    args: tuple                   # those arguments (ShapeDtypeStructs with shardings)
    donated_bytes: float          # per device: the buffers the call donates
    ideal_bytes: float | None     # per device: weights + live KV read once (None: training)
    shared_bytes: float = 0.0     # per device: argument bytes that are one buffer passed twice
    weight_bytes: tuple = ()      # per device: each weight tensor (the lint's copy sizes)
    cache_bytes: tuple = ()       # per device: each cache buffer
    tokens: int = 0               # tokens the call scores per row (a k-token block: k)


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _per_device(a: jax.ShapeDtypeStruct) -> float:
    shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):       # typed PRNG keys: their raw uint32 words
        itemsize = 4 * int(np.prod(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape))
    else:
        itemsize = jnp.dtype(a.dtype).itemsize
    return float(np.prod(shape, dtype=np.float64)) * itemsize


def _tree_bytes(tree) -> float:
    return sum(_per_device(a) for a in jax.tree.leaves(tree) if hasattr(a, "shape"))


def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


class Builder:
    """Abstract parameters and states for one target, mesh and set of shapes."""

    def __init__(self, model: models.Llama, mesh, shapes: Shapes, rules=sharding.DEFAULT_RULES):
        self.model, self.mesh, self.shapes, self.rules = model, mesh, shapes, rules
        c = model.config
        shaped = jax.eval_shape(model.init_params, jax.random.key(0))
        self.params = _abstract(shaped, sharding.shardings_for(shaped, model.param_logical_axes(), mesh, rules))
        # one layer's share of a stacked tensor: what a per-layer copy of it would write
        per_layer = c.num_layers if c.scan_layers else 1
        self.weight_sizes = tuple(_per_device(a) for a in jax.tree.leaves({k: v for k, v in self.params.items()
                                                                           if k != "layers"})) + tuple(
            _per_device(a) / per_layer for a in jax.tree.leaves(self.params["layers"]))
        embed = _per_device(self.params["embed"])
        # a step multiplies by every weight once; the embedding table is read through its
        # gathered rows only, unless it is the output layer too
        self.step_weight_bytes = _tree_bytes(self.params) - (0.0 if c.tie_embeddings else embed)
        m = _axis_size(mesh, "model")
        kv_local = c.num_kv_heads // m if c.num_kv_heads % m == 0 else c.num_kv_heads
        rows_local = shapes.batch // _rows_split(mesh, shapes.batch)
        self.kv_bytes_per_token = 2 * c.num_layers * kv_local * c.head_dim * c.jnp_dtype.itemsize * rows_local
        self._head = None

    # -- pieces -----------------------------------------------------------------------------
    def eagle3(self):
        """(head config, drafter, abstract head params) of an EAGLE-3-shaped head over the target."""
        if self._head is None:
            hc = drafters.HeadConfig.make("eagle3", self.model.config)
            own = jax.eval_shape(lambda: drafters.init_head_params(hc, jax.random.key(1)))
            own = _abstract(own, jax.tree.map(lambda _: _replicated(self.mesh), own))
            hp = drafters.head_params(hc, own, self.params)
            self._head = (hc, hc.spec.drafter(hc), hp)
        return self._head

    def _engine(self, drafter, gamma):
        block = self.shapes.block_tokens
        if block == -1 and gamma == 0:      # target-only steps in the chain program's one block shape
            block = self.shapes.gamma + 1
        config = decoding.GenerationConfig(max_new_tokens=self.shapes.capacity, gamma=gamma, block_tokens=block,
                                           tree_children="deterministic" if not isinstance(gamma, int) else "iid")
        return decoding.Engine(self.model, drafter, config, mesh=self.mesh, rules=self.rules)

    def _state(self, engine, draft_params):
        s = self.shapes
        ep = decoding.EngineParams(target=self.params, draft=draft_params)
        state = engine.state_shapes(ep, s.batch, s.prompt, s.capacity)
        shardings = sharding.row_shardings(state, s.batch, self.mesh, self.rules)
        return ep, _abstract(state, shardings)

    def _ideal(self, tokens: int) -> float:
        """Weights once, the live KV entries once (``context`` committed + this call's ``tokens``)."""
        return self.step_weight_bytes + self.kv_bytes_per_token * (self.shapes.context + tokens)

    def _cache_sizes(self, cache) -> tuple:
        """One layer's K and V buffers, per device."""
        per_layer = 1 if cache.per_layer else cache.num_layers
        return tuple(_per_device(a) / per_layer for a in jax.tree.leaves((cache.k, cache.v)))

    # -- programs ---------------------------------------------------------------------------
    def prefill(self) -> Program:
        s = self.shapes
        engine = self._engine(None, 0)
        ep = decoding.EngineParams(target=self.params, draft=None)
        rows = NamedSharding(self.mesh, sharding.logical_to_spec(("batch", None), self.rules, self.mesh,
                                                                 (s.batch, s.prompt)))
        prompt = jax.ShapeDtypeStruct((s.batch, s.prompt), jnp.int32, sharding=rows)
        lengths = jax.ShapeDtypeStruct((s.batch,), jnp.int32, sharding=NamedSharding(
            self.mesh, sharding.logical_to_spec(("batch",), self.rules, self.mesh, (s.batch,))))
        return Program("prefill", lambda: engine.lower_prefill(ep, prompt, lengths, s.capacity), (ep, prompt, lengths),
                       0.0,
                       self.step_weight_bytes + self.kv_bytes_per_token * s.prompt,
                       weight_bytes=self.weight_sizes, tokens=s.prompt)

    def _step(self, name, drafter, draft_params, gamma, tokens) -> Program:
        engine = self._engine(drafter, gamma)
        ep, state = self._state(engine, draft_params)
        greedy = sampling.SamplingConfig.make(0.0)
        shared = 0.0
        if draft_params is not None:
            target_ids = {id(a) for a in jax.tree.leaves(self.params)}
            shared = sum(_per_device(a) for a in jax.tree.leaves(draft_params) if id(a) in target_ids)
        return Program(name, lambda: engine.lower_step(ep, greedy, state), (ep, greedy, state), _tree_bytes(state),
                       self._ideal(tokens), shared, self.weight_sizes, self._cache_sizes(state.target_cache), tokens)

    def decode(self) -> Program:
        """The target-only step (in the one block shape of the chain program when the profile
        pads: its ideal is still one token's)."""
        return self._step("decode", None, None, 0, 1)

    def chain(self) -> Program:
        _, drafter, hp = self.eagle3()
        return self._step(f"chain_eagle3_g{self.shapes.gamma}", drafter, hp, self.shapes.gamma,
                          self.shapes.gamma + 1)

    def tree(self) -> Program:
        _, drafter, hp = self.eagle3()
        depth, topk, budget = self.shapes.tree
        return self._step(f"tree_dynamic_{depth}_{topk}_{budget}", drafter, hp,
                          trees.DynamicTree(depth=depth, topk=topk, node_budget=budget), budget + 1)

    def verify(self, k: int) -> Program:
        """The target's forward of a k-token block over the cache (what a round verifies with),
        the cache donated."""
        s = self.shapes
        cache = jax.eval_shape(lambda: self.model.init_cache(s.batch, s.capacity))
        cache = _abstract(cache, sharding.row_shardings(cache, s.batch, self.mesh, self.rules))
        rows = NamedSharding(self.mesh, sharding.logical_to_spec(("batch", None), self.rules, self.mesh, (s.batch, k)))
        tokens = jax.ShapeDtypeStruct((s.batch, k), jnp.int32, sharding=rows)
        fn = jax.jit(_apply, static_argnums=0, donate_argnums=3)
        args = (self.model, self.params, tokens, cache)
        return Program(f"verify_k{k}", lambda: _lower(self.mesh, fn, args), args[1:], _tree_bytes(cache),
                       self._ideal(k), 0.0, self.weight_sizes, self._cache_sizes(cache), k)

    def train_head(self) -> Program:
        """One optimizer step of the EAGLE-3 head (AdamW, the trainer's settings) on
        ``train_batch`` x ``train_seq`` tokens, the target's features computed in the step."""
        hc, _, _ = self.eagle3()
        obj = distill.HeadObjective(config=hc, target=self.model, ttt_steps=hc.spec.default_ttt_steps)
        own = jax.eval_shape(lambda: drafters.init_head_params(hc, jax.random.key(1)))
        trainable = {k: v for k, v in own.items() if k in obj.trainable}
        fixed = {k: v for k, v in own.items() if k not in obj.trainable}
        frozen = {"target": self.params, **_abstract(fixed, jax.tree.map(lambda _: _replicated(self.mesh), fixed))}
        head_UD = jax.eval_shape(lambda p: distill.teacher_head(self.model, p), self.params)
        return self._train("train_head", trainable, frozen, head_UD, obj, distill.head_loss)

    def train_draft(self) -> Program:
        """One optimizer step of a ``draft_layers``-layer draft of the target's shapes (every
        parameter trained) against the target's cached final hidden states."""
        c = self.model.config.replace(num_layers=self.shapes.draft_layers)   # keeps the first layers' windows
        draft = models.Llama(c)
        params = jax.eval_shape(draft.init_params, jax.random.key(2))
        head_UD = jax.ShapeDtypeStruct((c.vocab_size, c.hidden_size), c.jnp_dtype)
        return self._train("train_draft", params, {}, head_UD, draft, None, config=c, teacher=True)

    def _train(self, name, trainable, frozen, head_UD, objective, loss, config=None, teacher=False):
        s = self.shapes
        optimizer, _ = distill.make_optimizer(learning_rate=1e-4, warmup_steps=10, total_updates=1000)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        state = distill.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable,
                                  opt_state=jax.eval_shape(optimizer.init, trainable), key=key)
        rules = sharding.TRAIN_RULES
        st_sh = sharding.train_state_shardings(state, optimizer, self.mesh, rules, config)
        state = _abstract(state, st_sh)
        batch = {"tokens": jax.ShapeDtypeStruct((s.train_batch, s.train_seq), jnp.int32),
                 "mask": jax.ShapeDtypeStruct((s.train_batch, s.train_seq), jnp.float32)}
        if teacher:
            cfg = self.model.config
            batch["teacher_hidden"] = jax.ShapeDtypeStruct((s.train_batch, s.train_seq, cfg.hidden_size), cfg.jnp_dtype)
        batch = _abstract(batch, sharding.batch_shardings(batch, self.mesh, rules))
        if not hasattr(head_UD, "sharding") or head_UD.sharding is None:
            head_UD = jax.ShapeDtypeStruct(head_UD.shape, head_UD.dtype, sharding=NamedSharding(
                self.mesh, sharding.logical_to_spec(("vocab", "embed"), rules, self.mesh, head_UD.shape)))
        step = distill.make_train_step(objective, distill.LossSpec(), optimizer, loss=loss, state_shardings=st_sh)
        args = (state, frozen, head_UD, batch)
        return Program(name, lambda: _lower(self.mesh, step, args), args, _tree_bytes(state), None,
                       weight_bytes=self.weight_sizes, tokens=s.train_seq)

    def build(self, names) -> list[Callable[[], Program]]:
        """Thunks, one per program, in the order of ``names`` (``verify`` expands to each k)."""
        out = []
        for n in names:
            if n == "verify":
                out += [functools.partial(self.verify, k) for k in self.shapes.verify_ks]
            else:
                out.append(getattr(self, n))
        return out


def _lower(mesh, fn, args):
    """``fn`` lowered under ``mesh`` (`jax.set_mesh`), as the engine traces its own
    programs under its mesh: a Pallas kernel splits its operands over it."""
    with jax.set_mesh(mesh):
        return fn.lower(*args)


def _apply(model, params, tokens_BT, cache):
    return model.apply(params, tokens_BT, cache)


def _axis_size(mesh, axis: str) -> int:
    return int(mesh.shape.get(axis, 1))


def _rows_split(mesh, batch: int) -> int:
    n = _axis_size(mesh, "data") * _axis_size(mesh, "fsdp")
    return n if n > 1 and batch % n == 0 else 1
