"""Slots: a loop state whose rows take new requests as others finish (continuous batching).
`specjax.serving`'s scheduler and `generate_offline` drive these through `Engine.empty_state`
and `Engine.refill`. Functions of an `Engine` that use only its public fields and methods."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding._prefill import prefill_caches
from specjax.decoding._state import (PAD_ID, RUNNING, Batch, EngineParams, LoopState, _set_rows, constrain_state,
                                     under_engine_mesh)


def refill_row(engine, params, state: LoopState, slot, prompt_1P, prompt_lengths_1, key_1):
    """The state with row ``slot`` (traced) holding a fresh request: its prompt prefilled into
    that row of the target cache (and the drafter's state, and the features), its tokens,
    lengths, status, key and per-row counters reset; other rows and the batch-wide entries
    (adaptive policy, round, gamma_rounds_Z) untouched."""
    capacity = state.tokens_BS.shape[1]
    P = prompt_1P.shape[1]
    cache_1, draft_1, features_1 = prefill_caches(engine, params, prompt_1P, prompt_lengths_1, capacity)
    row = lambda big, one: None if one is None else _set_rows(big, one, slot)    # noqa: E731
    set_at = lambda x_B, v: x_B.at[slot].set(v)                                    # noqa: E731
    m = state.metrics
    metrics = m.replace(**{f.name: getattr(m, f.name).at[slot].set(0) for f in dataclasses.fields(m)
                           if f.name != "gamma_rounds_Z"})       # the batch-wide count stays
    return constrain_state(state.replace(
        tokens_BS=row(state.tokens_BS, jnp.full((1, capacity), PAD_ID, jnp.int32).at[:, :P].set(prompt_1P)),
        lengths_B=set_at(state.lengths_B, prompt_lengths_1[0]),
        prompt_lengths_B=set_at(state.prompt_lengths_B, prompt_lengths_1[0]),
        done_B=set_at(state.done_B, False), status_B=set_at(state.status_B, RUNNING),
        target_cache=row(state.target_cache, cache_1),
        draft_state=row(state.draft_state, draft_1) if engine.config.max_gamma > 0 else state.draft_state,
        key_B=row(state.key_B, key_1), metrics=metrics,
        features_BSF=row(state.features_BSF, features_1) if engine.feature_layers else state.features_BSF),
        engine.mesh, engine.rules)


_refill_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames="state")(under_engine_mesh(refill_row))


def empty_state(engine, params: EngineParams, slots: int, capacity: int, round_time_s=None,
                key: jax.Array | None = None) -> LoopState:
    """A loop state of ``slots`` empty rows (done, holding a one-token placeholder) for
    `refill`: the start of a slot-refilling scheduler (`specjax.serving`). `step` on it
    commits nothing until a row is refilled; done rows cost a round like active ones.
    ``key``: of the kind the requests' keys will be (a typed `jax.random.key`, the default,
    or a legacy uint32 `PRNGKey`); refills must match it."""
    key = jax.random.key(0) if key is None else key
    placeholder = Batch(prompt_BP=jnp.zeros((slots, 1), jnp.int32), prompt_lengths_B=jnp.ones((slots,), jnp.int32),
                        key_B=jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(slots)),
                        capacity=int(capacity))
    if engine.mesh is not None:
        placeholder = engine.place_batch(placeholder)
    state = engine.init(params, placeholder, round_time_s)
    return state.replace(done_B=jnp.ones_like(state.done_B))


def refill(engine, params: EngineParams, state: LoopState, slot: int, prompt: Batch) -> LoopState:
    """Row ``slot`` of ``state`` replaced by the one-row request ``prompt`` (a `Batch` of one
    row with the state's capacity, its key the request's own): its prompt is prefilled into
    that row while the other rows keep their caches and progress. ``state`` is donated.
    With a fixed gamma the row then decodes as the request would alone (same key, same
    tokens, up to float rounding that depends on the batch shape: a greedy near-tie or a
    uniform draw at a CDF boundary can flip); the request's checks (ids, context length,
    capacity) run first."""
    capacity = int(state.tokens_BS.shape[1])
    if np.shape(prompt.prompt_BP)[0] != 1:
        raise ValueError(f"refill takes a one-row batch, got {np.shape(prompt.prompt_BP)[0]} rows")
    if prompt.capacity != capacity:
        raise ValueError(f"refill: the request's capacity {prompt.capacity} differs from the state's {capacity}")
    if not 0 <= int(slot) < state.lengths_B.shape[0]:
        raise ValueError(f"slot {slot} outside [0, {state.lengths_B.shape[0]})")
    engine.check(prompt)
    return _refill_jit(engine, params, state, jnp.int32(slot), prompt.prompt_BP, prompt.prompt_lengths_B,
                            prompt.key_B)
