"""Typed settings: the one way a command's ConfigDict becomes frozen values, at the CLI boundary.

Each command types its config once (`specjax.build.generate_settings`,
`specjax.distill.distill_settings`, `specjax.bench.bench_settings`, ...) into frozen dataclasses;
nothing below the CLI reads a ConfigDict. This module holds what they share: the `Settings`
base, the rule that types one value from its field's annotation (`typed_value`), and the mesh
parser.
"""

from __future__ import annotations

import dataclasses
import numbers
import typing


class Settings:
    """Base of the frozen settings dataclasses (`specjax.build.GenerateSettings`,
    `specjax.distill.DistillSettings`, ...)."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Nested plain values, the mesh as a mapping (the layout of the config files)."""
        d = dataclasses.asdict(self)
        if "mesh" in d:
            d["mesh"] = dict(self.mesh)
        return d


def mesh_pairs(value, example: str) -> tuple:
    """A mesh setting (a mapping or (axis, size) pairs) as (axis, size) pairs; ValueError
    naming it otherwise."""
    items = value.items() if hasattr(value, "items") else value
    try:
        return tuple((str(k), int(v)) for k, v in items)
    except (TypeError, ValueError):
        raise ValueError(f"mesh={value!r}: expected axis sizes such as {example}") from None


def annotation(hint) -> tuple[type, bool, type | None]:
    """(the value type, whether None is allowed, the element type of a tuple[T, ...]) of a
    field's annotation."""
    args = typing.get_args(hint)
    if args and type(None) in args:
        kind, _, element = annotation(next(a for a in args if a is not type(None)))
        return kind, True, element
    origin = typing.get_origin(hint)
    return (origin or hint), False, (args[0] if origin is tuple and args else None)


def typed_value(path: str, hint, value, *, build=None, mesh_example: str = "{'data': 1, 'fsdp': 1, 'model': -1}"):
    """``value`` as the type its field's annotation ``hint`` names (bool, int, float, str, a
    tuple, optionally of a type, Optional, a nested settings dataclass through ``build``), or a
    ValueError that starts with ``path=value``. A field named ``mesh`` is read as (axis, size)
    pairs. A type without a rule here is a TypeError (a field added without one)."""
    kind, optional, element = annotation(hint)
    if value is None and optional:
        return None
    if dataclasses.is_dataclass(kind):
        if build is None:
            raise TypeError(f"{path}: a nested settings block needs a builder")
        return build(kind, value, path + ".")
    if path.rsplit(".", 1)[-1] == "mesh":
        if value is None:
            raise ValueError(f"mesh=None: expected axis sizes such as {mesh_example}")
        return mesh_pairs(value, mesh_example)
    if kind is bool:
        if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
            raise ValueError(f"{path}={value!r}: expected true or false")
        return bool(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{path}={value!r}: expected an integer")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{path}={value!r}: expected a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}={value!r}: expected a string")
        return value
    if kind is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{path}={value!r}: expected a sequence")
        items = tuple(value)
        return items if element is None else tuple(typed_value(f"{path}[{i}]", element, v) for i, v in enumerate(items))
    if kind is typing.Any or kind is object:
        return value
    raise TypeError(f"{path}: no rule for the type {kind!r}")   # a field added without one


def field_types(cls) -> dict:
    """Each field's annotation of a settings dataclass, resolved."""
    return typing.get_type_hints(cls)
