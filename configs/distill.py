"""Distill a 3-layer, reduced-vocabulary draft for SmolLM2-135M-Instruct (the shipped recipe).

Run: python -m specjax.distill --config=configs/distill.py --workdir=/tmp/distill
(or experiments/distill/run.py, which also evaluates and exports). Data, all from prompts of
the Spec-Bench *train* split (question_id % 4 != 0; the held-out split is only evaluated on):
the target's greedy continuations of prompts up to 512 tokens (80% of the batches) and the
draft's own temperature-1 continuations of prompts up to 384 tokens, regenerated from the
current draft every 150 steps (30%, on-policy, as DistillSpec recommends). Generalized JSD
(beta = 0.5): the best of the four divergences in the comparison of experiments/distill/results/.

Budget: 1M loss tokens (the time it takes: experiments/distill/results/). The target's
temperature-1 samples are off (sampled_samples = 0) to keep target generation short, so its
greedy continuations are the only target-generated set; the on-policy refreshes add fresh data
throughout.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.target = "smollm2-135m-instruct"
    c.dtype = "float32"
    c.seed = 0
    c.data_root = ""                    # cache of generated data + teacher states; "" = ~/.cache/specjax/distill

    c.data = ml_collections.ConfigDict()
    c.data.greedy_samples = 1           # target greedy continuations per train prompt
    c.data.sampled_samples = 0          # target temperature-1 continuations per train prompt
    c.data.temperature = 1.0
    c.data.second_turns = False         # + greedy answers to MT-bench second turns (after the greedy first answer)
    c.data.max_new_tokens = 256
    c.data.gen_batch_size = 32
    c.data.widths = (256, 512, 1024)    # sequence buckets (longer sequences are cut)
    c.data.tokens_per_batch = 4096      # batch rows = tokens_per_batch // width
    c.data.max_prompt_tokens = 512      # train on sequences with prompts up to this (longer: mostly context)
    c.data.per_category = 0             # > 0: only the first n such train prompts of each Spec-Bench category
    c.data.fixed_jsonl = ""             # optional teacher-forced data set (see specjax.distill.from_jsonl)
    # Mixture weights of the sources (batches drawn per step with these probabilities).
    c.data.target_weight = 0.7
    c.data.fixed_weight = 0.0
    c.data.draft_weight = 0.3           # on-policy: the current draft's own continuations
    c.data.draft_refresh_every = 150    # steps between on-policy refreshes
    c.data.draft_prompts = 64           # train prompts per refresh
    c.data.draft_max_prompt_tokens = 384  # on-policy prompts: the shorter ones (teacher cost grows with length)
    c.data.draft_max_new_tokens = 128
    # Streamed data-engine shards (`specjax data`; feature heads only): read from disk in a seeded
    # order, a window of shards at a time (specjax.distill.ShardStream); the target's features
    # are computed in each step.
    c.data.shards = ml_collections.ConfigDict()
    c.data.shards.dirs = ()             # shard directories, e.g. ("WORKDIR/responses_greedy", "WORKDIR/responses_sampled")
    c.data.shards.weight = 0.0          # mixture weight of the streamed shards
    c.data.shards.window = 8            # shards shuffled together (at most this many held decoded)
    c.data.shards.max_loss_tokens = 0   # > 0: only the first N loss tokens of the shards' canonical order
    c.data.shards.group_by_length = False  # batch answers of similar length together (a head's later drafting
    #                                       steps then run at fewer origins past the answers)

    c.draft = ml_collections.ConfigDict()
    c.draft.kind = "target_layers"      # 'target_layers' (init from the target's layers) or 'fresh'
    c.draft.layers = (0, 1, 2)          # target layers the draft starts from
    c.draft.num_layers = 2              # fresh: a small random config of the target's width
    c.draft.ffn_size = 1536
    c.draft.head_vocab = 8192           # >0: head over the most frequent tokens only (q = 0 elsewhere)
    c.draft.head_vocab_coverage = 0.0   # >0: the fewest most frequent tokens covering this share of the
                                        # training continuations (head_vocab caps it; 0: no cap)
    c.draft.train_head = False          # False: the head is the target's embedding rows (shared, not stored)

    c.loss = ml_collections.ConfigDict()
    c.loss.divergence = "jsd"           # fkl | rkl | jsd | tvd
    c.loss.beta = 0.5                   # generalized JSD weight
    c.loss.temperature = 1.0

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 50
    c.optim.end_lr_fraction = 0.1       # cosine decay to this fraction of the peak
    c.optim.clip_norm = 1.0             # max global gradient norm; 0 = no clipping (< 0 is an error)
    c.optim.weight_decay = 0.0
    c.optim.accumulate = 1              # micro-batches per optimizer update
    c.optim.on_nonfinite = "stop"       # a step with a non-finite loss, gradient norm or parameters: 'stop'
                                        # (error naming the step; nothing non-finite is saved or exported)
                                        # or 'skip' (keep the previous parameters, count it in skipped_steps)

    c.budget_tokens = 1_000_000         # loss tokens to train on
    c.checkpoint_every = 50             # steps
    c.keep_checkpoints = 3
    c.async_checkpoints = True

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 200                  # steps (and at the end)
    c.eval.per_category = 4             # held-out prompts per Spec-Bench category
    c.eval.max_prompt_tokens = 0        # > 0: only held-out prompts of at most this many tokens
    c.eval.max_new_tokens = 128
    c.eval.gamma = 4
    c.eval.data_jsonl = ""              # "" = held-out Spec-Bench greedy continuations; else a fixed JSONL set
    c.eval.at_start = True

    # Device mesh, used when the job has more than one device (across processes too): the global
    # batch over data x fsdp, parameters and optimizer state FSDP over fsdp, tensor parallel over
    # model; -1 = the devices the other axes leave (specjax.sharding.mesh_from_config).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1))
    c.distributed = False               # start jax.distributed first (multi-host; see launch/README.md)

    c.export_dir = ""                   # write the draft artifact here at the end ("" = skip)
    c.export_dtype = "bfloat16"
    c.progress = True
    # Steps the host lets the device run ahead before reading a step's metrics: 1 = the next
    # step is dispatched before this one's loss comes back; 0 = read every step at once.
    c.metrics_lag = 1
    # A resume whose seed or data settings (batch size, buckets, shard window, mixture, data sets)
    # differ from the workdir's config.json is refused: its batches would not be the run's. True:
    # continue in the new order; the changes (old -> new) go into metrics.jsonl as an event.
    c.allow_data_order_change = False
    return c
