"""Drafters: who proposes the tokens the target verifies (one protocol, several kinds, each kind
registered beside its class: `register_drafter`)."""

from specjax.drafters.heads import (EAGLE3_LAYOUTS, EAGLE3_PUBLISHED, HEAD_KINDS, EagleHead, FeatureHeadDrafter,
                                    ParallelDrafter,
                                    HeadCache, HeadConfig, HeadKind, MedusaDrafter, eagle3_config, eagle3_layout,
                                    eagle3_tensors, eagle_input, eagle_train_forward, fuse_features, head_kind,
                                    head_kind_of, head_kinds, head_logits, head_params, head_scores, init_head_params,
                                    is_head_dir, load_eagle3, load_head, medusa_features, medusa_logits, read_eagle3,
                                    register_head_kind, save_eagle3, save_head, unregister_head_kind)
from specjax.drafters._registry import (BuildContext, DraftJob, DrafterKind, NoSettings, RunRecord, TARGET_ONLY, build_drafter,
                                        drafter_kind, drafter_kinds, register_drafter, settings_keys,
                                        unregister_drafter)
from specjax.drafters._shipped import SHIPPED_DRAFTS, SHIPPED_HEADS, shipped_draft, shipped_head
from specjax.drafters._model import (DraftModelSettings, EarlyExitDrafter, EarlyExitSettings, ModelDrafter,
                                     ModelDraftState, draw, draw_positions, draw_support, rollout,
                                     support_scores)
from specjax.drafters import _head  # noqa: F401  (registers the 'head' kind)
from specjax.drafters import _parallel  # noqa: F401  (registers the 'parallel' kind)
from specjax.drafters._hybrid import HYBRID_LOOKUPS, HYBRID_MODELS, HybridDrafter, HybridParams, HybridSettings
from specjax.drafters._ngram import NGramDrafter, NGramSettings
from specjax.drafters._suffix import SuffixCache, SuffixCorpus, SuffixDrafter, SuffixSettings, check_cache_dir, remember
from specjax.drafters._protocol import CHAIN_ONLY, Capabilities, DraftContext, Drafter

__all__ = ["EAGLE3_PUBLISHED", "EAGLE3_LAYOUTS", "eagle3_config", "eagle3_layout", "eagle3_tensors", "load_eagle3",
           "read_eagle3", "save_eagle3", "head_kind", "is_head_dir", "load_head", "save_head", "HEAD_KINDS", "HeadKind",
           "head_kind_of", "head_kinds", "register_head_kind", "unregister_head_kind", "EagleHead",
           "FeatureHeadDrafter", "ParallelDrafter", "HeadCache", "HeadConfig", "MedusaDrafter", "eagle_input", "fuse_features",
           "eagle_train_forward", "head_logits", "head_scores", "medusa_features", "head_params", "init_head_params",
           "medusa_logits",
           "CHAIN_ONLY", "Capabilities", "BuildContext", "DraftJob", "DrafterKind", "NoSettings", "RunRecord", "TARGET_ONLY",
           "build_drafter", "drafter_kind", "drafter_kinds", "register_drafter", "settings_keys", "unregister_drafter",
           "SHIPPED_DRAFTS", "SHIPPED_HEADS", "shipped_draft", "shipped_head",
           "DraftModelSettings", "EarlyExitSettings", "HybridSettings", "NGramSettings", "HYBRID_MODELS", "HYBRID_LOOKUPS", "HybridParams",
           "DraftContext", "Drafter", "EarlyExitDrafter", "HybridDrafter", "ModelDrafter", "ModelDraftState",
           "NGramDrafter", "SuffixCache", "SuffixCorpus", "SuffixDrafter", "SuffixSettings", "remember", "check_cache_dir", "draw",
           "draw_positions", "draw_support", "rollout", "support_scores"]
