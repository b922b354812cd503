"""The generation loop's state and what it returns: plain data (struct dataclasses and frozen
dataclasses), the status codes, the row-wise buffer writes the rounds share, the state's
placement on a mesh (`constrain_state`, `under_engine_mesh`), and the host-side checks of a batch (`check_batch`)
and of a prefill (`Prefill.parts`). `_engine` runs the rounds over these."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import models

RUNNING, EOS, MAX_TOKENS, NAN_LOGITS = 0, 1, 2, 3
STATUS_NAMES = {RUNNING: "running", EOS: "eos", MAX_TOKENS: "max_new_tokens", NAN_LOGITS: "nan_logits"}
PAD_ID = 0  # what unwritten slots of the token buffer hold (a valid id: models may read them)


@struct.dataclass
class EngineParams:
    """The weights of one engine call: the target's and the drafter's (None for model-free)."""
    target: Any
    draft: Any = None


@struct.dataclass
class Metrics:
    """Per-row counters, summed over rounds in which the row was active.

    accepted counts what the verifier accepted, including tokens that EOS or max_new_tokens
    then cut off; committed counts what was written. draft_passes: the drafter's forward
    passes (`Drafter.forward_passes`; catch-up ingests not counted). scored: tokens the target
    scored (gamma + 1 per linear round, nodes + 1 per tree round). For trees, position j of
    accepted_at / tested_at is depth j + 1 along the accepted path.
    """
    rounds_B: jax.Array
    draft_passes_B: jax.Array
    proposed_B: jax.Array
    accepted_B: jax.Array
    committed_B: jax.Array
    degenerate_residual_B: jax.Array
    accepted_at_BG: jax.Array     # accepted at draft position j
    tested_at_BG: jax.Array       # draft position j reached verification
    gamma_rounds_Z: jax.Array     # rounds run with each configured gamma (batch-wide)
    invalid_draft_rounds_B: jax.Array  # rounds whose draft q was not a distribution (proposals discarded)
    scored_B: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_gamma: int, num_gammas: int) -> "Metrics":
        z_B = jnp.zeros((batch,), jnp.int32)
        z_BG = jnp.zeros((batch, max_gamma), jnp.int32)
        return cls(z_B, z_B, z_B, z_B, z_B, z_B, z_BG, z_BG, jnp.zeros((num_gammas,), jnp.int32), z_B, z_B)

    @property
    def target_passes_B(self):
        """One target forward per round (prefill not counted)."""
        return self.rounds_B

    @property
    def wasted_B(self):
        """Proposed draft tokens that were not accepted."""
        return self.proposed_B - self.accepted_B

    def summary(self) -> dict:
        """Aggregate over rows (host side): counts, mean accepted tokens per target pass,
        acceptance rate and acceptance per draft position (accepted / reached)."""
        m = jax.device_get(self)
        passes = int(m.rounds_B.sum())
        tested_G = m.tested_at_BG.sum(0)
        return {
            "target_passes": passes, "draft_passes": int(m.draft_passes_B.sum()),
            "proposed": int(m.proposed_B.sum()), "accepted": int(m.accepted_B.sum()),
            "wasted": int(m.wasted_B.sum()), "committed": int(m.committed_B.sum()),
            "degenerate_residuals": int(m.degenerate_residual_B.sum()),
            "mean_accepted_tokens_per_pass": float(m.committed_B.sum()) / max(passes, 1),
            "acceptance_rate": float(m.accepted_B.sum()) / max(int(m.proposed_B.sum()), 1),
            "acceptance_per_position": [float(a) / max(int(t), 1) for a, t in zip(m.accepted_at_BG.sum(0), tested_G)],
            "rounds_per_gamma": [int(x) for x in m.gamma_rounds_Z],
            "invalid_draft_rounds": int(m.invalid_draft_rounds_B.sum()),
            "tokens_scored_per_pass": float(m.scored_B.sum()) / max(passes, 1),
        }


@struct.dataclass
class LoopState:
    tokens_BS: jax.Array
    lengths_B: jax.Array
    prompt_lengths_B: jax.Array
    done_B: jax.Array
    status_B: jax.Array
    target_cache: Any
    draft_state: Any
    key_B: jax.Array
    metrics: Metrics
    policy: Any                  # adaptive gamma's PolicyState, or None
    round: jax.Array
    # The target's hidden features per committed position [B, capacity, F] for a feature-level
    # draft head (None otherwise): positions < lengths_B - 1 are valid, later ones garbage
    # (rolled back with the caches by the lengths alone).
    features_BSF: Any = None
    # Each row's token-automaton state after its committed tokens (structured output,
    # `specjax.sampling`, "Constraints"; -1: none yet). A row that has generated nothing reads
    # its automaton's start instead, so a refilled row needs no reset.
    constraint_B: Any = None


@struct.dataclass
class Commit:
    """What one round wrote: tokens_BC (K = max_gamma + 1; slots >= n_B are padding) at
    slots [start_B, start_B + n_B) of each row. Small: the stream copies only this to the host.
    Under adaptive gamma `stream` also carries the policy's choice for the next round
    (``next_index``, an index into `GenerationConfig.gammas`), which it dispatches on."""
    tokens_BC: jax.Array
    start_B: jax.Array
    n_B: jax.Array
    done_B: jax.Array
    next_index: jax.Array | None = None


@struct.dataclass
class GenerateOutput:
    tokens_BS: jax.Array          # prompt followed by generated tokens, PAD_ID after lengths
    lengths_B: jax.Array
    prompt_lengths_B: jax.Array
    status_B: jax.Array
    metrics: Metrics
    policy: Any = None            # adaptive gamma's final PolicyState (its estimates), or None

    @classmethod
    def from_state(cls, state: LoopState) -> "GenerateOutput":
        return cls(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B, prompt_lengths_B=state.prompt_lengths_B,
                   status_B=state.status_B, metrics=state.metrics, policy=state.policy)

    def generated(self) -> list[list[int]]:
        toks, lens, plens = (np.asarray(x) for x in (self.tokens_BS, self.lengths_B, self.prompt_lengths_B))
        return [toks[b, plens[b]:lens[b]].tolist() for b in range(toks.shape[0])]

    def statuses(self) -> list[str]:
        return [STATUS_NAMES[int(s)] for s in np.asarray(self.status_B)]


@dataclasses.dataclass(frozen=True)
class Batch:
    """A checked, device-ready batch of requests (build it with `specjax.decoding.make_batch`).

    prompt_BP: right-padded prompts; prompt_lengths_B: their lengths; key_B: one key per
    request; capacity: cache slots (static: one compiled program per capacity)."""
    prompt_BP: jax.Array
    prompt_lengths_B: jax.Array
    key_B: jax.Array
    capacity: int


@dataclasses.dataclass(frozen=True)
class Prefill:
    """A batch's prompts already in the caches, made once by `Engine.prefill` and reused by every
    run on that batch (calibration, the speculative run, the target-only run of the main
    command): a long prompt is prefilled once per request, not once per run.

    Any engine with the same target takes ``target_cache``; ``draft_state`` (the drafter's state
    after its own prefill, or None) is used only by an engine with the same drafter, others
    make their own. It stays valid for the next run, unless a run was told to consume it
    (`Engine.run(consume_prefill=True)`, which donates its buffers)."""
    batch: Batch
    target: Any                     # the target model it was made with (static, hashable)
    drafter: Any                    # the drafter whose state it holds, or None
    target_cache: Any
    draft_state: Any = None
    features_BSF: Any = None        # the target's prompt features, when the drafter reads them

    def repeat(self, batch: Batch) -> "Prefill":
        """This one-row prefill as the prefill of `batch`, whose every row is that one prompt
        (n samples of one prompt, each row with its own key): the prompt enters the caches once,
        its cache rows are copied. ValueError if this prefill has more than one row or `batch`
        holds another prompt, length or capacity."""
        one = self.batch
        if np.shape(one.prompt_BP)[0] != 1:
            raise ValueError(f"repeat needs a one-row prefill, this one has {np.shape(one.prompt_BP)[0]} rows")
        n = np.shape(batch.prompt_BP)[0]
        if (batch.capacity != one.capacity or np.shape(batch.prompt_BP)[1] != np.shape(one.prompt_BP)[1]
                or not (np.asarray(batch.prompt_BP) == np.asarray(one.prompt_BP)).all()
                or not (np.asarray(batch.prompt_lengths_B) == np.asarray(one.prompt_lengths_B)[0]).all()):
            raise ValueError("repeat: every row of the batch must be this prefill's prompt (same tokens, length and "
                             "capacity)")
        return dataclasses.replace(self, batch=batch, target_cache=_repeat_rows(self.target_cache, n),
                                   draft_state=_repeat_rows(self.draft_state, n),
                                   features_BSF=_repeat_rows(self.features_BSF, n))


    def parts(self, target, drafter, feature_layers, batch: Batch):
        """(target cache, drafter state or None, features) of this prefill, checked against the
        engine (its target, drafter and the feature layers it reads) and the batch it runs."""
        prefill = self
        if prefill.target != target:
            raise ValueError("this prefill was made with a different target model than the engine's")
        if any(isinstance(x, jax.Array) and x.is_deleted()
               for x in jax.tree.leaves((prefill.target_cache, prefill.draft_state, prefill.features_BSF))):
            raise ValueError("this prefill was consumed by an earlier run (run(consume_prefill=True) takes its "
                             "buffers over); make another with engine.prefill(params, batch)")
        b = prefill.batch
        if b is not batch and (b.capacity != batch.capacity
                               or np.shape(b.prompt_BP) != np.shape(batch.prompt_BP)
                               or not np.array_equal(_host(b.prompt_BP), _host(batch.prompt_BP))
                               or not np.array_equal(_host(b.prompt_lengths_B), _host(batch.prompt_lengths_B))):
            raise ValueError("this prefill was made for a different batch (prompts, lengths or capacity differ); "
                             "make one with engine.prefill(params, batch) for this batch")
        same_drafter = prefill.drafter is not None and prefill.drafter == drafter
        if feature_layers and (prefill.features_BSF is None or not same_drafter):
            raise ValueError("this prefill was not made for this engine's feature head (it holds no target "
                             "features, or features for another drafter): make it with this engine's prefill "
                             "(or let the run prefill)")
        return prefill.target_cache, (prefill.draft_state if same_drafter else None), prefill.features_BSF


def _map_rows(fn, *trees):
    """``fn(axis, *leaves)`` over matching leaves of state trees, with ``axis`` the batch axis of
    each array: a `KVCache`'s buffers on theirs (1 for stacked layers, 0 per layer, its lengths
    0), every other array 0 (a drafter's own state arrays are batch-major, as the protocol says)."""
    def cache(*cs):
        axis = 0 if cs[0].per_layer else 1
        buf = lambda *xs: (tuple(fn(axis, *ys) for ys in zip(*xs)) if cs[0].per_layer   # noqa: E731
                           else fn(axis, *xs))
        return cs[0].replace(k=buf(*(c.k for c in cs)), v=buf(*(c.v for c in cs)),
                             lengths_B=fn(0, *(c.lengths_B for c in cs)))

    def leaf(*xs):
        return cache(*xs) if isinstance(xs[0], models.KVCache) else fn(0, *xs)
    return jax.tree.map(leaf, *trees, is_leaf=lambda x: isinstance(x, models.KVCache))


def _repeat_rows(tree, n: int):
    """Copy the single batch row of every cache / array in `tree` n times (`_map_rows` axes)."""
    def rep(axis, x):
        if np.ndim(x) <= axis or np.shape(x)[axis] != 1:
            raise ValueError(f"repeat: a state array of shape {np.shape(x)} has no single batch row on axis {axis}")
        return jnp.repeat(x, n, axis=axis)
    return _map_rows(rep, tree)


def _set_rows(big, one, slot):
    """`big` with batch row ``slot`` (traced) replaced by the single row of `one` (same structure)."""
    def put(axis, x, y):
        want = x.shape[:axis] + (1,) + x.shape[axis + 1:]
        if y.shape != want:     # a state leaf that is not batch-major would be written into the wrong rows
            raise ValueError(f"refill: a state array of shape {x.shape} takes a row of shape {want}, got {y.shape} "
                             f"(drafter and cache state must be batch-major, see specjax.drafters' protocol)")
        return jax.lax.dynamic_update_slice_in_dim(x, y if y.dtype == x.dtype else y.astype(x.dtype), slot, axis)
    return _map_rows(put, big, one)


@dataclasses.dataclass
class StreamEvent:
    round: int
    new_tokens: list[list[int]]     # per row, the tokens committed this round
    done: list[bool]
    elapsed_s: float                # since the call started (prefill included)
    output: GenerateOutput | None = None   # set on the last event only


def constrain_state(state: LoopState, mesh, rules) -> LoopState:
    """The loop state pinned to ``mesh`` by ``rules`` (default `sharding.DEFAULT_RULES`; identity
    without a mesh; `sharding.constrain_loop_state`)."""
    if mesh is None:
        return state
    from specjax import sharding
    return sharding.constrain_loop_state(state, mesh, rules or sharding.DEFAULT_RULES)


def under_engine_mesh(fn):
    """``fn(engine, ...)`` traced under the engine's mesh (`jax.sharding.use_abstract_mesh`), so
    that an op XLA does not partition by itself (a Pallas kernel: `specjax.kernels.cache_attention`)
    finds the mesh to split its operands over. Without a mesh: ``fn`` itself."""
    @functools.wraps(fn)
    def traced(engine, *args, **kwargs):
        if engine.mesh is None:
            return fn(engine, *args, **kwargs)
        with jax.sharding.use_abstract_mesh(engine.mesh.abstract_mesh):
            return fn(engine, *args, **kwargs)
    return traced


def _write_block(buf_BSF, block_BTF, start_B):
    """buf[b, start_b + t] = block[b, t] for every t (the caller guarantees the room)."""
    return jax.vmap(lambda row, blk, s: jax.lax.dynamic_update_slice(row, blk.astype(row.dtype), (s, 0)))(
        buf_BSF, block_BTF, start_B)


def _write_rows(buf_BS, block_BC, start_B, n_B):
    """buf[b, start_b + j] = block[b, j] for j < n_b; other slots unchanged."""
    K = block_BC.shape[1]

    def one(row_S, blk_C, start, n):
        old_C = jax.lax.dynamic_slice(row_S, (start,), (K,))
        new_C = jnp.where(jnp.arange(K) < n, blk_C, old_C)
        return jax.lax.dynamic_update_slice(row_S, new_C.astype(row_S.dtype), (start,))

    return jax.vmap(one)(buf_BS, block_BC, start_B, n_B)


def _host(x) -> np.ndarray:
    """A (possibly multi-process, sharded) array's global value on the host."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from specjax import sharding
        return sharding.to_host(x)
    return np.asarray(x)


@jax.jit
def _id_range(prompt_BP, lengths_B):
    """Per row, the smallest and largest id among its valid prompt tokens."""
    valid_BP = jnp.arange(prompt_BP.shape[1])[None, :] < lengths_B[:, None]
    info = jnp.iinfo(prompt_BP.dtype)
    return (jnp.min(jnp.where(valid_BP, prompt_BP, info.max), axis=1),
            jnp.max(jnp.where(valid_BP, prompt_BP, info.min), axis=1))


def check_batch(target, config, batch: "Batch") -> None:
    """Checks of a batch against an engine's target and `GenerationConfig` before anything
    runs: XLA clamps out-of-range gathers and writes silently, so a bad length, id or capacity
    would otherwise give wrong tokens without an error. Only the lengths [B] and, per row, the
    smallest and largest prompt id come to the host (reduced where the prompts are, so a batch
    sharded over a pod is not gathered)."""
    lengths_B = _host(batch.prompt_lengths_B)
    B, P = np.shape(batch.prompt_BP)
    if lengths_B.shape != (B,) or lengths_B.min() < 1 or lengths_B.max() > P:
        raise ValueError(f"prompt lengths must be one per row in [1, {P}] (the padded width), got {lengths_B}")
    V = target.vocab_size
    if not np.issubdtype(np.dtype(batch.prompt_BP.dtype), np.integer):
        raise ValueError(f"prompt ids must be integers, got dtype {batch.prompt_BP.dtype} (build batches with "
                         f"specjax.decoding.make_batch)")
    if isinstance(batch.prompt_BP, jax.Array):
        lo_B, hi_B = (_host(x) for x in _id_range(batch.prompt_BP, jnp.asarray(lengths_B)))
    else:                                       # host ids (any integer width): checked as they are
        prompt_BP = np.asarray(batch.prompt_BP)
        valid_BP = np.arange(P)[None, :] < lengths_B[:, None]
        lo_B = np.where(valid_BP, prompt_BP, 0).min(axis=1)
        hi_B = np.where(valid_BP, prompt_BP, 0).max(axis=1)
    bad_B = (lo_B < 0) | (hi_B >= V)
    if bad_B.any():
        b = int(np.argmax(bad_B))
        raise ValueError(f"prompt {b} has token ids outside [0, {V}) (the target's vocabulary): "
                         f"min {lo_B[b]}, max {hi_B[b]}")
    # The target's context length: every committed token's position must be one the model
    # is defined for, prompt + max_new_tokens <= max_position. Drafted tokens scored past
    # the end (up to a verification block) are scratch whose outputs are discarded.
    context = getattr(getattr(target, "config", None), "max_position", None)
    longest = int(lengths_B.max())
    if context is not None and longest >= context:
        b = int(lengths_B.argmax())
        raise ValueError(f"prompt {b} is too long: {longest} tokens, the target's context length is {context} "
                         f"(no position is left for a new token); shorten it to at most {context - 1} tokens")
    if context is not None and longest + config.max_new_tokens > context:
        b = int(lengths_B.argmax())
        raise ValueError(
            f"prompt {b} has {longest} tokens and max_new_tokens={config.max_new_tokens}: "
            f"{longest + config.max_new_tokens} positions exceed the target's context length "
            f"{context} (verification block of {config.max_block + 1} not counted; it is scratch). "
            f"Shorten the prompt or use max_new_tokens <= {max(context - longest, 0)}.")
    need = config.slots_needed(longest)
    if need > batch.capacity:
        raise models.CacheCapacityError(
            f"cache capacity {batch.capacity} is too small: the longest prompt has {int(lengths_B.max())} "
            f"tokens, max_new_tokens={config.max_new_tokens} and a verification block of "
            f"gamma+1={config.max_gamma + 1} need {need} slots. Raise the capacity or shorten the prompt.")
    if P > batch.capacity:
        raise models.CacheCapacityError(f"padded prompt width {P} exceeds the cache capacity {batch.capacity}")
