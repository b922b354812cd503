"""Runtime setup a command does before anything runs on a device: XLA's options, the allocator,
the persistent compilation cache."""

from __future__ import annotations

import pathlib


def enable_compilation_cache(directory: str) -> str | None:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so a second run of
    the same shapes skips XLA compilation. ``directory`` may use ``~``; "" leaves it off.
    Must run before the first compilation. Returns the directory used."""
    if not directory:
        return None
    import jax
    path = str(pathlib.Path(directory).expanduser())
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def limit_heap_retention(mmap_threshold: int = 1024 * 1024) -> bool:
    """glibc only: serve every allocation of at least `mmap_threshold` bytes with its own
    mapping, returned to the OS when freed. By default glibc raises that threshold after each
    large free, so the buffers freed while loading (dequantized tensors, per-layer splits) stay
    in the heap for good; pinning it lowers the peak resident memory of a generation process
    (measured in experiments/bench_speed/PROFILE.md). Call before loading.

    The threshold is 1 MiB, not glibc's initial 128 KiB: below it every speculative round's
    multi-token temporaries (e.g. the block's logits) are fresh mappings, faulted in and
    unmapped each round, which slows every round (experiments/bench_speed/PROFILE.md, "Memory").
    Returns whether it applied (False off Linux/glibc)."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3                  # <malloc.h> M_MMAP_THRESHOLD
        return libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
    except (OSError, AttributeError):
        return False


# XLA CPU options the fast path relies on (experiments/bench_speed/PROFILE.md, "What an XLA
# profile showed"): with XLA's default copy insertion every donated per-layer cache buffer that
# a layer reads (attention) and then updates in place was copied, twice, on every decode step;
# the region analysis proves the read precedes the write and drops them. Semantics are unchanged.
XLA_CPU_FLAGS = ("--xla_cpu_copy_insertion_use_region_analysis=true",)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):     # private API; if it moves, assume the worst
        return True


def tune_xla_cpu(flags: tuple[str, ...] = XLA_CPU_FLAGS) -> bool:
    """Add `flags` to XLA_FLAGS (those not already set there). XLA reads them when the first
    backend starts, so call this before anything runs on a device; returns False (and changes
    nothing) when a backend is already running. Set SPECJAX_XLA_DEFAULTS=0 to skip it. Every
    entry point calls it first, so it also leaves the TPU backend out where libtpu is installed
    but no TPU exists (`distributed.platforms_without_tpu`: no libtpu start-up errors)."""
    import os

    from specjax import distributed
    if _backend_started():
        return False
    distributed.platforms_without_tpu()
    if os.environ.get("SPECJAX_XLA_DEFAULTS", "1") == "0":
        return False
    current = os.environ.get("XLA_FLAGS", "")
    names = {f.split("=", 1)[0] for f in current.split()}
    extra = [f for f in flags if f.split("=", 1)[0] not in names]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return True


STRICT_PRECISION_FLAG = "--xla_allow_excess_precision=false"


def strict_precision(on: bool) -> bool:
    """With ``on``, make XLA round every bfloat16 (and float16) operation's result as the program
    says (``--xla_allow_excess_precision=false``). By default XLA may drop a round-trip through
    bfloat16 inside a fusion, so the same operation can round differently in programs that fuse
    differently (a target-only step and a speculative round); configs/generate_tpu.py and
    generate_gpu.py set ``strict_precision``. Call before the first backend starts; returns False (changing
    nothing) when a backend already runs, True otherwise."""
    import os
    if not on:
        return True
    if _backend_started():
        return False
    current = os.environ.get("XLA_FLAGS", "")
    if "--xla_allow_excess_precision" not in current:
        os.environ["XLA_FLAGS"] = f"{current} {STRICT_PRECISION_FLAG}".strip()
    return True
