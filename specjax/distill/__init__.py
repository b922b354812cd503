"""Draft distillation (DistillSpec, Zhou et al., ICLR 2024): align a draft to its target.

    train(config, workdir)        the restartable run (python -m specjax.distill --config=...)
    DistillSettings / distill_settings   its typed settings, made once from a ConfigDict or mapping
    with_overrides / flatten      set dotted or nested config keys
    check_resume_config           refuse a workdir whose checkpoints hold a differently shaped state
    make_train_step / LossSpec    the pure jitted step and its loss
    divergence / forward_kl / reverse_kl / generalized_jsd / total_variation
    DraftChoice / build_draft     target-layer, fresh and reduced-vocabulary drafts
    HeadObjective / head_loss / evaluate_head / noisy_features   feature-level draft heads (EAGLE-3, EAGLE,
                                  Medusa; noisy_features: their training-time feature noise)
    loss_origins / with_loss_origins   the origins a head's loss reads (its later steps run there only)
    SequenceSet / TeacherData / BatchPlan / generate / teacher_states / feature_states / from_jsonl   data
    eval_plan                     a training config's held-out evaluation set
    generated_data / second_turn_prompts / with_features / feature_file   data sets on disk
    spec_bench_prompts            chat-templated Spec-Bench prompts of a split (length and per-category subsets)
    generate_data / DataConfig / data_config   the data engine (`specjax data`): Magpie prompts, cleaned
                                  (build_corpus, near_duplicates, template_prefix), answers as `shards`
    ShardStream                   training batches streamed from shard directories (bounded memory,
                                  seeded shuffle, length buckets, nested data-size cuts, mid-epoch resume)
    ShardFeatures / shard_features / shard_feature_forward / fill_shard_features   the target's features of
                                  streamed shards, computed once per (shard, layer) and read with the batches
"""

from specjax.distill import _shards as shards
from specjax.distill._corpus import Candidate, build_corpus, near_duplicates, template_prefix
from specjax.distill._datagen import STAGES as DATA_STAGES
from specjax.distill._datagen import DataConfig, StageSettings
from specjax.distill._datagen import config_from_dict as data_config
from specjax.distill._datagen import run as generate_data
from specjax.distill._stream import ShardFeatures, ShardStream
from specjax.distill._data import (BatchPlan, SequenceSet, TeacherData, feature_states, from_jsonl, generate,
                                   shard_feature_forward, teacher_states)
from specjax.distill._divergence import (DIVERGENCES, divergence, forward_kl, generalized_jsd, masked_mean,
                                         reverse_kl, total_variation)
from specjax.distill._drafts import DraftChoice, build_draft, select_layers
from specjax.distill._heads import (HeadObjective, evaluate_head, head_eval_batch, head_loss, loss_origins,
                                   noisy_features, objective_from_config, with_loss_origins)
from specjax.distill._loop import check_resume_config, fill_shard_features, flatten, train, with_overrides
from specjax.distill._settings import DistillSettings, distill_settings
from specjax.distill._setup import shard_features
from specjax.distill._prepare import eval_plan, feature_file, head_vocabulary, with_features
from specjax.distill._sources import generated_data, second_turn_prompts, spec_bench_prompts
from specjax.distill._train import (LossSpec, TrainState, chain_tokens_per_pass, evaluate, greedy_accepted_per_pass,
                                    init_state,
                                    loss_fn, make_optimizer, make_train_step, merge_params, split_params,
                                    teacher_head)

__all__ = [
    "shards", "Candidate", "build_corpus", "near_duplicates", "template_prefix", "DataConfig", "StageSettings", "data_config", "DATA_STAGES",
    "generate_data", "ShardStream", "ShardFeatures", "shard_features", "shard_feature_forward", "fill_shard_features",
    "BatchPlan", "SequenceSet", "TeacherData", "feature_states", "from_jsonl", "generate", "teacher_states",
    "DIVERGENCES", "divergence", "forward_kl", "generalized_jsd", "masked_mean", "reverse_kl", "total_variation",
    "DraftChoice", "build_draft", "select_layers",
    "head_vocabulary", "HeadObjective", "evaluate_head", "head_eval_batch", "head_loss", "loss_origins",
    "with_loss_origins", "noisy_features", "objective_from_config", "chain_tokens_per_pass", "train", "with_overrides", "flatten", "check_resume_config", "eval_plan",
    "DistillSettings", "distill_settings",
    "feature_file", "with_features", "generated_data", "second_turn_prompts", "spec_bench_prompts",
    "LossSpec", "TrainState", "evaluate", "greedy_accepted_per_pass", "init_state", "loss_fn", "make_optimizer",
    "make_train_step", "merge_params", "split_params", "teacher_head",
]
