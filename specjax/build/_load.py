"""Loading and placement: the target in the layout the settings ask for, the drafter and the
engine around it, as a `specjax.decoding.Generator` (the request path)."""

from __future__ import annotations

import math

from specjax import decoding, drafters, models
from specjax.models import attention
from specjax.build._checks import CPU_KERNEL_CHOICES, check_config, check_cpu_kernel
from specjax.build._settings import GenerateSettings, generation_config, not_settings


def load_target(name_or_path: str, dtype: str = "float32", scan_layers: bool = True,
                fuse_projections: bool = False, linear_op: str = "xla"):
    return models.load(name_or_path, dtype=dtype, scan_layers=scan_layers, fuse_projections=fuse_projections,
                       linear_op=linear_op)


def use_cpu_kernel(c: GenerateSettings, backend: str | None = None) -> bool:
    """Whether a generation config's target runs on `specjax.kernels`' CPU matmul (the "panels"
    linear op, ``ModelConfig.linear_op``; "xla" otherwise), from ``cpu_kernel``:

    * ``'off'``: never (XLA's own matmuls);
    * ``'on'``: always; an error unless the kernel was built, the layers are unrolled
      (``scan_layers=False``) and the dtype is float32;
    * ``'auto'`` (default): on the CPU backend when the kernel was built with a vector body for
      this CPU, the layers are unrolled and the dtype is float32.

    ``backend`` (default: JAX's default backend, which this starts) is only read for 'auto'. A
    bad value is a ValueError naming the setting (`check_cpu_kernel`); ``backend=''`` checks the
    value only, starting no backend."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("use_cpu_kernel", c)
    from specjax import kernels
    check_cpu_kernel(c.cpu_kernel, c.scan_layers, c.dtype)
    value, fits = c.cpu_kernel, not c.scan_layers and c.dtype == "float32"
    if value == "off" or backend == "":
        return value == "on"
    if value == "on":
        kernels.check_library()         # a foreign file in the library's place: named
        if not kernels.built():
            raise ValueError("cpu_kernel='on': specjax's CPU kernel was not built at install time (a C++ "
                             "compiler and jaxlib are needed; reinstall with `pip install -e .`), or use 'auto'")
        return True
    import jax
    if backend is None:
        backend = jax.default_backend()
    # On a mesh of several devices the kernel's custom call would run unpartitioned on every
    # device (its operands gathered): XLA's matmuls shard, so 'auto' keeps them there.
    return fits and backend == "cpu" and kernels.fast_on_this_cpu() and jax.device_count() == 1


def make_drafter(kind: str, target, target_params, *, dtype: str = "float32", scan_layers: bool = True,
                 target_name: str = "", **settings):
    """(drafter, draft_params) of a registered drafter kind (`drafters.drafter_kinds()`), its
    settings from ``settings`` (config keys: the kind's settings class names those it reads; the
    others are ignored)."""
    ctx = drafters.BuildContext(target, target_params, target_name=target_name, dtype=dtype, scan_layers=scan_layers)
    return drafters.build_drafter(kind, settings, ctx)


def load_target_with_tokenizer(c: GenerateSettings):
    """(target, params, tokenizer) of a generation config, from one read of the checkpoint, in
    the layout the config asks for (``scan_layers``, ``fuse_projections``, ``cpu_kernel``: the
    panel matmul and, with it, the attention kernel, see `use_cpu_attention`)."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("load_target_with_tokenizer", c)
    kernel = use_cpu_kernel(c)
    target, params, tokenizer = models.load_with_tokenizer(c.target, dtype=c.dtype, scan_layers=c.scan_layers,
                                                           fuse_projections=c.fuse_projections,
                                                           linear_op="panels" if kernel else "xla")
    if target.config.linear_op == "panels" and use_cpu_attention():
        target = type(target)(target.config.replace(cpu_attention=True))
    op = c.attention_op
    if op != target.config.attention_op:
        from specjax.models import attention
        attention.get_attention_op(op)          # an unknown op named before anything runs
        target = type(target)(target.config.replace(attention_op=op))
    if c.write_then_attend != target.config.write_then_attend:
        target = type(target)(target.config.replace(write_then_attend=c.write_then_attend))
    ordered = c.write_then_attend and bool(c.tree or c.adaptive_trees)     # token trees, exact in low precision
    if ordered != target.config.ordered_tail:
        target = type(target)(target.config.replace(ordered_tail=ordered))
    return target, params, tokenizer


def use_cpu_attention() -> bool:
    """Whether a target that runs on the CPU kernel's matmul (`use_cpu_kernel`) also attends
    through `specjax.kernels.decode_attention`: when that kernel was built with its AVX-512 body
    (the portable body runs only where a config sets ``cpu_attention=True``; timings:
    experiments/batch_decode/README.md, "The attention kernel")."""
    from specjax import kernels
    return kernels.attention_fast_on_this_cpu()


def generator_for(c: GenerateSettings, target, params, tokenizer, pad_multiple: int = 64) -> decoding.Generator:
    """The drafter and engine of generation settings around an already loaded target. The
    caller has checked the settings with `check_config` before loading the target (as
    `load_generator` does)."""
    return generators_for((c,), target, params, tokenizer, pad_multiple)[0]


def generators_for(settings: tuple, target, params, tokenizer, pad_multiple: int = 64) -> list[decoding.Generator]:
    """`generator_for` of several generation settings around one loaded target (one target,
    several drafters: `specjax bench`): each one's mesh and engine configuration, then the
    drafters."""
    for c in settings:
        if not isinstance(c, GenerateSettings):
            raise not_settings("generator_for", c)
    meshes = [generation_mesh(c) for c in settings]
    configs = [generation_config(c, tokenizer.stop_token_ids) for c in settings]
    out = []
    for c, mesh, config in zip(settings, meshes, configs):
        ctx = drafters.BuildContext(target, params, target_name=c.target, dtype=c.dtype, scan_layers=c.scan_layers)
        drafter, dparams = drafters.build_drafter(c.drafter, c.draft, ctx)
        engine = decoding.Engine(target, drafter, config, mesh=mesh)
        eparams = decoding.EngineParams(target=params, draft=dparams)
        if mesh is not None:
            eparams = engine.place_params(eparams)
        # prompts padded (and so capacities rounded) to what the attention op reads in place
        pad = math.lcm(pad_multiple, attention.slot_multiple(target.config.attention_op))
        out.append(decoding.Generator(engine, eparams, tokenizer, pad_multiple=pad))
    return out


def generation_mesh(c: GenerateSettings):
    """The generation config's ``mesh`` (data x fsdp x model, -1 = the rest) when the job has
    more than one device (a multi-host job, or host devices from
    ``--xla_force_host_platform_device_count``), else None: one device runs without a mesh."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("generation_mesh", c)
    import jax
    if jax.device_count() == 1:
        return None
    from specjax import sharding
    return sharding.mesh_from_config(c.mesh_axes)


def load_generator(c: GenerateSettings, pad_multiple: int = 64, check: bool = True) -> decoding.Generator:
    """The target (weights and tokenizer from one read of the checkpoint), the drafter and the
    engine of generation settings, as a `decoding.Generator`. The settings are checked before
    anything is loaded (`check_config`), unless the caller did (``check=False``)."""
    if check:
        check_config(c)
    return generator_for(c, *load_target_with_tokenizer(c), pad_multiple=pad_multiple)
