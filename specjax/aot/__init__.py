"""Deviceless compilation: every program of a run compiled for a TPU topology on any machine.

`specjax aot --config=configs/aot.py` (`run`): libtpu describes the topology's devices, the
programs are built from shapes (`_programs`: prefill, the target-only decode step, verification
blocks of k tokens, a speculative chain round with an EAGLE-3-shaped head, a dynamic-tree
round, the head's and a draft's training steps), compiled with the mesh and the logical-axis
rules a run uses, and each is reported as one JSON line (`_run.compile_one`): memory by kind
against the chip's HBM, FLOPs, HBM bytes per call with loops counted by their trip counts
(`_hlo.traffic`; XLA's own figure counts a loop body once), the ideal bytes, a predicted step
time from the chip's bandwidth and peak rate, collectives, and the HLO lint (`_hlo.lint`).

Floors: this package sits above `specjax.decoding` and `specjax.distill` (it compiles their
entry points) and below the CLI, which types its config once into `AotSettings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys

from specjax.aot._hlo import Array, Finding, Module, Traffic, lint, parse_module, parse_type, traffic
from specjax.aot._run import AotError, quiet_libtpu, topology_devices
from specjax.aot._targets import CHIPS, PRESETS, Chip, parse_topology, target_config

__all__ = ["Array", "parse_type", "AotError", "AotSettings", "CHIPS", "Chip", "Finding", "Module", "PRESETS", "Traffic", "aot_settings",
           "lint", "parse_module", "parse_topology", "quiet_libtpu", "run", "target_config", "topology_devices",
           "traffic", "without_persistent_cache"]

LAYOUT_KEYS = ("dtype", "scan_layers", "fuse_projections", "attention_op", "write_then_attend")


@dataclasses.dataclass(frozen=True)
class AotSettings:
    """One `specjax aot` run, typed once from its config (see configs/aot.py for each key)."""
    topology: str
    target: str
    profile: str                   # the name reported for the layout below
    dtype: str
    scan_layers: bool
    fuse_projections: bool
    attention_op: str
    write_then_attend: bool
    ordered_tail: bool             # token-tree rows in position order (`ModelConfig.ordered_tail`: a tree run's)
    block_tokens: int              # the profile's: tokens every target pass scores (0: its own, -1: the largest block)
    mesh: tuple[tuple[str, int], ...]
    programs: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    context: int
    capacity: int
    prompt: int
    verify_ks: tuple[int, ...]
    gamma: int
    tree: tuple[int, int, int]
    train_batch: int
    train_seq: int
    draft_layers: int
    out: str = ""
    gpu_target_config: str = ""     # GPU topologies: the GPU's target description (a text proto file)

    @property
    def layout(self) -> str:
        return ("scan" if self.scan_layers else "unrolled") + ("+fused" if self.fuse_projections else "") + \
            f"+{self.attention_op}" + ("+write-first" if self.write_then_attend else "") + \
            ("+ordered-tail" if self.ordered_tail else "") + ("+one-block" if self.block_tokens else "")


def aot_settings(c, profile) -> AotSettings:
    """`AotSettings` from an aot config ``c`` and the generation profile ``profile`` (a
    configs/generate_*.py config whose layout and mesh the programs use; ``c.mesh`` entries
    other than 0 override the profile's). ValueError naming the key for a bad value."""
    from specjax.aot import _programs

    def ints(key, values, low=1):
        try:
            out = tuple(int(v) for v in values)
        except (TypeError, ValueError):
            raise ValueError(f"config.{key}: {values!r} is not a tuple of integers") from None
        if not out or min(out) < low:
            raise ValueError(f"config.{key}: {values!r} must be a non-empty tuple of integers >= {low}")
        return out

    programs = tuple(str(p) for p in c.programs)
    unknown = [p for p in programs if p not in _programs.PROGRAMS]
    if not programs or unknown:
        raise ValueError(f"config.programs: {unknown or programs!r} not allowed; choose from {_programs.PROGRAMS}")
    tree = ints("tree", c.tree)
    if len(tree) != 3:
        raise ValueError(f"config.tree: {tuple(c.tree)!r} must be (depth, top-k, node budget)")
    mesh = {k: int(profile.mesh[k]) for k in ("data", "fsdp", "model")}
    mesh.update({k: int(v) for k, v in c.mesh.items() if int(v) != 0})
    s = AotSettings(
        topology=str(c.topology), target=str(c.target), profile=str(c.profile_name or c.profile),
        dtype=str(profile.dtype), scan_layers=bool(profile.scan_layers),
        fuse_projections=bool(profile.get("fuse_projections", False)), attention_op=str(profile.attention_op),
        write_then_attend=bool(profile.get("write_then_attend", False)) and not bool(profile.scan_layers),
        ordered_tail=bool(c.get("ordered_tail", False)) and bool(profile.get("write_then_attend", False))
        and not bool(profile.scan_layers), block_tokens=int(profile.get("block_tokens", 0)),
        mesh=tuple(mesh.items()), programs=programs, batch_sizes=ints("batch_sizes", c.batch_sizes),
        context=ints("context", (c.context,))[0], capacity=ints("capacity", (c.capacity,))[0],
        prompt=ints("prompt", (c.prompt,))[0], verify_ks=ints("verify_ks", c.verify_ks),
        gamma=ints("gamma", (c.gamma,))[0], tree=tree, train_batch=ints("train_batch", (c.train_batch,))[0],
        train_seq=ints("train_seq", (c.train_seq,))[0], draft_layers=ints("draft_layers", (c.draft_layers,))[0],
        out=str(c.out), gpu_target_config=str(c.get("gpu_target_config", "")))
    if s.context + max(max(s.verify_ks), s.gamma + 1, s.tree[2] + 1) > s.capacity:
        raise ValueError(f"config.context: {s.context} committed tokens plus the largest block do not fit "
                         f"config.capacity={s.capacity} slots")
    if s.prompt > s.capacity:
        raise ValueError(f"config.prompt: {s.prompt} prompt tokens do not fit config.capacity={s.capacity} slots")
    return s


def _model(s: AotSettings):
    from specjax import models
    try:
        config = target_config(s.target, s.dtype)
    except ValueError as e:
        raise AotError(str(e)) from None
    config = config.replace(scan_layers=s.scan_layers, fuse_projections=s.fuse_projections,
                            attention_op=s.attention_op, write_then_attend=s.write_then_attend,
                            ordered_tail=s.ordered_tail, linear_op="xla", cpu_attention=False)
    return models.Llama(config)


def run(s: AotSettings, emit=None) -> list[dict]:
    """Compile every program of ``s`` for its topology; each row is passed to ``emit`` (default:
    printed as one JSON line) as soon as it is ready and appended to ``s.out`` (JSONL) when set.
    Bad settings (topology, target, libtpu) raise `AotError` before anything compiles; a
    program that does not fit is a row with ``fits: false``."""
    import jax

    from specjax import sharding
    from specjax.aot import _run

    emit = emit or (lambda row: print(json.dumps(row, sort_keys=True), flush=True))
    model = _model(s)
    chip, devices = topology_devices(s.topology, s.gpu_target_config)
    mesh_cfg = dict(s.mesh)
    try:
        mesh = sharding.mesh_from_config(mesh_cfg, devices)
    except ValueError as e:
        raise AotError(f"mesh {mesh_cfg} on {s.topology} ({len(devices)} devices): {e}") from None
    out = pathlib.Path(s.out).expanduser() if s.out else None
    if out is not None:          # writable before hours of compiling, not after
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a"):
                pass
        except OSError as e:
            raise AotError(f"config.out: cannot append to {out}: {e.strerror or e}") from None
    ctx = _run.Context(topology=s.topology, chip=chip, devices=len(devices), mesh=dict(mesh.shape), target=s.target,
                       profile=s.profile, dtype=s.dtype, layout=s.layout)
    rows = []
    with without_persistent_cache():
        for batch in s.batch_sizes:
            _compile_batch(s, model, mesh, ctx, batch, out, emit, rows)
    return rows


@contextlib.contextmanager
def without_persistent_cache():
    """JAX's persistent compilation cache cannot load a deviceless executable back (there is no
    client to load it into) and warns on every hit: compile for a topology outside it (where JAX
    already decided to use the cache in this process, the failed read is harmless: it compiles)."""
    import warnings

    import jax
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
            yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def _compile_batch(s: AotSettings, model, mesh, ctx, batch: int, out, emit, rows: list) -> None:
    """Every program of ``s`` at one batch size: compiled, reported, appended to ``rows``."""
    import jax

    from specjax.aot import _programs, _run
    shapes = _programs.Shapes(batch=batch, context=s.context, capacity=s.capacity, prompt=s.prompt,
                              verify_ks=s.verify_ks, gamma=s.gamma, tree=s.tree, train_batch=s.train_batch,
                              train_seq=s.train_seq, draft_layers=s.draft_layers, block_tokens=s.block_tokens)
    builder = _programs.Builder(model, mesh, shapes)
    for make in builder.build(s.programs):
        row = _run.compile_one(ctx, make(), shapes)
        rows.append(row)
        if out is not None:
            with open(out, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        emit(row)
        jax.clear_caches()


def describe(row: dict) -> str:
    """One human line for a row (the CLI's stderr summary)."""
    gib = 2 ** 30
    mem = row.get("memory", {})
    if row.get("fits", True) is None:
        return f"{row['program']} b={row['batch']}: not compiled ({row.get('error', '')[:200]})"
    if not row.get("fits", True):
        return (f"{row['program']} b={row['batch']}: does not fit {row['topology']} "
                f"({mem.get('argument', 0) / gib:.2f} GiB of arguments per device, HBM {mem.get('hbm', 0) / gib:.0f} GiB)")
    ratio = row.get("bytes_over_ideal")
    lint_ = ", ".join(f"{k} x{v['count']}" for k, v in row.get("lint", {}).items()) or "clean"
    return (f"{row['program']} b={row['batch']}: {mem['total'] / gib:.2f} / {mem['hbm'] / gib:.0f} GiB, "
            f"{row['bytes'] / 1e9:.3f} GB/call" + (f" ({ratio:.2f}x ideal)" if ratio else "") +
            f", {row['predicted_s'] * 1e3:.3f} ms predicted, lint: {lint_}")


def main(s: AotSettings) -> list[dict]:
    """The CLI's run: JSON lines on stdout, one summary line per program on stderr."""
    return run(s, emit=lambda row: (print(json.dumps(row, sort_keys=True), flush=True),
                                    print(f"[specjax aot] {describe(row)}", file=sys.stderr, flush=True)))
