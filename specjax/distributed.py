"""Multi-host start-up through JAX's own multi-controller runtime (`jax.distributed`).

Every process of a job runs the same program; `initialize` connects it to the others, after
which `jax.devices()` lists the devices of the whole job and meshes (`specjax.sharding`) span
them. specjax adds no cluster layer of its own: this module only chooses what to pass to
`jax.distributed.initialize` and enables CPU collectives.

* Cloud TPU (pod slices) and SLURM: no arguments; JAX detects the coordinator, the process
  count and this process's id from the environment.
* Explicit (a local multi-process run, `launch/local_cpu.sh`, or any other launcher): a
  coordinator ``host:port`` with the process count and id, given as arguments or in the
  environment as ``SPECJAX_COORDINATOR``, ``SPECJAX_NUM_PROCESSES``, ``SPECJAX_PROCESS_ID``.
* ``SPECJAX_LOCAL_DEVICE_IDS=0,1,...``: the devices of this host that this process drives
  (JAX's SLURM detection gives each process one GPU, its local task id; `launch/gpu_slurm.sh`
  sets this for one process per node).
* CPU: cross-process collectives need an implementation (``gloo``); it is switched on before
  the runtime starts (``jax_cpu_collectives_implementation``).

Helpers: `is_primary` (process 0 writes metrics, logs, exports), `barrier`.
"""

from __future__ import annotations

import os

import jax

ENV = ("SPECJAX_COORDINATOR", "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID")


def settings_from_env(environ=None) -> dict:
    """``coordinator_address``, ``num_processes``, ``process_id`` from ``SPECJAX_*`` (all three or
    none; a partial or malformed set is an error naming the variables)."""
    env = os.environ if environ is None else environ
    have = [k for k in ENV if env.get(k, "") != ""]
    if not have:
        return {}
    if len(have) != len(ENV):
        missing = [k for k in ENV if k not in have]
        raise ValueError(f"{', '.join(have)} set but {', '.join(missing)} not: set all of {', '.join(ENV)} "
                         f"for an explicit multi-process run, or none (auto-detection on Cloud TPU / SLURM)")
    try:
        n, i = int(env[ENV[1]]), int(env[ENV[2]])
    except ValueError:
        raise ValueError(f"{ENV[1]}={env[ENV[1]]!r} and {ENV[2]}={env[ENV[2]]!r} must be integers") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{ENV[2]}={i} must be in [0, {ENV[1]}={n})")
    if ":" not in env[ENV[0]]:
        raise ValueError(f"{ENV[0]}={env[ENV[0]]!r}: expected host:port")
    return {"coordinator_address": env[ENV[0]], "num_processes": n, "process_id": i}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, platform: str | None = None) -> dict:
    """Start (once) the multi-controller runtime; returns the arguments used. Explicit arguments
    win over ``SPECJAX_*``; with neither, JAX auto-detects (Cloud TPU, SLURM). ``platform``:
    the backend the job will use (default ``JAX_PLATFORMS``, else auto); on ``cpu`` the gloo
    collectives are enabled first."""
    if jax.distributed.is_initialized():
        return {}
    args = settings_from_env()
    explicit = {k: v for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                                  ("process_id", process_id)) if v is not None}
    args.update(explicit)
    ids = os.environ.get("SPECJAX_LOCAL_DEVICE_IDS", "")
    if ids:     # e.g. one process per SLURM node that owns all its GPUs (JAX's SLURM default: one)
        args["local_device_ids"] = [int(i) for i in ids.split(",")]
    platform = platform or os.environ.get("JAX_PLATFORMS", "")
    if "cpu" in platform.split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
    return args


def platforms_without_tpu() -> str | None:
    """With libtpu installed (the test extra and `specjax aot` bring it) on a machine without a
    TPU, JAX tries the TPU backend first and libtpu logs errors about missing TPU hosts before
    JAX falls back. Unless the user chose platforms (``JAX_PLATFORMS``), leave the TPU out where
    no TPU device file exists: the CPU, and a GPU where a CUDA plugin and a GPU are there. Call
    before the first backend starts; returns the platforms set (None: nothing changed).
    `specjax aot` compiles for TPU topologies without the TPU backend, so it is unaffected."""
    import glob
    import importlib.util
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return None
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):       # a TPU VM's chips
        return None
    cuda = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    platforms = "cuda,cpu" if cuda and glob.glob("/dev/nvidia[0-9]*") else "cpu"
    jax.config.update("jax_platforms", platforms)
    return platforms


def is_primary() -> bool:
    """True in process 0 (the one that writes metrics, logs and exports)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """All processes wait here (no-op in a single-process job)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
