"""Drafters: who proposes the tokens the target verifies (one protocol, several kinds)."""

from specjax.drafters.heads import (EAGLE3_LAYOUTS, EAGLE3_PUBLISHED, HEAD_KINDS, EagleHead, FeatureHeadDrafter,
                                    HeadCache, HeadConfig, HeadKind, MedusaDrafter, eagle3_config, eagle3_layout,
                                    eagle3_tensors, eagle_input, eagle_train_forward, fuse_features, head_kind,
                                    head_kind_of, head_kinds, head_logits, head_params, head_scores, init_head_params,
                                    is_head_dir, load_eagle3, load_head, medusa_features, medusa_logits, read_eagle3,
                                    register_head_kind, save_eagle3, save_head, unregister_head_kind)
from specjax.drafters._model import (EarlyExitDrafter, ModelDrafter, ModelDraftState, draw, draw_support, rollout,
                                     support_scores)
from specjax.drafters._hybrid import HybridDrafter
from specjax.drafters._ngram import NGramDrafter
from specjax.drafters._protocol import CHAIN_ONLY, Capabilities, DraftContext, Drafter
from specjax.drafters._registry import (BuildContext, DrafterKind, build_drafter, drafter_kind, drafter_kinds,
                                        register_drafter, unregister_drafter)

__all__ = ["EAGLE3_PUBLISHED", "EAGLE3_LAYOUTS", "eagle3_config", "eagle3_layout", "eagle3_tensors", "load_eagle3",
           "read_eagle3", "save_eagle3", "head_kind", "is_head_dir", "load_head", "save_head", "HEAD_KINDS", "HeadKind", "head_kind_of", "head_kinds", "register_head_kind", "unregister_head_kind", "EagleHead", "FeatureHeadDrafter", "HeadCache", "HeadConfig", "MedusaDrafter", "eagle_input", "fuse_features",
           "eagle_train_forward", "head_logits", "head_scores", "medusa_features", "head_params", "init_head_params", "medusa_logits",
           "CHAIN_ONLY", "Capabilities", "BuildContext", "DrafterKind", "build_drafter", "drafter_kind",
           "drafter_kinds", "register_drafter", "unregister_drafter",
           "DraftContext", "Drafter", "EarlyExitDrafter", "HybridDrafter", "ModelDrafter", "ModelDraftState", "NGramDrafter",
           "draw", "draw_support", "rollout", "support_scores"]
