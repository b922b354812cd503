"""Slots: a loop state whose rows take new requests as others finish (continuous batching).
`specjax.serving`'s scheduler and `generate_offline` drive these through `Engine.empty_state`
and `Engine.refill`. Functions of an `Engine` that use only its public fields and methods."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import calibration
from specjax.decoding._prefill import prefill_caches
from specjax.decoding._state import (PAD_ID, RUNNING, Batch, EngineParams, LoopState, _map_rows, _set_rows,
                                     constrain_state, under_engine_mesh)


def refill_row(engine, params, state: LoopState, slot, prompt_1P, prompt_lengths_1, key_1):
    """The state with row ``slot`` (traced) holding a fresh request: its prompt prefilled into
    that row of the target cache (and the drafter's state, and the features), its tokens,
    lengths, status, key, automaton state and per-row counters reset; other rows and the batch-wide entries
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
        features_BSF=row(state.features_BSF, features_1) if engine.feature_layers else state.features_BSF,
        # no automaton state: the slot's last request's would mask the new one's tokens
        constraint_B=None if state.constraint_B is None else set_at(state.constraint_B, -1)),
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


def resize_rows(engine, state: LoopState, rows_N, round_time_RZ):
    """A loop state of N = len(rows_N) rows: new row i is old row ``rows_N[i]`` (its caches,
    tokens, key, counters and automaton state, as they are), or an empty done row where
    ``rows_N[i]`` < 0. The batch-wide entries (round, rounds per gamma, the adaptive policy's
    estimates and choices) carry over; the policy's round times become ``round_time_RZ``, the
    times measured at N rows (ignored without a policy)."""
    valid_N = rows_N >= 0
    idx_N = jnp.maximum(rows_N, 0)

    def take(axis, x):
        return x[idx_N] if axis == 0 else jnp.take(x, idx_N, axis=axis)

    def rows(tree):
        return None if tree is None else _map_rows(take, tree)

    m = state.metrics
    metrics = m.replace(**{f.name: take(0, getattr(m, f.name)) for f in dataclasses.fields(m)
                           if f.name != "gamma_rounds_Z"})
    policy = state.policy if state.policy is None else state.policy.replace(
        round_time_RZ=jnp.asarray(round_time_RZ, state.policy.round_time_RZ.dtype))
    return constrain_state(state.replace(
        tokens_BS=take(0, state.tokens_BS), lengths_B=take(0, state.lengths_B),
        prompt_lengths_B=take(0, state.prompt_lengths_B), done_B=take(0, state.done_B) | ~valid_N,
        status_B=take(0, state.status_B), target_cache=rows(state.target_cache),
        draft_state=rows(state.draft_state), key_B=take(0, state.key_B), metrics=metrics, policy=policy,
        features_BSF=None if state.features_BSF is None else take(0, state.features_BSF),
        constraint_B=None if state.constraint_B is None else take(0, state.constraint_B)),
        engine.mesh, engine.rules)


_resize_jit = functools.partial(jax.jit, static_argnums=0)(under_engine_mesh(resize_rows))


def resize(engine, state: LoopState, rows, round_time_s=None) -> LoopState:
    """``state`` with ``len(rows)`` rows: new row i holds old row ``rows[i]``, or is an empty
    done row where ``rows[i]`` is None or -1 (to be refilled), so a scheduler can run its rounds
    at the batch size its busy rows need (a round's cost grows with its rows, done or not).
    ``round_time_s``: adaptive gamma's round times measured at the new size (as `empty_state`'s;
    None: the uncalibrated default). Each (old size, new size) pair compiles once."""
    B = int(state.lengths_B.shape[0])
    rows_N = np.asarray([-1 if r is None else int(r) for r in rows], np.int32)
    if rows_N.size < 1:
        raise ValueError("resize needs at least one row")
    picked = rows_N[rows_N >= 0]
    if np.any(picked >= B) or np.any(rows_N < -1) or len(set(picked.tolist())) != picked.size:
        raise ValueError(f"resize: rows must be distinct rows of the state's {B} (or -1 / None for an empty row), "
                         f"got {rows_N.tolist()}")
    rt_RZ = calibration.round_time_table(round_time_s, engine.config.gammas, engine.regimes)
    return _resize_jit(engine, state, jnp.asarray(rows_N), jnp.asarray(rt_RZ))
