"""The drafter registry: every drafter kind the commands can build, each registered beside its
class with its own frozen settings, its builder, its checks and what a run says about it.

A new kind is one module with one `register_drafter` call (a package module or a user's own):
`specjax generate --config.drafter=NAME` and `specjax bench --config.drafters="('NAME',)"` then
build it, its settings typed from the generation config's keys of the same names (the CLI adds a
registered kind's keys, with their defaults, to every generation config). The CLI, `build` and
`bench` know no kind by name: what differs between kinds is here.
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
class DraftJob:
    """What a kind's ``check`` reads besides its own settings, before any weight loads: the
    target's registry name or path, and the trees the run drafts (parsed, `specjax.trees`) with
    the setting that names them (``tree`` or ``adaptive_trees``) and its value, for messages."""
    target: str
    trees: tuple = ()
    tree_setting: str = "tree"
    tree_value: Any = ""


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One finished generation, for a kind's ``describe``: the prompt's token ids, the new
    tokens, and the tokens committed in each round."""
    prompt_ids: tuple
    tokens: tuple
    round_sizes: tuple


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """A registered kind.

    settings: a frozen dataclass type; its fields are the generation config keys this kind
      reads, with their defaults (a key two kinds share must have one default).
    build(settings, ctx) -> (drafter, draft params or None).
    check(settings, job): refuses settings before any weight loads (ValueError naming the key);
      optional.
    describe(settings, drafter, record) -> (text, stats): what `specjax generate` adds about this
      kind to its line on the drafter, and to its stats record; optional.
    teacher_forced: the kind `specjax eval` builds to score this kind's draft teacher-forced (a
      `specjax.drafters.ModelDrafter`), or "" when it has no draft distribution to score.
    after_run(settings, record): what the kind keeps of a finished `specjax generate` run (the
      suffix drafter's corpus saved to its cache directory); optional.
    """
    name: str
    settings: type
    build: Callable[[Any, BuildContext], tuple[Any, Any]]
    check: Callable[[Any, DraftJob], None] | None = None
    describe: Callable[[Any, Any, RunRecord], tuple[str, dict]] | None = None
    description: str = ""
    teacher_forced: str = ""
    after_run: Callable[[Any, RunRecord], None] | None = None

    def settings_from(self, values: Any):
        """This kind's settings from a mapping of config values (or an object with the
        attributes): the values it names, typed by its fields' annotations (ValueError naming
        the key), its defaults for the others. Settings of this kind are returned as they are."""
        if isinstance(values, self.settings):
            return values
        from specjax.settings import field_types, typed_value
        if isinstance(values, Mapping):
            has, get = (lambda k: k in values), values.get
        else:
            has, get = (lambda k: hasattr(values, k)), (lambda k, d=None: getattr(values, k, d))
        hints = field_types(self.settings)
        fields = {f.name: typed_value(f.name, hints[f.name], get(f.name)) for f in dataclasses.fields(self.settings)
                  if has(f.name)}
        return self.settings(**fields)


_KINDS: dict[str, DrafterKind] = {}


def register_drafter(name: str, settings: type, build, *, check=None, describe=None, description: str = "",
                     teacher_forced: str = "", after_run=None) -> DrafterKind:
    """Register drafter kind ``name`` (see `DrafterKind`). Refused: a name already taken by
    another kind, settings that are not a frozen dataclass, and a settings key another kind
    already reads with another default."""
    if not dataclasses.is_dataclass(settings) or not settings.__dataclass_params__.frozen:
        raise TypeError(f"drafter {name!r}: settings must be a frozen dataclass type, got {settings!r}")
    kind = DrafterKind(name, settings, build, check, describe, description, teacher_forced, after_run)
    old = _KINDS.get(name)
    if old is not None and (old.settings, old.build) != (settings, build):
        raise ValueError(f"drafter kind {name!r} is already registered")
    shared = settings_keys(exclude=name)
    for key, default in _defaults(settings).items():
        if key in shared and shared[key] != default:
            raise ValueError(f"drafter {name!r}: setting {key!r} has default {default!r}, but another kind reads "
                             f"{key!r} with default {shared[key]!r}; a key means one thing")
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
    """The registered kinds in registration order, target-only last."""
    return tuple(k for k in _KINDS if k != TARGET_ONLY) + tuple(k for k in _KINDS if k == TARGET_ONLY)


def _defaults(settings: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(settings) if f.default is not dataclasses.MISSING}


def settings_keys(exclude: str = "") -> dict[str, Any]:
    """Every registered kind's settings keys with their defaults (one mapping: a key shared by
    kinds has one default): the keys a generation config accepts besides its own."""
    keys: dict[str, Any] = {}
    for name, kind in _KINDS.items():
        if name != exclude:
            keys.update(_defaults(kind.settings))
    return keys


def build_drafter(name: str, values: Mapping[str, Any], ctx: BuildContext):
    """(drafter, draft params) of kind ``name`` with its settings from ``values`` (a mapping of
    config values, or the kind's settings)."""
    kind = drafter_kind(name)
    return kind.build(kind.settings_from(values), ctx)


TARGET_ONLY = "none"       # the kind that drafts nothing: target-only decoding


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """A kind that reads no setting."""


register_drafter(TARGET_ONLY, NoSettings, lambda s, ctx: (None, None), description="target-only decoding")
