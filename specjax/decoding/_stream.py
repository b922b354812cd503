"""Streaming generation: the same round as the jitted loop, one round per host call.

Use it for interactive output (text appears as each round commits) and for host-side timing
(time to first token, inter-token latency). The loop state is donated to each round, so the
caches are updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator

import jax
import numpy as np

from specjax.decoding import _engine


@dataclasses.dataclass
class StreamEvent:
    round: int
    new_tokens: list[list[int]]     # per row, the tokens committed this round
    done: list[bool]
    elapsed_s: float                # since the call started (prefill included)


@functools.partial(jax.jit, static_argnames=("target", "drafter", "config", "capacity"))
def init_state(target, target_params, drafter, draft_params, config, prompt_BP, prompt_lengths_B,
               key_B, capacity):
    """Prefill both models and build the loop state (jitted)."""
    return _engine._init_state(target, target_params, drafter, draft_params, config, prompt_BP,
                               prompt_lengths_B, key_B, capacity)


@functools.partial(jax.jit, static_argnames=("target", "drafter", "config"), donate_argnames=("state",))
def step(target, target_params, drafter, draft_params, config, sampling, round_time_K, state):
    """One round (jitted; the state is donated)."""
    return _engine._step(target, target_params, drafter, draft_params, config, sampling, round_time_K, state)


def stream_generate(target, target_params, drafter, draft_params, prompt_BP, prompt_lengths_B, key_B,
                    sampling, config: _engine.GenerationConfig, round_time_s=None,
                    capacity: int | None = None) -> Iterator[StreamEvent]:
    """Yields the tokens each round commits, per row, with host wall-clock timestamps.

    The generator returns the final `LoopState` (the `StopIteration.value`; `run_stream`
    collects it for you).
    """
    _engine._check_pair(target, drafter, config)
    capacity = _engine._checked_capacity(prompt_BP, prompt_lengths_B, config, capacity)
    round_time_K = _engine._round_times(config, round_time_s)
    t0 = time.perf_counter()
    state = init_state(target, target_params, drafter, draft_params, config, prompt_BP, prompt_lengths_B,
                       key_B, capacity)
    lengths = np.asarray(state.lengths_B)
    max_rounds = config.max_rounds or config.max_new_tokens
    r = 0
    while r < max_rounds:
        state = step(target, target_params, drafter, draft_params, config, sampling, round_time_K, state)
        new_lengths, done = jax.device_get((state.lengths_B, state.done_B))
        grew = [(int(a), int(b)) for a, b in zip(lengths, new_lengths)]
        if any(b > a for a, b in grew):
            rows = np.asarray(state.tokens_BL)
            new_tokens = [rows[i, a:b].tolist() for i, (a, b) in enumerate(grew)]
        else:
            new_tokens = [[] for _ in grew]
        r += 1
        yield StreamEvent(round=r, new_tokens=new_tokens, done=[bool(d) for d in done],
                          elapsed_s=time.perf_counter() - t0)
        lengths = new_lengths
        if bool(np.all(done)):
            break
    return state


def run_stream(*args, **kwargs):
    """Consume `stream_generate`; returns (events, final LoopState)."""
    gen = stream_generate(*args, **kwargs)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


def timing_summary(events: list[StreamEvent], row: int = 0) -> dict:
    """Host-side latency metrics of one row from its stream events.

    ttft_s: time to the first committed token (prefill, first round and any compilation);
    inter_token_s: mean time per token after the first round (a round's wall time spread
    over the tokens it committed); tokens_per_s: tokens after the first round / their time.
    """
    times, counts = [], []
    for e in events:
        if e.new_tokens[row]:
            times.append(e.elapsed_s)
            counts.append(len(e.new_tokens[row]))
    if not times:
        return {"ttft_s": float("nan"), "tokens": 0, "inter_token_s": float("nan"), "tokens_per_s": float("nan")}
    after = sum(counts[1:])
    span = times[-1] - times[0]
    return {"ttft_s": times[0], "tokens": sum(counts),
            "inter_token_s": span / after if after else float("nan"),
            "tokens_per_s": after / span if span > 0 else float("nan")}


def calibrate_round_times(target, target_params, drafter, draft_params, prompt_BP, prompt_lengths_B, sampling,
                          config: _engine.GenerationConfig, repeats: int = 5,
                          capacity: int | None = None) -> list[float]:
    """Median wall time of one round for each gamma in `config.gammas`, on these prompts.

    Feeds `AdaptiveGamma` (`round_time_s=`); run once per model pair and machine. Each gamma
    is compiled and warmed up first; every timed call starts from the same prefilled state,
    so all repeats do identical work.
    """
    capacity = _engine._checked_capacity(prompt_BP, prompt_lengths_B, config, capacity)
    key_B = _engine.request_keys(jax.random.key(0), list(range(prompt_BP.shape[0])))
    state = init_state(target, target_params, drafter, draft_params, config, prompt_BP, prompt_lengths_B,
                       key_B, capacity)
    out = []
    for g in config.gammas:
        # Weights are arguments, not closure constants (XLA would embed them in the program).
        fn = jax.jit(lambda tp, dp, s, g=g: _engine._round(target, tp, drafter, dp, config, sampling, g, s))
        jax.block_until_ready(fn(target_params, draft_params, state))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(target_params, draft_params, state))
            ts.append(time.perf_counter() - t0)
        out.append(float(np.median(ts)))
    return out
