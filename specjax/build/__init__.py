"""From typed settings to the objects the engine runs, by concern:

* `_settings`: `GenerateSettings` (typed once from a config, `generate_settings`), and what they
  turn into: the sampling config, the engine's `GenerationConfig`;
* `_checks`: every setting checked before anything heavy loads (`check_config`);
* `_memory`: a round's memory estimate against the machine;
* `_load`: the target in the layout the settings ask for, the drafter, the engine and the
  `specjax.decoding.Generator` around them;
* `_runtime`: XLA options, the allocator and the compilation cache, set before a backend starts.
"""

from specjax.build._checks import (MAX_GAMMA, MAX_NEW_TOKENS_LIMIT, check_config, check_configs, check_generation_settings,
                                   check_mesh, check_seed, check_target_context)
from specjax.build._load import (CPU_KERNEL_CHOICES, generation_mesh, generator_for, generators_for, load_generator, load_target,
                                 load_target_with_tokenizer, make_drafter, use_cpu_attention, use_cpu_kernel)
from specjax.build._memory import (PAD_MULTIPLE, available_memory, check_round_memory, draft_rows, param_count,
                                   round_capacity, round_memory)
from specjax.build._runtime import (STRICT_PRECISION_FLAG, XLA_CPU_FLAGS, enable_compilation_cache,
                                    limit_heap_retention, strict_precision, tune_xla_cpu)
from specjax.build._settings import (FIELDS, STRING_FIELDS, GenerateSettings, generate_settings, generation_config,
                                     not_settings, sampling_config)
from specjax.drafters import SHIPPED_DRAFTS, SHIPPED_HEADS, shipped_draft, shipped_head

__all__ = ["MAX_GAMMA", "MAX_NEW_TOKENS_LIMIT", "check_config", "check_configs", "check_generation_settings", "check_mesh", "check_seed",
           "check_target_context", "CPU_KERNEL_CHOICES", "generation_mesh", "generator_for", "generators_for", "load_generator",
           "load_target", "load_target_with_tokenizer", "make_drafter", "use_cpu_attention", "use_cpu_kernel",
           "PAD_MULTIPLE", "available_memory", "check_round_memory", "draft_rows", "param_count", "round_capacity",
           "round_memory", "STRICT_PRECISION_FLAG", "XLA_CPU_FLAGS", "enable_compilation_cache",
           "limit_heap_retention", "strict_precision", "tune_xla_cpu", "FIELDS", "STRING_FIELDS", "GenerateSettings",
           "generate_settings", "generation_config", "not_settings", "sampling_config",
           "SHIPPED_DRAFTS", "SHIPPED_HEADS", "shipped_draft", "shipped_head"]
