"""`specjax aot`: compile every program for a TPU topology without a TPU and report each.

The devices come from libtpu's topology description
(`jax.experimental.topologies.get_topology_desc`), the mesh from the profile's ``mesh`` block
(`specjax.sharding.mesh_from_config`), shardings from the same logical-axis rules a run uses.
Nothing executes: each program is lowered and compiled, then read back (`memory_analysis`,
`cost_analysis`, the optimized HLO through `specjax.aot._hlo`).

One row per program (`compile_one`), printed as a JSON line:

* memory per device by kind (arguments, outputs, aliased, temporaries, code) and their total
  against the chip's HBM; a program that does not fit is reported with the same figures and
  ``fits: false``, and nothing of it is kept;
* ``flops`` and ``xla_bytes`` as XLA's cost analysis gives them (a loop body counted once),
  ``bytes`` the HBM traffic per call with loops counted by their trip counts (`_hlo.traffic`),
  ``ideal_bytes`` (weights and the live KV read once) and their ratio;
* ``predicted_s``: max(bytes / HBM bandwidth, flops / peak rate) plus the collectives' bytes
  over the chip's one-way ICI bandwidth (a bound-based estimate, not a measurement);
* the collectives per call by kind, and the lint's findings (`_hlo.lint`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

from specjax.aot import _hlo, _targets

LIBTPU_MISSING = ("specjax aot needs libtpu to compile for a TPU topology, and it is not installed: "
                  "pip install 'jax[tpu]' (or pip install -e '.[tpu]'); it compiles on a CPU machine, no TPU needed")


class AotError(ValueError):
    """A bad setting or a missing piece, named in one line."""


def quiet_libtpu() -> None:
    """libtpu looks for TPU hosts when it loads; on a machine without a TPU it logs errors about
    them. The values here tell it this is one local host (they change nothing of what it compiles)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu locks /tmp/libtpu_lockfile per process by default; compiling needs no exclusive
    # chip, so concurrent compiling processes (test workers, two aot runs) may all load it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


CUDA_MISSING = ("specjax aot needs JAX's CUDA plugin to compile for a GPU (no GPU needed): pip install --no-deps "
                "jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}")


def topology_devices(name: str, gpu_target_config: str = ""):
    """(chip, devices) of a topology, or AotError naming what is wrong (unknown name, no libtpu
    or CUDA plugin, a grid libtpu refuses, a GPU without its target description).

    TPU: libtpu's topology description. GPU: the CUDA plugin compiles without a device from a
    target description (``gpu_target_config``: a ``stream_executor.GpuTargetConfigProto`` in
    text form, such as XLA's ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``)."""
    try:
        chip, grid = _targets.parse_topology(name)
    except ValueError as e:
        raise AotError(str(e)) from None
    import importlib.util
    if chip.name in _targets.GPUS:
        return chip, _gpu_devices(name, chip, grid[0], gpu_target_config)
    if importlib.util.find_spec("libtpu") is None:
        raise AotError(LIBTPU_MISSING)
    quiet_libtpu()
    from jax.experimental import topologies
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's own message names the problem
        msg = " ".join(str(e).split())[:300]
        raise AotError(f"topology {name!r}: libtpu does not know it ({msg})") from None
    devices = list(desc.devices)
    if devices and devices[0].device_kind != chip.device_kind:
        raise AotError(f"topology {name!r}: libtpu made {devices[0].device_kind!r} devices, expected "
                       f"{chip.device_kind!r}")
    return chip, devices


def _gpu_devices(name: str, chip, n: int, target_config: str):
    import importlib.util
    import pathlib

    import jax
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise AotError(CUDA_MISSING.format(v=jax.__version__))
    path = pathlib.Path(target_config).expanduser() if target_config else None
    if path is None or not path.is_file():
        raise AotError(f"topology {name!r}: config.gpu_target_config must name the GPU's target description "
                       f"(a GpuTargetConfigProto text file, e.g. XLA's xla/backends/gpu/target_config/specs/"
                       f"{'h100_sxm' if chip.name == 'h100' else chip.name}.txtpb); got {target_config!r}")
    from jax.experimental import topologies
    try:
        desc = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=path.read_text())
    except Exception as e:  # noqa: BLE001 - the plugin's own message names the problem
        msg = " ".join(str(e).split())[:300]
        raise AotError(f"topology {name!r}: the CUDA plugin cannot describe it from {path} ({msg})") from None
    devices = list(desc.devices)
    kind = devices[0].device_kind if devices else ""
    if chip.name.upper() not in kind.upper():
        raise AotError(f"topology {name!r}: {path} describes {kind!r}, not an {chip.name.upper()}")
    return devices


@dataclasses.dataclass(frozen=True)
class Context:
    """What every row of one run shares."""
    topology: str
    chip: _targets.Chip
    devices: int
    mesh: dict
    target: str
    profile: str
    dtype: str
    layout: str


_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|exceeds the memory|Ran out of memory")


def compile_one(ctx: Context, program, shapes) -> dict:
    """Lower and compile one program; the row described in the module docstring."""
    row = dict(program=program.name, topology=ctx.topology, chip=ctx.chip.name, devices=ctx.devices, mesh=ctx.mesh,
               target=ctx.target, profile=ctx.profile, dtype=ctx.dtype, layout=ctx.layout, batch=shapes.batch,
               context=shapes.context, capacity=shapes.capacity, tokens=program.tokens)
    t0 = time.perf_counter()
    arguments = sum(program_arg_bytes(program)) - program.shared_bytes
    if arguments > ctx.chip.hbm_bytes:          # refused before compiling: the inputs alone do not fit
        row.update(fits=False, compile_s=0.0, memory={"argument": arguments, "hbm": ctx.chip.hbm_bytes},
                   error=f"the arguments alone need {arguments / 2**30:.2f} GiB per device")
        return row
    lowered = program.lower()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - out of memory and a compiler failure are results
        if not _OOM.search(str(e)):
            if "INTERNAL" not in str(e) and "RET_CHECK" not in str(e):
                raise
            # the compiler's own failure (a libtpu or XLA bug): a row naming it, the next program goes on
            row.update(fits=None, compile_s=round(time.perf_counter() - t0, 2),
                       memory={"argument": arguments, "hbm": ctx.chip.hbm_bytes},
                       error="compiler error: " + " ".join(str(e).split())[:400])
            return row
        row.update(fits=False, compile_s=round(time.perf_counter() - t0, 2),
                   memory={"argument": arguments, "hbm": ctx.chip.hbm_bytes},
                   error=" ".join(str(e).split())[:400])
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    mem = compiled.memory_analysis()
    memory = {"argument": float(mem.argument_size_in_bytes), "output": float(mem.output_size_in_bytes),
              "alias": float(mem.alias_size_in_bytes), "temp": float(mem.temp_size_in_bytes),
              "code": float(mem.generated_code_size_in_bytes), "shared_arguments": program.shared_bytes}
    memory["total"] = (memory["argument"] - program.shared_bytes + memory["output"] - memory["alias"]
                       + memory["temp"] + memory["code"])
    memory["hbm"] = ctx.chip.hbm_bytes
    row["memory"] = memory
    row["fits"] = memory["total"] <= ctx.chip.hbm_bytes
    cost = compiled.cost_analysis() or {}      # None for a GPU compiled without a device
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["flops"] = float(cost["flops"]) if "flops" in cost else None
    row["xla_bytes"] = float(cost["bytes accessed"]) if "bytes accessed" in cost else None
    module = _hlo.parse_module(compiled.as_text())
    tr = _hlo.traffic(module)
    row["bytes"] = tr.bytes
    row["ideal_bytes"] = program.ideal_bytes
    row["bytes_over_ideal"] = None if not program.ideal_bytes else tr.bytes / program.ideal_bytes
    coll = tr.collectives()
    row["collectives"] = coll
    coll_bytes = sum(c["bytes"] for c in coll.values())
    row["predicted_s"] = (max(tr.bytes / ctx.chip.hbm_bytes_per_s, (row["flops"] or 0.0) / ctx.chip.peak_flops)
                          + coll_bytes / (ctx.chip.ici_bytes_per_s / 2))
    row["loops"] = [{"trips": lp["trips"], "op_name": lp["op_name"]} for lp in tr.loops]
    findings = _hlo.lint(module, tr, weight_bytes=program.weight_bytes, cache_bytes=program.cache_bytes)
    donated = program.donated_bytes
    if donated and memory["alias"] < 0.5 * donated:
        findings.append(_hlo.Finding("donation", f"{donated / 2**20:.1f} MiB donated, {memory['alias'] / 2**20:.1f} MiB "
                                                 f"aliased to outputs"))
    row["lint"] = _hlo.summarize(findings)
    row["findings"] = [f.as_dict() for f in findings[:12]]
    row["top"] = tr.top(6)
    return row


def program_arg_bytes(program):
    from specjax.aot._programs import _per_device
    import jax
    return [_per_device(a) for a in jax.tree.leaves(program.args) if hasattr(a, "shape") and hasattr(a, "sharding")]
