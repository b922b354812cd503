"""Drafters: who proposes the tokens the target verifies (one protocol, several kinds)."""

from specjax.drafters._model import EarlyExitDrafter, ModelDrafter, ModelDraftState, draw, rollout
from specjax.drafters._ngram import NGramDrafter
from specjax.drafters._protocol import DraftContext, Drafter

__all__ = ["DraftContext", "Drafter", "EarlyExitDrafter", "ModelDrafter", "ModelDraftState", "NGramDrafter",
           "draw", "rollout"]
