"""Typed settings of a distillation run: what `specjax.distill.train` reads, made once.

`DistillSettings` mirrors configs/distill.py block by block (``data`` with its ``shards``,
``draft``, ``head``, ``loss``, ``optim``, ``eval``, ``mesh``); `distill_settings` turns a
ConfigDict, a nested mapping (a workdir's ``config.json``) or settings into it: every value
typed (tuples for sequences, the mesh as (axis, size) pairs), a value of the wrong type or a key
the trainer does not know named with its dotted path, a block or key that is absent keeping its
default. Nothing below `train` reads a ConfigDict.

The defaults are configs/distill.py's (tests/test_settings.py checks them). That file has no
``head`` block (configs/distill_head.py adds one): `HeadSettings`' defaults are what a config
without it means, and ``head.ttt_steps`` and ``head.feature_weight`` left at None take the head
kind's defaults (`HeadKind.default_ttt_steps`, `default_feature_weight`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, Optional

from specjax.distill._drafts import DraftChoice
from specjax.settings import Settings, typed_value


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    dirs: tuple[str, ...] = ()      # answer shard directories of `specjax data`
    weight: float = 0.0             # mixture weight of the streamed shards
    window: int = 8                 # shards shuffled together
    max_loss_tokens: int = 0        # > 0: only the first N loss tokens of the canonical order
    group_by_length: bool = False   # batches of answers of similar length (`ShardStream`)


@dataclasses.dataclass(frozen=True)
class DataSettings:
    greedy_samples: int = 1
    sampled_samples: int = 0
    temperature: float = 1.0
    second_turns: bool = False
    max_new_tokens: int = 256
    gen_batch_size: int = 32
    widths: tuple[int, ...] = (256, 512, 1024)
    tokens_per_batch: int = 4096
    max_prompt_tokens: int = 512
    per_category: int = 0
    fixed_jsonl: str = ""
    target_weight: float = 0.7
    fixed_weight: float = 0.0
    draft_weight: float = 0.3
    draft_refresh_every: int = 150
    draft_prompts: int = 64
    draft_max_prompt_tokens: int = 384
    draft_max_new_tokens: int = 128
    shards: ShardSettings = ShardSettings()


# dtypes a head may train in (`head.compute_dtype`)
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class HeadSettings:
    ttt_steps: Optional[int] = None         # None: the kind's default
    feature_weight: Optional[float] = None  # None: the kind's default
    feature_noise: float = 0.0
    num_heads: int = 4
    input_norm: bool = False
    feature_layers: tuple[int, ...] = ()    # (): the kind's default layers
    feature_cache: str = ""                 # '' | 'float32' | 'float16'
    # the head's forward and backward in this dtype (its master weights, the optimizer, the
    # teacher and the loss stay float32): 'float32' | 'bfloat16'
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"config.head.compute_dtype={self.compute_dtype!r}: one of {COMPUTE_DTYPES}")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    divergence: str = "jsd"
    beta: float = 0.5
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    end_lr_fraction: float = 0.1
    clip_norm: float = 1.0
    weight_decay: float = 0.0
    accumulate: int = 1
    on_nonfinite: str = "stop"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    every: int = 200
    per_category: int = 4
    max_prompt_tokens: int = 0
    max_new_tokens: int = 128
    gamma: int = 4
    data_jsonl: str = ""
    at_start: bool = True


@dataclasses.dataclass(frozen=True)
class DistillSettings(Settings):
    target: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    seed: int = 0
    data_root: str = ""
    data: DataSettings = DataSettings()
    draft: DraftChoice = DraftChoice(head_vocab=8192)
    head: HeadSettings = HeadSettings()
    loss: LossSettings = LossSettings()
    optim: OptimSettings = OptimSettings()
    budget_tokens: int = 1_000_000
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    eval: EvalSettings = EvalSettings()
    mesh: tuple = (("data", -1), ("fsdp", 1), ("model", 1))
    distributed: bool = False
    export_dir: str = ""
    export_dtype: str = "bfloat16"
    progress: bool = True
    metrics_lag: int = 1
    allow_data_order_change: bool = False

    @property
    def is_head(self) -> bool:
        from specjax import drafters
        return self.draft.kind in drafters.head_kinds()


def _build(cls, values, prefix: str = "", extra: str = "error"):
    if isinstance(values, cls):
        return values
    if hasattr(values, "to_dict"):
        values = values.to_dict()
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'the config'}={values!r}: expected a block of settings")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if extra == "ignore":
        values = {k: v for k, v in values.items() if k in names}
    elif unknown:
        raise ValueError(f"unknown distillation setting(s) {', '.join(prefix + k for k in unknown)} (known here: "
                         f"{', '.join(sorted(names))})")
    given = {k: typed_value(prefix + k, hints[k], v, build=_build,
                             mesh_example="{'data': -1, 'fsdp': 1, 'model': 1}") for k, v in values.items()}
    if cls is DraftChoice:      # the draft block's own defaults are configs/distill.py's
        return dataclasses.replace(DistillSettings.draft, **given)
    return cls(**given)


def distill_settings(c: Any, *, extra: str = "error") -> DistillSettings:
    """`DistillSettings` of a distillation config: a ConfigDict, a nested mapping or settings
    (returned as they are). Absent keys keep their defaults; a mistyped value is a ValueError
    naming its dotted path, and so is an unknown key, unless ``extra='ignore'``: a command
    whose config is a distillation config plus keys of its own (`specjax eval`) leaves its own
    top-level keys out."""
    if extra not in ("error", "ignore"):
        raise ValueError(f"extra={extra!r}: expected 'error' or 'ignore'")
    if isinstance(c, DistillSettings):
        return c
    if not (hasattr(c, "to_dict") or isinstance(c, Mapping)):
        raise TypeError(f"a distillation config must be a ConfigDict, a mapping or DistillSettings, "
                        f"got {type(c).__name__}")
    return _build(DistillSettings, c, extra=extra)
