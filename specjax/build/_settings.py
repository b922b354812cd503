"""Typed settings of a generation job, made once from a ConfigDict at the command's edge.

`GenerateSettings` holds the settings of configs/generate.py that decide the target, its layout,
the decoding and the drafter; the drafter's own keys are its kind's settings block (``draft``,
the frozen settings class the kind registered, `specjax.drafters.register_drafter`), not fields
of this class. `generate_settings` turns a ConfigDict or a mapping into it: every known key typed
(tuples for sequences, the mesh as (axis, size) pairs), a key of the wrong type named; keys it
does not know (a command's own) are left to the caller. Below the CLI every function takes these
settings, never a ConfigDict (`not_settings`). Values are checked against each other and against the
target by `specjax.build.check_config`.

The defaults are configs/generate.py's (tests/test_settings.py checks that they agree), so
``GenerateSettings(drafter='ngram')`` is the main command with prompt lookup.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

from specjax import decoding, drafters, sampling, trees
from specjax.settings import Settings, mesh_pairs


@dataclasses.dataclass(frozen=True)
class GenerateSettings(Settings):
    target: str = "smollm2-135m-instruct"   # registry name, GGUF path or HF checkpoint dir
    dtype: str = "float32"
    scan_layers: bool = False               # stacked layers under lax.scan (else unrolled)
    fuse_projections: bool = True           # q|k|v and gate|up as one matmul each
    cpu_kernel: str = "auto"                # 'auto' | 'on' | 'off' (`specjax.build.use_cpu_kernel`)
    attention_op: str = "reference"         # a registered attention op (`specjax.models.attention`)
    write_then_attend: bool = False         # block K/V written before attending (`ModelConfig.write_then_attend`)
    drafter: str = "hybrid"                 # a registered drafter kind (`specjax.drafters.drafter_kinds`)
    draft: Any = None                       # that kind's own settings; None = its defaults
    gamma: int = 3
    adaptive_gamma: bool = False
    adaptive_gammas: tuple = (0, 1, 2, 3, 4)
    adaptive_budgets: tuple = ()            # row budgets among the adaptive candidates (`budget_candidates`)
    verifier: str = "block"
    tree: str = ""
    adaptive_trees: tuple = ()
    tree_verifier: str = "traversal"
    tree_children: str = "iid"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_new_tokens: int = 128
    block_tokens: int = 0                   # tokens every target pass scores (`decoding.GenerationConfig`)
    strict_precision: bool = False          # XLA rounds every bf16 result as written (`build.strict_precision`)
    mesh: tuple = (("data", 1), ("fsdp", 1), ("model", -1))   # (axis, size) pairs, -1 = the rest

    def __post_init__(self):
        for name in _TYPED:                                 # also when made in code, not from a config
            object.__setattr__(self, name, typed(name, getattr(self, name)))
        kind = drafters.drafter_kind(self.drafter)          # ValueError naming the registered kinds
        if self.draft is None:
            object.__setattr__(self, "draft", kind.settings())
        elif not isinstance(self.draft, kind.settings):
            raise ValueError(f"drafter={self.drafter!r} reads {kind.settings.__name__}, got draft settings "
                             f"{type(self.draft).__name__}")

    def replace(self, **changes):
        """A copy with ``changes``; a new ``drafter`` without ``draft`` starts from that kind's
        defaults."""
        if "drafter" in changes and "draft" not in changes and changes["drafter"] != self.drafter:
            changes["draft"] = None
        return dataclasses.replace(self, **changes)

    @property
    def drafter_kind(self) -> drafters.DrafterKind:
        return drafters.drafter_kind(self.drafter)

    @property
    def mesh_axes(self) -> dict:
        return dict(self.mesh)


FIELDS = {f.name: f for f in dataclasses.fields(GenerateSettings) if f.name != "draft"}
STRING_FIELDS = ("target", "dtype", "cpu_kernel", "attention_op", "drafter", "verifier", "tree", "tree_verifier",
                 "tree_children")
_FLAGS = ("scan_layers", "fuse_projections", "adaptive_gamma", "strict_precision", "write_then_attend")
_TYPED = STRING_FIELDS + _FLAGS + ("adaptive_gammas", "adaptive_budgets", "adaptive_trees", "mesh")


def typed(name: str, value):
    """One setting as its field's type; ValueError naming the setting otherwise. Numbers are
    passed as given (their ranges are `specjax.build.check_config`'s to check, with messages
    that name the range)."""
    if name in STRING_FIELDS:
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r}: expected a string")
        return value
    if name in _FLAGS:
        if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
            raise ValueError(f"{name}={value!r}: expected true or false")
        return bool(value)
    if name in ("adaptive_gammas", "adaptive_budgets", "adaptive_trees"):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            what = {"adaptive_gammas": "integers >= 0", "adaptive_budgets": "numbers > 1",
                    "adaptive_trees": "tree strings"}[name]
            raise ValueError(f"{name}={value!r}: expected a tuple of {what}")
        return tuple(value)
    if name == "mesh":
        if value is None:
            return FIELDS["mesh"].default
        return mesh_pairs(value, "{'data': 1, 'fsdp': 1, 'model': -1}")
    return value


def budget_candidates(gammas, widths) -> tuple:
    """The row budgets of ``adaptive_budgets`` (positions scored per row, the root included): one
    `decoding.RowBudget` per width, each drafting up to the largest of ``adaptive_gammas``, so
    the rows of one round get gammas from 0 to that (`specjax.decoding.adaptive`)."""
    if not widths:
        return ()
    return tuple(decoding.RowBudget(max(gammas, default=0), float(w)) for w in widths)


def generate_settings(c: Any, **changes) -> GenerateSettings:
    """`GenerateSettings` of a generation config (a ConfigDict or a mapping: its known keys; a
    key it lacks keeps the default, keys of the command itself are ignored), with ``changes``
    (config keys, e.g. ``drafter=``) over it. The drafter's block is typed from the same keys
    (`DrafterKind.settings_from`). Called once, where a command's config enters."""
    if isinstance(c, GenerateSettings):
        raise TypeError("generate_settings: these are settings already (a config is typed once, at the command's edge)")
    values: Mapping = c.to_dict() if hasattr(c, "to_dict") else c
    if not hasattr(values, "items"):
        raise TypeError(f"a generation config must be a ConfigDict or a mapping, got {type(c).__name__}")
    values = {**values, **changes}
    core = {k: v for k, v in values.items() if k in FIELDS}
    kind = drafters.drafter_kind(core.get("drafter", FIELDS["drafter"].default))
    return GenerateSettings(**core, draft=kind.settings_from(values))


def not_settings(what: str, value) -> TypeError:
    """The error of a function below the edge given something other than `GenerateSettings`
    (a ConfigDict is typed once, by `generate_settings`, where the command starts)."""
    return TypeError(f"{what} takes GenerateSettings (type a config once with specjax.build.generate_settings), "
                     f"got {type(value).__name__}")


def sampling_config(s: GenerateSettings) -> sampling.SamplingConfig:
    if not isinstance(s, GenerateSettings):
        raise not_settings("sampling_config", s)
    try:
        return sampling.SamplingConfig.make(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                            repetition_penalty=s.repetition_penalty,
                                            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty)
    except ValueError as e:
        name = str(e).split(" ")[0]          # the messages begin with the setting's name
        raise ValueError(f"{name}={getattr(s, name)!r}: {e}") from None


def proposals(s: GenerateSettings):
    """What each round drafts: 0 for target-only, a parsed tree, an `AdaptiveGamma` over the
    draft lengths and trees, or ``gamma``. The values must have passed `check_generation_settings`."""
    if s.drafter == drafters.TARGET_ONLY:
        return 0
    if s.tree:
        return trees.parse_tree(s.tree)
    if s.adaptive_gamma:
        return decoding.AdaptiveGamma(gammas=tuple(s.adaptive_gammas) + budget_candidates(s.adaptive_gammas,
                                                                                          s.adaptive_budgets)
                                      + tuple(trees.parse_tree(t) for t in s.adaptive_trees))
    return int(s.gamma)


def generation_config(s: GenerateSettings, eos_ids) -> decoding.GenerationConfig:
    """The engine's static configuration of checked settings, with the tokenizer's stop ids."""
    if not isinstance(s, GenerateSettings):
        raise not_settings("generation_config", s)
    try:
        return decoding.GenerationConfig(max_new_tokens=s.max_new_tokens, gamma=proposals(s), verifier=s.verifier,
                                         eos_ids=tuple(eos_ids), tree_verifier=s.tree_verifier,
                                         tree_children=s.tree_children, block_tokens=s.block_tokens)
    except ValueError as e:
        if str(e).startswith("block_tokens"):
            raise ValueError(f"block_tokens={s.block_tokens!r}: {e}") from None
        raise

