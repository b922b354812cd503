"""Peak resident memory of a generation-only process, in a fresh process (`measure(c, workdir)`
runs ``python -m experiments.bench_speed.memory CONFIG.json`` and returns its record).

Stages, each with its end RSS and its own peak (VmHWM of /proc/self/status, reset at the
stage's start by writing 5 to /proc/self/clear_refs; where refused, peaks are cumulative):
``import`` (jax, specjax, the benchmark's modules, then `build.limit_heap_retention()` as the
CLI does; the RSS after it is the baseline), ``backend`` (jax.devices()), ``load`` (the
workload as the benchmark loads it, without transformers), ``drafter``, then ``target_only``
and ``speculative``: `memory_prompts` prompts generated greedily at batch 1 (the first call of
each shape compiles). ratio = (peak - baseline) / (target params + the draft's own params, each
buffer once, + target KV cache + drafter state at the capacity used; sizes by `jax.eval_shape`).
After the last stage: the bytes of live jax arrays, the free heap glibc keeps (the RSS drop on
``malloc_trim(0)``) and jax's cached programs (the further drop on ``jax.clear_caches()``).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pathlib
import subprocess
import sys
import time


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _bytes(tree, seen: set) -> int:
    """nbytes of the array leaves of `tree` whose device buffer is not in `seen` (which grows)."""
    import jax
    total = 0
    for x in jax.tree.leaves(tree):
        try:
            key = x.unsafe_buffer_pointer()
        except Exception:                     # not a single-device array
            key = id(x)
        if hasattr(x, "nbytes") and key not in seen:
            seen.add(key)
            total += int(x.nbytes)
    return total


def _shape_bytes(fn, *args) -> int:
    import jax
    import numpy as np
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(jax.eval_shape(fn, *args))))


def _trim() -> bool:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def child(config_path: str) -> dict:
    stages, resets = [], [reset_peak()]
    t0 = time.perf_counter()

    def end(name, **extra):
        s = status()
        stages.append({"stage": name, "rss": s["VmRSS"], "peak_rss": s["VmHWM"], "rss_anon": s.get("RssAnon"),
                       "rss_file": s.get("RssFile"), "seconds": time.perf_counter() - t0, **extra})

    import jax
    import jax.numpy as jnp
    import ml_collections
    from specjax import build, decoding, sampling
    from experiments.lib import toolkit
    from experiments.lib import workload
    build.tune_xla_cpu()
    build.limit_heap_retention()
    end("import")
    baseline = stages[-1]["rss"]
    c = ml_collections.ConfigDict(json.loads(pathlib.Path(config_path).read_text()))
    c.num_prompts = min(c.memory_prompts, c.num_prompts)

    def stage(name, fn, **extra):
        nonlocal t0
        resets.append(reset_peak())
        t0 = time.perf_counter()
        out = fn()
        end(name, **extra)
        return out

    stage("backend", jax.devices)
    w = stage("load", lambda: workload.load(c, pathlib.Path(c.out) / "_work"))
    kind = c.memory_drafter if c.memory_drafter != "auto" else \
        ("distilled" if workload.has_distilled(w, c) else "early_exit")
    drafter, dparams = stage("drafter", lambda: jax.block_until_ready(workload.drafter(w, kind, c)))
    seen: set = set()
    target_b, draft_b = _bytes(w.params, seen), _bytes(dparams, seen)
    eos = () if c.ignore_eos else w.eos_ids
    gamma = int(c.gamma[kind])
    probe = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=gamma, eos_ids=eos)
    batches = [decoding.make_batch([list(p.ids)], probe, jax.random.key(c.seed),
                                   pad_multiple=c.pad_multiple) for p in w.prompts]
    capacity = max(b.capacity for b in batches)
    greedy = sampling.SamplingConfig.make(temperature=0.0)
    with toolkit.CompileLog() as log:
        for name, d, dp, g in (("target_only", None, None, 0), ("speculative", drafter, dparams, gamma)):
            engine = decoding.Engine(w.target, d, decoding.GenerationConfig(c.max_new_tokens, gamma=g, eos_ids=eos))
            params = decoding.EngineParams(target=w.params, draft=dp)
            with log.section() as box:
                new = stage(name, lambda: [len(jax.device_get(engine.run(params, greedy, b)).generated()[0])
                                           for b in batches])
            stages[-1].update(compile_s=box["compile_s"], new_tokens=new)
    kv = {"target_kv_bytes": _shape_bytes(lambda: w.target.init_cache(1, capacity)),
          "draft_state_bytes": _shape_bytes(lambda dp, t, n: drafter.init(dp, t, n, capacity), dparams,
                                            jnp.zeros((1, capacity), jnp.int32), jnp.ones((1,), jnp.int32))}
    live = _bytes(jax.live_arrays(), set())
    rss0 = status()["VmRSS"]
    trimmed = _trim()
    rss1 = status()["VmRSS"]
    jax.clear_caches()
    gc.collect()
    _trim()
    rss2 = status()["VmRSS"]
    peak = max(s["peak_rss"] for s in stages)
    reference = target_b + draft_b + kv["target_kv_bytes"] + kv["draft_state_bytes"]
    return {"model": w.name, "drafter": kind, "gamma": gamma, "layers": c.layers, "num_prompts": len(batches),
            "max_new_tokens": c.max_new_tokens, "capacity": capacity, "rss_after_import": baseline,
            "peak_rss": peak, "peak_above_import": peak - baseline, "target_param_bytes": target_b,
            "draft_param_bytes": draft_b, **kv, "reference_bytes": reference, "ratio": (peak - baseline) / reference,
            "peak_stage": max(stages, key=lambda s: s["peak_rss"])["stage"], "peak_reset_works": all(resets),
            "live_array_bytes": live, "free_heap_at_end": rss0 - rss1 if trimmed else None,
            "compiled_programs_at_end": rss1 - rss2, "rss_at_end_without_both": rss2, "stages": stages,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def measure(c, workdir, timeout: float = 3600) -> dict:
    """The record of a fresh ``python -m experiments.bench_speed.memory`` process for config `c`."""
    from experiments.lib.toolkit import REPO
    path = pathlib.Path(workdir) / "memory_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(c.to_dict()))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_speed.memory", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])), flush=True)
