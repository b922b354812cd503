"""Resident memory of a generation-only process (issue 6: "resident memory above the level right
after import stays within 1.5x of weights plus KV cache").

`measure(...)` runs ``python -m experiments.bench_speed.memory ...`` in a fresh process, so
nothing the benchmark itself allocated (torch, transformers, the bandwidth probe, other
compiled configurations) is counted, and returns the JSON record that process prints last.

The process, stage by stage (each stage's end RSS and its peak are recorded):

1. ``import``: jax, specjax (decoding, drafters, loaders, tokenizer) and the benchmark's
   workload / specjax-timing modules; then `specjax.build.limit_heap_retention()`, as the main
   command calls it before loading. VmRSS from /proc/self/status right after this is the
   baseline, ``rss_after_import``.
2. ``backend``: the XLA backend is started (``jax.devices()``).
3. ``load``: the target and prompts exactly as the benchmark loads them
   (`workload.load_workload`, without transformers; ``--model tiny`` is then the specjax-built
   random model of the same shapes), inputs and cache capacities from `sj_bench.prepare_inputs`.
4. ``drafter``: the drafter from `sj_bench.Drafters` (i.e. `specjax.build.make_drafter`).
5. ``target_only`` / ``speculative``: every prompt generated once, greedily, to
   ``--max_new_tokens`` (or a stop token) with `decoding.autoregressive_generate`, then with
   `decoding.speculative_generate` (``--drafter`` at ``--gamma``), at the benchmark's cache
   capacities; the first call of each shape compiles (its seconds are recorded).

Peak: VmHWM of /proc/self/status. Before each stage the high-water mark is reset to the
current RSS (writing "5" to /proc/self/clear_refs, Linux >= 4.0) so that every stage gets its
own peak; where the reset is refused the peaks are cumulative. Either way the overall
``peak_rss``, the largest stage peak, is the process's high-water mark since the imports.

Reference bytes:
* ``target_param_bytes``: nbytes of every leaf of the target's params, each device buffer
  counted once (a tied embedding / head is one buffer).
* ``draft_param_bytes``: the draft's own buffers, i.e. those not already counted for the
  target (0 for an early-exit draft, which slices nothing out of the target: it reuses the
  target's per-layer arrays; the distilled draft's layers, norm and reduced head; its
  embedding is the target's buffer).
* ``kv_bytes``: the target's KV cache at the largest capacity used (`target.init_cache`) plus
  the drafter's state at that capacity (`drafter.init`: the draft model's KV cache, nothing
  for n-gram and early-exit drafters), sizes from `jax.eval_shape` (nothing allocated).

``ratio`` = (peak_rss - rss_after_import) / (target_param_bytes + draft_param_bytes + kv_bytes),
the issue's target being ``ratio <= 1.5``. For attribution the record also carries RssAnon /
RssFile per stage (RssFile grows when shared libraries or a memory-mapped GGUF file are paged
in), the compile seconds of each generation stage, and, measured after the last stage (so
after the peak): the bytes of all live jax arrays (``live_array_bytes``, each buffer once), the
free heap the allocator keeps (``free_heap_at_end``: the RSS drop on glibc's ``malloc_trim(0)``)
and the memory of jax's traced and compiled programs (``compiled_programs_at_end``: the further
drop on ``jax.clear_caches()``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

TARGET_RATIO = 1.5
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


# ----------------------------------------------------------------------------- /proc readings

def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes (the kB values of `path`)."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in _STATUS_FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Set VmHWM back to the current VmRSS (proc(5), /proc/PID/clear_refs value 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StageLog:
    """Per stage: RSS, RssAnon, RssFile at its end and the peak RSS during it (VmHWM)."""

    def __init__(self):
        self.stages: list[dict] = []
        self.peak_reset_works = True

    def start(self):
        self.peak_reset_works = reset_peak() and self.peak_reset_works
        self._t0 = time.perf_counter()

    def end(self, name: str, **extra):
        s = read_status()
        self.stages.append({"stage": name, "rss": s["VmRSS"], "peak_rss": s["VmHWM"],
                            "rss_anon": s.get("RssAnon"), "rss_file": s.get("RssFile"),
                            "seconds": time.perf_counter() - self._t0, **extra})


# ----------------------------------------------------------------------------- byte counts

def _buffer_key(x):
    """Identity of the device memory behind a jax array (its buffer address where available)."""
    try:
        return ("buffer", x.unsafe_buffer_pointer())
    except Exception:            # multi-device or deleted arrays: fall back to the object
        return ("object", id(x))


def own_bytes(tree, seen: set) -> int:
    """nbytes of the array leaves of `tree` whose buffer is not in `seen` (which it extends)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "nbytes"):
            continue
        key = _buffer_key(x)
        if key not in seen:
            seen.add(key)
            total += int(x.nbytes)
    return total


def shape_bytes(fn, *args) -> int:
    """Bytes of the arrays `fn(*args)` would return, from `jax.eval_shape` (no allocation)."""
    import jax
    import numpy as np

    return int(sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                   for s in jax.tree.leaves(jax.eval_shape(fn, *args))))


def kv_bytes(target, drafter, draft_params, capacity: int, batch: int = 1) -> dict:
    """Target KV cache and drafter state at `capacity` slots for `batch` rows, in bytes."""
    import jax.numpy as jnp

    out = {"target_kv_bytes": shape_bytes(lambda: target.init_cache(batch, capacity)), "draft_state_bytes": 0}
    if drafter is not None:
        tokens = jnp.zeros((batch, capacity), jnp.int32)
        lengths = jnp.ones((batch,), jnp.int32)
        out["draft_state_bytes"] = shape_bytes(
            lambda dp, t, n: drafter.init(dp, t, n, capacity), draft_params, tokens, lengths)
    return out


def live_arrays(counted: set) -> dict:
    """Bytes of all live jax arrays, and the largest groups (shape, dtype) of those whose buffer
    is not among `counted` (neither weights nor, being allocated per call, caches)."""
    import collections

    import jax

    total, other, seen = 0, collections.Counter(), set()
    for x in jax.live_arrays():
        key = _buffer_key(x)
        if key in seen:              # two array objects on one buffer (e.g. the shared embedding)
            continue
        seen.add(key)
        total += int(x.nbytes)
        if key not in counted:
            other[f"{tuple(x.shape)} {x.dtype}"] += int(x.nbytes)
    return {"live_array_bytes": total, "live_arrays_not_weights": dict(other.most_common(5))}


def _malloc_trim() -> bool:
    """glibc's malloc_trim(0): hand free heap pages back to the OS; False where unavailable."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def attribution_at_end() -> dict:
    """Run after every stage (the peak is already recorded): how much of the final RSS is free
    heap that the allocator keeps (the drop on `malloc_trim(0)`), and how much jax's caches of
    traced and compiled programs hold (the further drop on `jax.clear_caches()` + trim)."""
    import gc

    import jax

    rss0 = read_status()["VmRSS"]
    trimmed = _malloc_trim()
    rss1 = read_status()["VmRSS"]
    jax.clear_caches()
    gc.collect()
    _malloc_trim()
    rss2 = read_status()["VmRSS"]
    return {"free_heap_at_end": rss0 - rss1 if trimmed else None, "compiled_programs_at_end": rss1 - rss2,
            "rss_at_end_without_both": rss2}


# ----------------------------------------------------------------------------- the child process

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="peak resident memory of a generation-only process (one JSON line)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workdir", required=True, help="scratch directory (the tiny model's weights)")
    p.add_argument("--num_prompts", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--drafter", choices=("ngram", "early_exit", "distilled"), default="distilled")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--draft_model", default="")
    p.add_argument("--early_exit_layers", type=int, default=4)
    p.add_argument("--max_ngram", type=int, default=3)
    p.add_argument("--pad_multiple", type=int, default=128)
    p.add_argument("--layers", choices=("fused", "unrolled", "scan"), default="fused",
                   help="the target's layer loop, as the benchmark's --layers")
    p.add_argument("--ignore_eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def greedy_generate(w, drafter, draft_params, inp, gamma: int, max_new_tokens: int, eos_ids) -> int:
    """One greedy generation of `inp` (an `sj_bench.Inputs`: padded prompt, key, capacity) with
    `decoding.autoregressive_generate` (gamma 0) or `decoding.speculative_generate`, as a user
    would call them (the first call of a shape compiles); returns the number of tokens generated."""
    import jax

    from specjax import decoding
    from specjax import sampling as sampling_lib

    samp = sampling_lib.SamplingConfig.make(temperature=0.0)
    if gamma == 0:
        out = decoding.autoregressive_generate(w.target, w.params, inp.prompt_BP, inp.plens_B, inp.key_B, samp,
                                               max_new_tokens, eos_ids=eos_ids, capacity=inp.capacity)
    else:
        config = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma, eos_ids=tuple(eos_ids))
        out = decoding.speculative_generate(w.target, w.params, drafter, draft_params, inp.prompt_BP, inp.plens_B,
                                            inp.key_B, samp, config, capacity=inp.capacity)
    return len(jax.device_get(out).generated()[0])


def measure_in_process(args, rss_after_import: int, log: StageLog) -> dict:
    """Stages 2-5 of the module doc in this process; returns the record."""
    import jax

    from experiments.bench_speed import common, sj_bench
    from experiments.bench_speed.workload import load_workload

    log.start()
    jax.devices()
    log.end("backend")

    log.start()
    w = load_workload(args.model, args.num_prompts, pathlib.Path(args.workdir), args.seed,
                      with_transformers=False, layers=args.layers)
    inputs = sj_bench.prepare_inputs(w, args.max_new_tokens, args.gamma, args.pad_multiple, args.seed)
    log.end("load")

    log.start()
    drafters = sj_bench.Drafters(w, args.early_exit_layers, args.max_ngram, args.draft_model)
    drafter, dparams = drafters.get(args.drafter)
    jax.block_until_ready(dparams)
    log.end("drafter")

    seen: set = set()
    target_b = own_bytes(w.params, seen)
    draft_b = own_bytes(dparams, seen)
    capacity = max(i.capacity for i in inputs)
    kv = kv_bytes(w.target, drafter, dparams, capacity)

    eos_ids = () if args.ignore_eos else w.eos_ids
    with common.CompileLog() as clog:
        for stage, gamma in (("target_only", 0), ("speculative", args.gamma)):
            log.start()
            with clog.section() as box:
                new_tokens = [greedy_generate(w, drafter, dparams, inp, gamma, args.max_new_tokens, eos_ids)
                              for inp in inputs]
            log.end(stage, compile_s=box["compile_s"], compiles=box["compiles"], new_tokens=new_tokens)

    peak = max(s["peak_rss"] for s in log.stages)
    live = live_arrays(seen)
    reference = target_b + draft_b + kv["target_kv_bytes"] + kv["draft_state_bytes"]
    above = peak - rss_after_import
    return {
        "model": w.name, "drafter": args.drafter, "gamma": args.gamma, "layers": args.layers,
        "num_prompts": len(inputs), "max_new_tokens": args.max_new_tokens, "capacity": capacity,
        "rss_after_import": rss_after_import, "peak_rss": peak, "peak_above_import": above,
        "rss_at_end": log.stages[-1]["rss"], **live, **attribution_at_end(),
        "target_param_bytes": target_b, "draft_param_bytes": draft_b, **kv,
        "reference_bytes": reference, "ratio": above / reference if reference > 0 else float("nan"),
        "target_ratio": TARGET_RATIO, "peak_stage": max(log.stages, key=lambda s: s["peak_rss"])["stage"],
        "peak_reset_works": log.peak_reset_works, "stages": log.stages,
        "jax_backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = StageLog()
    log.start()
    # Everything generation needs, imported before the baseline reading.
    import jax  # noqa: F401
    import specjax  # noqa: F401
    from specjax import build, decoding, drafters, models, sampling  # noqa: F401
    from specjax.models import tokenizer  # noqa: F401
    from experiments.bench_speed import common, sj_bench, workload  # noqa: F401
    build.tune_xla_cpu()               # as the main command (specjax.cli) does before loading
    build.limit_heap_retention()
    log.end("import")
    rec = measure_in_process(args, log.stages[-1]["rss"], log)
    rec["holds"] = bool(math.isfinite(rec["ratio"]) and rec["ratio"] <= TARGET_RATIO)
    print(json.dumps(rec), flush=True)
    return rec


# ----------------------------------------------------------------------------- the parent side

def measure(*, model: str, workdir, num_prompts: int, max_new_tokens: int, drafter: str, gamma: int,
            draft_model: str = "", early_exit_layers: int = 4, max_ngram: int = 3, pad_multiple: int = 128,
            layers: str = "fused", ignore_eos: bool = False, seed: int = 0, timeout: float = 3600) -> dict:
    """Runs the measurement in a fresh ``python -m experiments.bench_speed.memory`` process (same
    environment, repository on PYTHONPATH) and returns its record; raises if the process fails."""
    from experiments.bench_speed.common import REPO

    cmd = [sys.executable, "-m", "experiments.bench_speed.memory", "--model", model, "--workdir", str(workdir),
           "--num_prompts", str(num_prompts), "--max_new_tokens", str(max_new_tokens), "--drafter", drafter,
           "--gamma", str(gamma), "--draft_model", draft_model, "--early_exit_layers", str(early_exit_layers),
           "--max_ngram", str(max_ngram), "--pad_multiple", str(pad_multiple), "--layers", layers,
           "--seed", str(seed)] + (["--ignore_eos"] if ignore_eos else [])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    rec = json.loads(lines[-1])
    rec["command"] = " ".join(cmd[1:])
    return rec


if __name__ == "__main__":
    main()
