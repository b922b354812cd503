"""Feature-level draft heads: small networks on the target's hidden features.

A head reads the target's features of the committed positions (`DraftContext.features`, kept
by the engine for every committed position and rolled back with the caches) and drafts with
the target's embedding (and, but for the published EAGLE-3 layout, its final norm and output
layer); only the head's own weights are trained and exported (`HeadConfig.own_param_names`).

One module per kind, each a `HeadKind` registered by name (config checks, parameters, drafting
forward, training forward and its loss terms, evaluation outputs, training defaults):

* ``medusa`` (`_medusa`): Medusa-1 (Cai et al. 2024), K residual blocks, one pass per round;
* ``eagle`` (`_eagle`): EAGLE-1/2 (Li et al. 2024), one decoder layer over (token, feature)
  entries with its own KV cache, trained with a feature regression;
* ``eagle3`` (`_eagle3`): the EAGLE-3 style head (Li et al. 2025), the EAGLE layer over fused
  low, middle and high features, trained with training-time test;
* ``eagle3_published`` (`_eagle3_published`, its layer `_eagle3_layer`): the published EAGLE-3
  head with its own norm and LM head over a draft vocabulary;
* ``parallel`` (`_parallel`): the parallel block drafter, EAGLE-3's layer with placeholder
  inputs that drafts a whole block in one forward (PARD, DFlash).

What the kinds share: `_config` (`HeadConfig`, the `HeadKind` protocol and registry),
`_target_head` (parameters and scores through the target's own head), and for the EAGLE
family (the last four) `_family` (`EagleFamily`: the layer hooks and the training forward
with training-time test, `eagle_train_forward`) over the runtime `_runtime` (`EagleHead`, its
`HeadCache`, `FeatureHeadDrafter`).

Artifacts: `save_head` / `load_head` (`_artifact`: specjax's head.json + head.safetensors,
every kind) and `save_eagle3` / `load_eagle3` (`_eagle3_files`: the layouts other systems read
and write, published EAGLE-3 heads only).
"""

from specjax.drafters.heads._config import (INIT_STD, HeadConfig, HeadKind, head_kind_of, head_kinds, head_logits,
                                            head_params, head_scores, init_head_params, register_head_kind,
                                            unregister_head_kind)
from specjax.drafters.heads._medusa import Medusa, MedusaDrafter, medusa_features, medusa_logits
from specjax.drafters.heads._runtime import EagleHead, FeatureHeadDrafter, HeadCache, fuse_features
from specjax.drafters.heads._family import EagleFamily, eagle_train_forward
from specjax.drafters.heads._eagle import Eagle, eagle_input
from specjax.drafters.heads._eagle3 import Eagle3
from specjax.drafters.heads._eagle3_published import EAGLE3_PUBLISHED
from specjax.drafters.heads._parallel import PARALLEL, Parallel, ParallelDrafter
from specjax.drafters.heads._artifact import head_kind, is_head_dir, load_head, save_head
from specjax.drafters.heads._eagle3_files import LAYOUTS as EAGLE3_LAYOUTS
from specjax.drafters.heads._eagle3_files import (eagle3_config, eagle3_layout, eagle3_tensors, load_eagle3,
                                                  read_eagle3, save_eagle3)

HEAD_KINDS = head_kinds()      # the built-in kinds, in registration order

__all__ = ["EAGLE3_LAYOUTS", "EAGLE3_PUBLISHED", "HEAD_KINDS", "PARALLEL", "Parallel", "ParallelDrafter", "INIT_STD", "Eagle", "Eagle3", "EagleFamily", "Medusa", "EagleHead",
           "FeatureHeadDrafter", "HeadCache", "HeadConfig", "HeadKind", "MedusaDrafter", "eagle3_config",
           "eagle3_layout", "eagle3_tensors", "eagle_input", "eagle_train_forward", "fuse_features", "head_kind",
           "head_kind_of", "head_kinds", "head_logits", "head_params", "head_scores", "init_head_params",
           "is_head_dir", "load_eagle3", "load_head", "medusa_features", "medusa_logits", "read_eagle3",
           "register_head_kind", "save_eagle3", "save_head", "unregister_head_kind"]
