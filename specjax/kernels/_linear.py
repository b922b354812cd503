"""The linear-op seam: how a projection matrix W [in, out] is stored and multiplied.

A model config names its op (``ModelConfig.linear_op``; a head's ``HeadConfig.linear_op``) and
the model and heads go through the op object alone: they store their matrices with `store`
(`store_rows` for a tied head, the embedding's rows), multiply with `apply`, and take the form
apart with `restore`; no layout is named outside this package. Ops (`LINEAR_OPS`):

* ``xla``: plain matrices [in, out] and an einsum (float32 accumulation): the canonical form.
* ``panels``: the CPU kernel's layout, 32-column panels [ceil(out / 32), in, 32] (`pack`),
  multiplied by `matmul` (the CPU custom call; an einsum over the panels off the CPU, off
  float32 or without the kernel). Per-layer params only; the model keeps its LM head a second
  time as panels (``head_linear``).

A new op (an int8 one, say) is one `register_linear_op` call: a `LinearOp` whose stored form
`is_stored` recognizes (a rank, shape or array type no other op's form has: `dense` and the
models' layout conversion find the op a weight is held by from its form), and no model edit.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.kernels import PANEL, matmul, num_panels, pack, pack_rows, unpack


@dataclasses.dataclass(frozen=True)
class LinearOp:
    """How a projection W [in, out] is stored and multiplied. The base class is the plain op
    (the stored form is the matrix itself); an op overrides what differs.

    ``per_layer_only``: the stored form cannot be sliced by a layer scan (the model needs
    ``scan_layers=False``). ``head_copy``: the model keeps its LM head a second time in the
    op's form (params ``head_linear``), beside the embedding or ``lm_head`` that lookups,
    drafters and export read."""
    name: str
    per_layer_only: bool = False
    head_copy: bool = False

    def stored_shape(self, d_in: int, d_out: int) -> tuple[int, ...]:
        """The shape `store` gives a [d_in, d_out] matrix."""
        return (int(d_in), int(d_out))

    def stored_axes(self, axis_in, axis_out) -> tuple:
        """The logical sharding axes of the stored form of a matrix with axes (axis_in, axis_out)."""
        return (axis_in, axis_out)

    def store(self, w_DN):
        """The stored form of a matrix [D, N]."""
        return w_DN

    def store_rows(self, e_ND):
        """The stored form of ``e_ND.T`` (a tied head from the embedding [V, D])."""
        return jnp.asarray(e_ND).T

    def restore(self, w, n: int):
        """The stored form ``w`` back as the [in, n] matrix it holds (the inverse of `store`)."""
        return w

    def is_stored(self, w) -> bool:
        """Whether ``w`` is in this op's own form rather than a plain matrix (the plain op: never)."""
        return False

    def apply(self, x, w, n: int):
        """``x [..., in] @ W`` in float32 for W [in, n] held as ``w`` (this op's stored form)."""
        return jnp.einsum("...d,df->...f", x, w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class PanelsOp(LinearOp):
    """`specjax.kernels`' panel layout and its CPU matmul (see the package docstring)."""
    name: str = "panels"
    per_layer_only: bool = True
    head_copy: bool = True

    def stored_shape(self, d_in, d_out):
        return (num_panels(d_out), int(d_in), PANEL)

    def stored_axes(self, axis_in, axis_out):
        return (axis_out, axis_in, None)

    def store(self, w_DN):
        return pack(w_DN)

    def store_rows(self, e_ND):
        return pack_rows(e_ND)

    def restore(self, w, n):
        return unpack(w, n)

    def is_stored(self, w) -> bool:
        shape = jnp.shape(w)
        return len(shape) == 3 and shape[-1] == PANEL

    def apply(self, x, w, n):
        return matmul(x, w, n)


LINEAR_OPS: dict[str, LinearOp] = {"xla": LinearOp("xla"), "panels": PanelsOp()}


def register_linear_op(name: str, op: LinearOp) -> None:
    """Make ``op`` selectable as ``ModelConfig(linear_op=name)``; a second, different op under a
    registered name is refused."""
    if name in LINEAR_OPS and LINEAR_OPS[name] != op:
        raise ValueError(f"linear op {name!r} is already registered")
    LINEAR_OPS[name] = op


def get_linear_op(name: str) -> LinearOp:
    """The registered op ``name`` (ValueError naming the registered ones otherwise)."""
    try:
        return LINEAR_OPS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown linear op {name!r} (registered: {', '.join(LINEAR_OPS)})") from None


def stored_op(w) -> LinearOp | None:
    """The registered op whose own stored form ``w`` is in (None: a plain matrix)."""
    for op in LINEAR_OPS.values():
        if op.is_stored(w):
            return op
    return None


def dense(x, w, width: int):
    """``x [..., in] @ W`` in float32 for W [in, width] held as ``w``: a plain matrix, or the
    stored form of whichever registered op holds it (for weights whose form the caller does
    not know)."""
    op = stored_op(w)
    if op is None:
        return jnp.einsum("...d,df->...f", x, w, preferred_element_type=jnp.float32)
    return op.apply(x, w, width)


__all__ = ["LinearOp", "LINEAR_OPS", "register_linear_op", "get_linear_op", "stored_op", "dense"]
