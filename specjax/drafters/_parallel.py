"""The ``parallel`` drafter kind: the parallel block drafter (`specjax.drafters.heads._parallel`),
a gamma-token block from one forward of a small layer on the target's features."""

from __future__ import annotations

from specjax.drafters import heads
from specjax.drafters._model import DraftModelSettings
from specjax.drafters._registry import register_drafter


def _check(s: DraftModelSettings, job) -> None:
    if not s.draft_model:
        raise ValueError("drafter='parallel' needs draft_model: a directory written by specjax.distill with "
                         "draft.kind='parallel' (configs/distill_parallel.py)")


def _build(s: DraftModelSettings, ctx):
    _check(s, None)
    kind = heads.head_kind(s.draft_model)
    if kind != "parallel":
        raise ValueError(f"drafter='parallel' needs a parallel drafter; {s.draft_model} holds a {kind!r} head "
                         f"(use drafter='head' for it)")
    return heads.load_head(s.draft_model, ctx.target, ctx.target_params)


register_drafter("parallel", DraftModelSettings, _build, check=_check,
                 description="a parallel block drafter: gamma tokens from one forward on the target's features")
