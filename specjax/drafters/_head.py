"""The ``head`` drafter kind: a feature-level draft head (EAGLE, EAGLE-3, Medusa, the published
EAGLE-3 layout; `specjax.drafters.heads`) on the target's hidden features."""

from __future__ import annotations

from specjax.drafters import heads
from specjax.drafters._model import DraftModelSettings
from specjax.drafters._registry import register_drafter
from specjax.drafters._shipped import SHIPPED_HEADS, shipped_head


def _build(s: DraftModelSettings, ctx):
    """A directory written by `specjax.distill`, or an EAGLE-3 head in the reference / SpecForge
    or vLLM speculators layout (`heads.load_eagle3`); "" = the head shipped for the target."""
    if not s.draft_model and ctx.target_name not in SHIPPED_HEADS:
        raise ValueError("drafter='head' needs draft_model: a head directory written by specjax.distill "
                         "with draft.kind in ('eagle3', 'eagle', 'medusa') (no head ships for target "
                         f"{ctx.target_name!r})")
    directory = s.draft_model or shipped_head(ctx.target_name)
    if not heads.is_head_dir(directory) and heads.eagle3_layout(directory) is not None:
        return heads.load_eagle3(directory, ctx.target, ctx.target_params)
    return heads.load_head(directory, ctx.target, ctx.target_params)


register_drafter("head", DraftModelSettings, _build, description="a feature-level draft head")
