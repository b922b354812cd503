"""CPU kernels through XLA's FFI: the panel matrix product of the target's projections, and
attention of a few new tokens over a KV cache (`decode_attention`); a Pallas kernel of
attention over the written cache for the accelerators (`cache_attention`, in
`_pallas_attention`); and the linear-op seam (`LinearOp`, `LINEAR_OPS`, in `_linear`): how a
model's projections are stored and multiplied, the op a config names (``ModelConfig.linear_op``).
The panel functions below (`pack`, `unpack`, `matmul`, ...) are the ``panels`` op's internals.

``matmul(x, panels, n)`` computes ``x @ W`` for ``W = unpack(panels, n)`` of shape [D, n],
stored as 32-column panels ``[ceil(n / 32), D, 32]`` (`pack`). On the CPU backend, with the
kernel built (``pip install`` compiles ``panel_matmul.cc``; it is optional) and float32
operands, it is one XLA custom call that streams every weight once for up to 8 rows and
splits the panels over XLA's own intra-op threads; a verification block of k <= 8 tokens then
reads the weights once, as a one-token step does (timings: experiments/bench_speed/PROFILE.md,
"Verification nearly free"). Anywhere else (another backend, another dtype, no kernel) it is
the same product as an einsum over the panels, so a packed model runs on any platform.

Each output row of the kernel is bitwise independent of the other rows of the call (see the
.cc file's header); the einsum path is not guaranteed to be.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels._pallas_attention import LANES as CACHE_SLOT_MULTIPLE  # noqa: F401
from specjax.kernels._pallas_attention import cache_attention  # noqa: F401  (the accelerators' kernel)

PANEL = 32
TARGET = "specjax_panel_matmul"
ATTENTION_TARGET = "specjax_decode_attention"
# The most new tokens per row `decode_attention` takes (decode steps and verification blocks;
# a prefill chunk is a matrix product XLA's own library does better).
ATTENTION_MAX_TOKENS = 16
# The fewest rows `decode_attention` takes by default: below it attention is XLA's einsum (the
# threshold's timings: experiments/batch_decode/README.md, "The attention kernel").
ATTENTION_MIN_ROWS = 16
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512"}


# The symbols the library must export to be specjax's (panel_matmul.cc), and those of the
# attention kernel (decode_attention.cc; optional: both or it is not used).
REQUIRED_SYMBOLS = ("SpecjaxKernelIsa", "SpecjaxPanelMatmul")
ATTENTION_SYMBOLS = ("SpecjaxAttentionIsa", "SpecjaxDecodeAttention")


class KernelLibraryError(ValueError):
    """A file where the kernel library belongs that is not it (does not load, lacks a symbol)."""


def _library_path() -> pathlib.Path | None:
    """The kernel library's file beside this module, or None when it was not built."""
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_panel_matmul{suffix}"
        if path.is_file():
            return path
    return None


def _load(path: pathlib.Path):
    """The ctypes handle of the shared object at `path` (OSError when it does not load)."""
    return ctypes.CDLL(str(path))


def _problem(path: pathlib.Path, lib) -> str | None:
    """Why the loaded `lib` is not specjax's kernel library, or None when it is."""
    missing = [name for name in REQUIRED_SYMBOLS if not hasattr(lib, name)]
    if missing:
        return f"{path}: not specjax's kernel library (a shared object without {', '.join(missing)})"
    lib.SpecjaxKernelIsa.restype = ctypes.c_int
    code = int(lib.SpecjaxKernelIsa())
    if code not in ISA_NAMES:
        return f"{path}: not specjax's kernel library (SpecjaxKernelIsa() gave {code}, not one of {sorted(ISA_NAMES)})"
    return None


@functools.cache
def _inspect() -> tuple[object | None, str | None]:
    """(library, None) for the built kernel library; (None, None) when none was built; (None,
    problem) when the file in its place does not load or is not specjax's (missing symbols)."""
    path = _library_path()
    if path is None:
        return None, None
    try:
        lib = _load(path)
    except OSError as e:
        reason = " ".join(str(e).split()).removeprefix(f"{path}: ")      # dlopen's message names the file
        return None, f"{path}: not a loadable shared object ({reason})"
    problem = _problem(path, lib)
    if problem is not None:
        return None, problem
    if all(hasattr(lib, name) for name in ATTENTION_SYMBOLS):
        lib.SpecjaxAttentionIsa.restype = ctypes.c_int
    return lib, None


_PACKAGE_DIR = pathlib.Path(__file__).parent


def build_failure() -> str | None:
    """Why the install did not build the kernel library (what setup.py recorded beside it), or None."""
    note = _PACKAGE_DIR / "_build_failed.txt"
    try:
        return note.read_text().strip() or "no reason recorded"
    except OSError:
        return None


@functools.cache
def _library():
    """The built kernel library (ctypes), or None when it was not built, or when the file in its
    place is not it: then one note on stderr (once) says so, with the reason (the build's, as
    setup.py recorded it, or why the file is not the library), and XLA's own matmul and
    attention run instead."""
    lib, problem = _inspect()
    if problem is None and lib is None and build_failure() is not None:
        problem = f"the CPU kernel library did not build at install time ({build_failure()})"
    if problem is not None:
        print(f"[specjax] note: {problem}; the CPU kernels are off, XLA's matmul runs instead",
              file=sys.stderr, flush=True)
    return lib


@functools.cache
def _registered() -> bool:
    lib = _library()
    if lib is None:
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxPanelMatmul), platform="cpu")
    if attention_built():
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.SpecjaxDecodeAttention), platform="cpu")
    return True


def built() -> bool:
    """Whether the kernel library was built at install time (False, with one note, when the
    file in its place does not load or is not specjax's; `check_library` says why)."""
    return _library() is not None


def check_library() -> None:
    """KernelLibraryError naming the file when the one where the kernel library belongs does not
    load or is not specjax's (``cpu_kernel='on'`` refuses it; 'auto' falls back to XLA)."""
    _, problem = _inspect()
    if problem is not None:
        raise KernelLibraryError(f"{problem}; cpu_kernel='on' cannot use it: rebuild it with `pip install -e .`, "
                                 f"or set cpu_kernel='auto' or 'off'")


def isa() -> str:
    """The kernel's instruction-set body on this CPU: 'avx512', 'avx2', 'portable' (correct but
    not fast: the kernel is not used by default there) or 'none' (not built)."""
    lib = _library()
    return "none" if lib is None else ISA_NAMES[int(lib.SpecjaxKernelIsa())]


def fast_on_this_cpu() -> bool:
    """The kernel is built and has a vector body for this CPU (what ``cpu_kernel='auto'`` asks)."""
    return isa() in ("avx512", "avx2")


def num_panels(n: int) -> int:
    return -(-int(n) // PANEL)


def pack(w_DN):
    """[D, N] -> panels [ceil(N / 32), D, 32]; columns past N are zero."""
    w = jnp.asarray(w_DN)
    if w.ndim != 2:
        raise ValueError(f"pack expects a [D, N] matrix, got shape {w.shape}")
    D, N = w.shape
    P = num_panels(N)
    if P * PANEL != N:
        w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
    return jnp.transpose(w.reshape(D, P, PANEL), (1, 0, 2))


def pack_rows(e_ND):
    """The panels of ``e_ND.T`` (a tied head from the embedding [V, D]) without forming it."""
    e = jnp.asarray(e_ND)
    if e.ndim != 2:
        raise ValueError(f"pack_rows expects an [N, D] matrix, got shape {e.shape}")
    N, D = e.shape
    P = num_panels(N)
    if P * PANEL != N:
        e = jnp.pad(e, ((0, P * PANEL - N), (0, 0)))
    return jnp.transpose(e.reshape(P, PANEL, D), (0, 2, 1))


def panel_shape(d_in: int, d_out: int) -> tuple[int, int, int]:
    """The shape `pack` gives a [d_in, d_out] matrix."""
    return (num_panels(d_out), int(d_in), PANEL)


def is_packed(w) -> bool:
    """Whether ``w`` is held as panels (3-D) rather than a matrix [in, out]."""
    return jnp.ndim(w) == 3


def pack_tree(tree: dict, names) -> dict:
    """The packed layout as a load-time transform: a copy of ``tree`` with each matrix [in, out]
    at a key in ``names`` as `pack` panels (panels already, or keys absent: left as they are)."""
    out = dict(tree)
    for name in names:
        if name in out and not is_packed(out[name]):
            out[name] = pack(out[name])
    return out


def unpack_tree(tree: dict, widths: dict) -> dict:
    """The inverse of `pack_tree`: a copy with the panels at each key of ``widths`` back as the
    [in, width] matrices they hold."""
    out = dict(tree)
    for name, width in widths.items():
        if name in out and is_packed(out[name]):
            out[name] = unpack(out[name], width)
    return out


def unpack(panels, n: int):
    """Panels [P, D, 32] -> the [D, n] matrix they hold (exact inverse of `pack`)."""
    p = jnp.asarray(panels)
    if p.ndim != 3 or p.shape[2] != PANEL or num_panels(n) != p.shape[0]:
        raise ValueError(f"panels of shape {p.shape} do not hold a matrix with {n} columns")
    P, D, _ = p.shape
    return jnp.transpose(p, (1, 0, 2)).reshape(D, P * PANEL)[:, :n]


def _einsum(x, panels, n: int):
    y = jnp.einsum("...d,pdc->...pc", x, panels.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.reshape(*y.shape[:-2], -1)[..., :n]


def _custom_call(x, panels, n: int):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32),
                            vmap_method="sequential")(x, panels)


def matmul(x, panels, n: int, use_kernel: bool = True):
    """``x [..., D] @ W [D, n]`` in float32 for W held as `pack` panels [ceil(n / 32), D, 32] (see module).

    ``use_kernel=False`` forces the einsum path (the reference in the tests)."""
    if panels.ndim != 3 or x.shape[-1] != panels.shape[1] or panels.shape[2] != PANEL \
            or num_panels(n) != panels.shape[0]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and panels {tuple(panels.shape)} do not fit a "
                         f"[{x.shape[-1]}, {n}] weight (panels must be [ceil(n/32), D, 32])")
    if not (use_kernel and x.dtype == jnp.float32 and panels.dtype == jnp.float32 and _registered()):
        return _einsum(x, panels, n)
    return jax.lax.platform_dependent(
        x, panels, cpu=functools.partial(_custom_call, n=n), default=functools.partial(_einsum, n=n))


# ----------------------------------------------------------------------------- attention

def attention_built() -> bool:
    """Whether the library holds the attention kernel (built from decode_attention.cc)."""
    lib = _library()
    return lib is not None and all(hasattr(lib, name) for name in ATTENTION_SYMBOLS)


def attention_fast_on_this_cpu() -> bool:
    """The attention kernel is built with its AVX-512 body for this CPU: the one body a target
    attends through by default (``cpu_kernel='auto'``); the portable body is correct and runs
    only where a config sets ``cpu_attention=True``."""
    return attention_built() and int(_library().SpecjaxAttentionIsa()) == 2


def _attention_call(q_BTQH, k_new_BTKH, v_new_BTKH, k_BKSH, v_BKHS, lengths_B):
    B, T, N, H = q_BTQH.shape
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, N * H), jnp.float32),
                            vmap_method="sequential")(q_BTQH, k_new_BTKH, v_new_BTKH, k_BKSH, v_BKHS, lengths_B)


def decode_attention(q_BTQH, k_new_BTKH, v_new_BTKH, k_BKSH, v_BKHS, lengths_B, reference,
                     min_rows: int = ATTENTION_MIN_ROWS):
    """Causal grouped-query attention of T <= `ATTENTION_MAX_TOKENS` new tokens over a cache
    (the rule of `specjax.models.llama.attention` without a tree; see decode_attention.cc):
    [B, T, N * H] float32. ``reference()`` gives the same result where the kernel does not run
    (not built, another backend, another dtype, a longer block, fewer than ``min_rows`` rows)."""
    args = (q_BTQH, k_new_BTKH, v_new_BTKH, k_BKSH, v_BKHS)
    if (q_BTQH.shape[1] > ATTENTION_MAX_TOKENS or q_BTQH.shape[0] < min_rows
            or any(x.dtype != jnp.float32 for x in args)
            or not attention_built() or not _registered()):
        return reference()
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    return jax.lax.platform_dependent(*args, lengths_B, cpu=_attention_call, default=lambda *_: reference())


# ----------------------------------------------------------------------------- the linear-op seam
# (imported last: the ops are built from the functions above)
from specjax.kernels._linear import (LINEAR_OPS, LinearOp, dense, get_linear_op,  # noqa: E402,F401
                                     register_linear_op, stored_op)
