"""`specjax aot`: compile every program of a run for a TPU topology, on this machine, no TPU needed.

Run: specjax aot --config=configs/aot.py [--config.topology=v6e:2x4 --config.target=qwen3-8b]

Needs libtpu (pip install -e '.[tpu]', or the test extra). One JSON line per program on stdout
(memory by kind, FLOPs, HBM bytes per call, the ideal bytes, a predicted time, collectives, the
HLO lint), a summary line each on stderr; `out` appends the rows to a JSONL file.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    # a TPU slice <chip>:<grid>, chip one of v4, v5e, v5p, v6e (libtpu's topology names), e.g.
    # v5p:2x2x1; or one GPU host h100:N / h200:N (needs JAX's CUDA plugin and gpu_target_config)
    c.topology = "v5e:2x2"
    # GPU topologies: the GPU's target description, a GpuTargetConfigProto text file (XLA keeps
    # them as xla/backends/gpu/target_config/specs/*.txtpb)
    c.gpu_target_config = ""
    # a preset (specjax.aot.PRESETS: llama-3.2-1b, llama-3.1-8b, qwen3-8b, mixtral-8x7b,
    # gemma-3-12b, tiny) or a config.json path; shapes only, no weights are read
    c.target = "llama-3.1-8b"
    # the generation profile whose layout (dtype, scan_layers, fuse_projections, attention_op)
    # and mesh the programs use
    c.profile = "configs/generate_tpu.py"
    c.profile_name = ""                     # the name rows report ("" = the profile's path)
    # mesh axes overriding the profile's (0 = keep the profile's; -1 = the devices left)
    c.mesh = ml_collections.ConfigDict(dict(data=0, fsdp=0, model=0))
    # prefill, decode (target-only step), verify (the target's k-token block, each of
    # verify_ks), chain (a speculative round, gamma tokens from an EAGLE-3-shaped head), tree (a
    # round over a dynamic tree from the same head), train_head, train_draft
    c.programs = ("prefill", "decode", "verify", "chain", "tree", "train_head", "train_draft")
    c.batch_sizes = (1,)
    c.context = 1024                        # committed tokens per row at the compiled decode step
    c.capacity = 2048                       # cache slots per row
    c.prompt = 512                          # prefill's prompt tokens per row
    c.verify_ks = (1, 2, 3, 4, 5, 6, 7, 8)
    c.gamma = 3
    c.tree = (5, 4, 20)                     # dynamic tree: depth, top-k per node, node budget
    c.ordered_tail = False                  # the target as a tree run sets it up (ModelConfig.ordered_tail)
    c.train_batch = 4                       # training steps: rows x tokens
    c.train_seq = 1024
    c.draft_layers = 2                      # train_draft: a draft with the target's shapes and this many layers
    c.out = ""                              # append every row to this JSONL file ("" = stdout only)
    return c
