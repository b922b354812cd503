"""Train a feature-level draft head for SmolLM2-135M-Instruct (issue 14): configs/distill.py
with ``draft.kind`` a head kind ('eagle3' here; 'eagle' or 'medusa' by override).

Run: python -m specjax.distill --config=configs/distill_head.py --workdir=/tmp/head
     (--config.draft.kind=eagle | medusa for the other heads)

Data: the target's greedy continuation and two temperature-1 continuations of each Spec-Bench
*train* prompt, and its greedy answers to the second turns of the multi-turn (MT-bench)
questions; the held-out split is only evaluated on. The target's features for all of it are
computed once and cached beside the data (``head.feature_cache``). The head reads the target's
features (EAGLE-3: three layers fused; EAGLE / Medusa: the last layer's output), drafts through
the target's embedding and a reduced head over the 8,192 most frequent continuation tokens
(the target's own rows: nothing but the head's layer is stored), and trains with forward KL to
the target's distribution over those tokens, unrolling ``head.ttt_steps`` drafting steps.
"""

import ml_collections

from configs import distill


def get_config():
    c = distill.get_config()
    c.draft.kind = "eagle3"             # 'eagle3' | 'eagle' | 'medusa'
    c.draft.head_vocab = 8192
    c.data.target_weight = 1.0
    c.data.draft_weight = 0.0           # on-policy data is for standalone drafts only
    c.data.sampled_samples = 2          # plus two temperature-1 continuations per train prompt
    c.data.second_turns = True          # plus the greedy answers to the multi-turn questions' second turns
    c.data.tokens_per_batch = 2048      # each step also runs the target forward (features, teacher p)
    c.loss.divergence = "fkl"
    c.head = ml_collections.ConfigDict()
    c.head.ttt_steps = 3                # EAGLE-3 training-time test: drafting steps unrolled (1 for eagle/medusa)
    c.head.feature_weight = 0.0         # EAGLE: weight of the smooth-L1 feature regression (1.0 in the paper)
    c.head.feature_noise = 0.0          # > 0: train on features + U(-a, a) x their RMS (EAGLE's augmentation;
                                        # `specjax.distill.noisy_features`), a = this
    c.head.num_heads = 4                # Medusa heads
    c.head.input_norm = True            # EAGLE kinds (Medusa ignores it): RMS-normalize the embedding and the
                                        # feature before fc (its effect: experiments/heads/results/TRAINING.md)
    c.head.feature_layers = ()          # () = the kind's default (EAGLE-3: low, middle, high; else the last)
    c.head.feature_cache = "float32"    # features computed once per data set, stored beside it ('' = a target
                                        # forward in every step; 'float16' halves the file)
    c.head.compute_dtype = "float32"    # 'bfloat16': the head's forward and backward in bf16 (master weights,
                                        # optimizer, teacher and loss float32)
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 30
    c.budget_tokens = 300_000
    c.checkpoint_every = 100
    c.eval.every = 150
    c.eval.gamma = 5
    return c
