"""Many requests through one engine in length-sorted batches: the data engine's path.

A batch costs what its longest prompt costs: every row is prefilled to the batch's padded
width and every decode round attends over the batch's whole cache capacity. Requests are
therefore sorted by prompt length and cut into batches of up to ``batch_size`` rows, each
with its own width and capacity (`make_batch`; programs are compiled per shape, so widths
are rounded up to ``pad_multiple``). Rows shrink below ``batch_size`` only where the batch's
target cache would pass ``max_cache_bytes``.

Request r samples with ``fold_in(key, request_ids[r])`` (`request_keys`), so, at a fixed
gamma, what a request generates does not depend on the batching, the order or the batch size
(up to float rounding that depends on the batch shape, as for `Engine.refill`).

Each batch is prefilled (`Engine.prefill`) and then run (`Engine.run`) as two timed calls, so a
report gives prefill and decode throughput apart (`BatchReport`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, ContextManager, Iterator, Sequence

import jax
import numpy as np

from specjax import sampling as sampling_lib
from specjax.decoding._engine import Engine
from specjax.decoding._state import STATUS_NAMES, EngineParams
from specjax.decoding._request import _round_up, make_batch

# The most bytes one batch's target KV cache may take before its rows are cut (the run updates
# the prefill's cache in place, `Engine.run(consume_prefill=True)`, so it is held once).
MAX_CACHE_BYTES = 4 << 30


@dataclasses.dataclass
class BatchedResult:
    """One request's continuation from `generate_batched`: ``index`` into the prompts given, its
    generated ids and status (a served request's result, with its times and counters, is
    `specjax.serving.RequestResult`)."""
    index: int
    tokens: list[int]
    status: str


@dataclasses.dataclass
class BatchReport:
    """What one batch did: rows, padded width and capacity, prompt and generated tokens, the
    seconds of its prefill and of its decode (both waited for), and the rounds it ran."""
    rows: int
    width: int
    capacity: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    rounds: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def cache_bytes_per_row(engine: Engine, capacity: int) -> int:
    """Bytes of one row of the target's KV cache at ``capacity`` slots (no allocation)."""
    shapes = jax.eval_shape(lambda: engine.target.init_cache(1, capacity))
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)
                   if hasattr(x, "shape") and len(x.shape) > 1))


def plan_batches(prompt_lengths: Sequence[int], engine: Engine, *, batch_size: int, pad_multiple: int,
                 max_cache_bytes: int = MAX_CACHE_BYTES, sort_by_length: bool = True) -> list[list[int]]:
    """Request indices in batches: sorted by prompt length (ties in index order; or in the
    order given, with ``sort_by_length=False``), at most ``batch_size`` rows, fewer where a
    batch's cache (its longest prompt's capacity, see `GenerationConfig.slots_needed`) would
    pass ``max_cache_bytes``; never fewer than one."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    lengths = np.asarray(prompt_lengths, np.int64)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i)) if sort_by_length else list(range(len(lengths)))
    per_row: dict[int, int] = {}
    batches, start = [], 0
    while start < len(order):
        rows = min(batch_size, len(order) - start)
        while True:
            longest = int(max(lengths[i] for i in order[start:start + rows]))
            capacity = max(_round_up(engine.config.slots_needed(longest), pad_multiple),
                           _round_up(longest, pad_multiple))
            if capacity not in per_row:
                per_row[capacity] = cache_bytes_per_row(engine, capacity)
            if rows == 1 or rows * per_row[capacity] <= max_cache_bytes:
                break
            rows = max(1, min(rows - 1, max_cache_bytes // per_row[capacity]))
        batches.append(order[start:start + rows])
        start += rows
    return batches


def generate_batched(engine: Engine, params: EngineParams, prompts: Sequence[Sequence[int]],
                     sampling: sampling_lib.SamplingConfig, key: jax.Array, *, batch_size: int,
                     pad_multiple: int = 64, request_ids: Sequence[int] | None = None,
                     max_cache_bytes: int = MAX_CACHE_BYTES, sort_by_length: bool = True,
                     section: Callable[[str], ContextManager] | None = None,
                     ) -> Iterator[tuple[list[BatchedResult], BatchReport]]:
    """Run every prompt (token ids) through ``engine``, batch by batch (`plan_batches`); yields
    each batch's results (in the batch's order) and its `BatchReport` as soon as it is done, so
    a caller can write them out and resume. Request r is keyed by ``request_ids[r]`` (default r).
    ``section(name)``, if given, wraps each batch's 'prefill' and 'decode' call (a context
    manager: e.g. a benchmark's compile-time log).
    Raises ValueError for no prompts or a wrong number of request ids before anything runs."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    ids = list(range(len(prompts))) if request_ids is None else [int(i) for i in request_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} request ids for {len(prompts)} prompts")
    for batch_rows in plan_batches([len(p) for p in prompts], engine, batch_size=batch_size,
                                   pad_multiple=pad_multiple, max_cache_bytes=max_cache_bytes,
                                   sort_by_length=sort_by_length):
        batch = make_batch([prompts[i] for i in batch_rows], engine.config, key,
                           request_ids=[ids[i] for i in batch_rows], pad_multiple=pad_multiple)
        batch = batch if engine.mesh is None else engine.place_batch(batch)
        wrap = section or (lambda name: contextlib.nullcontext())
        t0 = time.perf_counter()
        with wrap("prefill"):
            pre = engine.prefill(params, batch)
            jax.block_until_ready((pre.target_cache, pre.draft_state, pre.features_BSF))
        t1 = time.perf_counter()
        with wrap("decode"):
            # The run takes the prefill's caches over: one copy of them in memory, not two.
            out = jax.device_get(engine.run(params, sampling, batch, prefill=pre, consume_prefill=True))
        t2 = time.perf_counter()
        del pre
        generated = out.generated()
        results = [BatchedResult(index=i, tokens=generated[j], status=STATUS_NAMES[int(out.status_B[j])])
                   for j, i in enumerate(batch_rows)]
        report = BatchReport(rows=len(batch_rows), width=int(batch.prompt_BP.shape[1]), capacity=batch.capacity,
                             prompt_tokens=int(np.sum(out.prompt_lengths_B)),
                             new_tokens=sum(len(g) for g in generated), prefill_s=t1 - t0, decode_s=t2 - t1,
                             rounds=int(np.max(out.metrics.rounds_B)))
        yield results, report
