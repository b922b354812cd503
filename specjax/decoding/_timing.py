"""Round timing: the measured seconds of one round per gamma (and per draft source) that
adaptive gamma's policy prices rounds with (`Engine.round_times`; cached per machine and
setting by `specjax.calibration`). Uses only the engine's public fields and methods: its state
from `Engine.init`, its round from the `RoundPipeline` it holds (``engine.pipeline``)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from specjax.decoding._state import Batch, EngineParams, Prefill, under_engine_mesh

# One round at a static proposal, the state donated (caches updated in place, as in the loop).
@under_engine_mesh
def _round(engine, params, sampling, gamma, state):
    return engine.pipeline.run(params, sampling, gamma, state)


_round_jit = functools.partial(jax.jit, static_argnums=(0, 3), donate_argnames="state")(_round)


def round_times(engine, params: EngineParams, sampling, batch: Batch, repeats: int = 5,
                prefill: Prefill | None = None) -> list[float]:
    """Median wall time of one round for each gamma in `config.gammas`, on this batch; for a
    drafter with several regimes (`regimes`), for each (regime, gamma), regime-major, each
    regime timed with the drafter held to it (``drafter.for_regime(r)``).

    Feeds adaptive gamma (``round_time_s=``); run once per model pair and machine. Each
    gamma is compiled and warmed up first. Rounds run as in the loop: the state is donated
    (caches updated in place) and each round continues from the previous one's state, so a
    timed round does exactly the work of a round of `run` (rows that finish keep running
    masked, at the same cost; the capacity check of `init` covers every round's writes)."""
    if repeats < 1:
        raise ValueError(f"round_times needs repeats >= 1 timed rounds per gamma, got {repeats}")
    if engine.regimes == 1:
        return _time_rounds(engine, params, sampling, batch, repeats, prefill)
    out = []
    for r in range(engine.regimes):
        held = engine.drafter.for_regime(r)      # same state and weights as the drafter's
        pre = (prefill if prefill is None or prefill.drafter != engine.drafter
               else dataclasses.replace(prefill, drafter=held))
        out += _time_rounds(dataclasses.replace(engine, drafter=held), params, sampling, batch, repeats, pre)
    return out


def _time_rounds(engine, params, sampling, batch, repeats, prefill) -> list[float]:
    """Median seconds of one round per gamma of ``engine`` (its drafter as it is). Every gamma
    is compiled and run once first; then the timed rounds take the gammas in turn, ``repeats``
    times over, so a machine that slows down or speeds up during the calibration moves every
    gamma's times alike instead of the ones timed last (the policy compares them)."""
    state = engine.init(params, batch, prefill=prefill)
    gammas = engine.config.gammas
    for g in gammas:
        state = jax.block_until_ready(_round_jit(engine, params, sampling, g, state)[0])
    ts_Z = [[] for _ in gammas]
    for _ in range(repeats):
        for ts, g in zip(ts_Z, gammas):
            t0 = time.perf_counter()
            state = jax.block_until_ready(_round_jit(engine, params, sampling, g, state)[0])
            ts.append(time.perf_counter() - t0)
    return [float(np.median(ts)) for ts in ts_Z]
