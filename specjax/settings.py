"""Typed settings of a generation job: what the CLI reads from a ConfigDict, once.

`GenerateSettings` holds the settings of configs/generate.py that decide the target, its
layout, the drafter and the decoding (the command's own keys, such as the prompt, stay with the
command). `generate_settings` turns a ConfigDict (or a dict, or settings already) into it:
every known key typed (tuples for sequences, the mesh as (axis, size) pairs), a key of the
wrong type named; keys it does not know are left to the caller. The library below the CLI
(`specjax.build`, the drafter registry) reads these attributes only. Values are checked
against each other and against the target by `specjax.build.check_config`.

The defaults are configs/generate.py's (tests/test_settings.py checks that they agree), so a
settings object made in code, ``GenerateSettings(drafter='ngram')``, is the main command's.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping


class Settings:
    """Base of the frozen settings dataclasses (`GenerateSettings`, `specjax.distill.DistillSettings`)."""

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
    draft_model: str = ""                   # a draft directory or model path; "" = the shipped one
    early_exit_layers: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    hybrid_model: str = "head"
    min_match: int = 0
    gamma: int = 3
    adaptive_gamma: bool = False
    adaptive_gammas: tuple = (0, 1, 2, 3, 4)
    verifier: str = "block"
    tree: str = ""
    adaptive_trees: tuple = ()
    tree_verifier: str = "traversal"
    tree_children: str = "iid"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    block_tokens: int = 0                   # tokens every target pass scores (`decoding.GenerationConfig`)
    strict_precision: bool = False          # XLA rounds every bf16 result as written (`build.strict_precision`)
    mesh: tuple = (("data", 1), ("fsdp", 1), ("model", -1))   # (axis, size) pairs, -1 = the rest

    @property
    def mesh_axes(self) -> dict:
        return dict(self.mesh)


FIELDS = {f.name: f for f in dataclasses.fields(GenerateSettings)}
STRING_FIELDS = ("target", "dtype", "cpu_kernel", "attention_op", "drafter", "draft_model", "hybrid_model", "verifier",
            "tree", "tree_verifier", "tree_children")
_FLAGS = ("scan_layers", "fuse_projections", "adaptive_gamma", "strict_precision", "write_then_attend")


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
    if name in ("adaptive_gammas", "adaptive_trees"):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            what = "integers >= 0" if name == "adaptive_gammas" else "tree strings"
            raise ValueError(f"{name}={value!r}: expected a tuple of {what}")
        return tuple(value)
    if name == "mesh":
        if value is None:
            return FIELDS["mesh"].default
        return mesh_pairs(value, "{'data': 1, 'fsdp': 1, 'model': -1}")
    return value


def generate_settings(c: Any) -> GenerateSettings:
    """`GenerateSettings` of a generation config: a ConfigDict or a mapping (its known keys; a
    key it lacks keeps the default, keys of the command itself are ignored), or settings
    (returned as they are)."""
    if isinstance(c, GenerateSettings):
        return c
    values: Mapping = c.to_dict() if hasattr(c, "to_dict") else c
    if not hasattr(values, "items"):
        raise TypeError(f"a generation config must be a ConfigDict, a mapping or GenerateSettings, "
                        f"got {type(c).__name__}")
    return GenerateSettings(**{k: typed(k, v) for k, v in values.items() if k in FIELDS})
