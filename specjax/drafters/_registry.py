"""The drafter registry: every drafter kind the commands can build, with its own frozen settings
and its builder. A new kind is one `register_drafter` call (beside its class or in a user's own
module); `specjax generate --config.drafter=NAME` then builds it, with its settings taken from
the generation config's keys of the same names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a builder gets besides its own settings: the target and its weights, the target's
    registry name or path, and the layout the draft should load in."""
    target: Any
    target_params: Any
    target_name: str = ""
    dtype: str = "float32"
    scan_layers: bool = True


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """A registered kind: ``settings`` is a frozen dataclass type (its fields the generation
    config keys this kind reads, with their defaults), ``build(settings, ctx) -> (drafter,
    draft params or None)``; ``check(settings, target_name)`` (optional) refuses settings before
    any weight loads (ValueError naming the key)."""
    name: str
    settings: type
    build: Callable[[Any, BuildContext], tuple[Any, Any]]
    check: Callable[[Any, str], None] | None = None
    description: str = ""

    def settings_from(self, values: Any):
        """This kind's settings from typed settings (`specjax.settings.GenerateSettings`, any
        object with the attributes) or a mapping: the values it names, its defaults for the
        others."""
        if isinstance(values, Mapping):
            has, get = (lambda k: k in values), values.get
        else:
            has, get = (lambda k: hasattr(values, k)), (lambda k, d=None: getattr(values, k, d))
        fields = {f.name: get(f.name, f.default) for f in dataclasses.fields(self.settings)
                  if f.default is not dataclasses.MISSING or has(f.name)}
        return self.settings(**fields)


_KINDS: dict[str, DrafterKind] = {}


def register_drafter(name: str, settings: type, build, *, check=None, description: str = "") -> DrafterKind:
    """Register drafter kind ``name`` (see `DrafterKind`); a name already taken by another kind is refused."""
    if not dataclasses.is_dataclass(settings) or not settings.__dataclass_params__.frozen:
        raise TypeError(f"drafter {name!r}: settings must be a frozen dataclass type, got {settings!r}")
    kind = DrafterKind(name, settings, build, check, description)
    old = _KINDS.get(name)
    if old is not None and (old.settings, old.build) != (settings, build):
        raise ValueError(f"drafter kind {name!r} is already registered")
    _KINDS[name] = kind
    return kind


def unregister_drafter(name: str) -> None:
    _KINDS.pop(name, None)


def drafter_kind(name: str) -> DrafterKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"drafter={name!r}: expected one of {', '.join(drafter_kinds())}") from None


def drafter_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def build_drafter(name: str, values: Mapping[str, Any], ctx: BuildContext):
    """(drafter, draft params) of kind ``name`` with its settings from ``values``."""
    kind = drafter_kind(name)
    return kind.build(kind.settings_from(values), ctx)
