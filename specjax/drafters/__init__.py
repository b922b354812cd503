"""Drafters: who proposes the tokens the target verifies (one protocol, several kinds)."""

from specjax.drafters._model import (EarlyExitDrafter, ModelDrafter, ModelDraftState, draw, rollback_to_committed,
                                     rollout)
from specjax.drafters._ngram import NGramDrafter
from specjax.drafters._protocol import Drafter

__all__ = ["Drafter", "EarlyExitDrafter", "ModelDrafter", "ModelDraftState", "NGramDrafter", "draw", "rollback_to_committed", "rollout"]
