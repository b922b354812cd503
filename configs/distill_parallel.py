"""Train the parallel block drafter for SmolLM2-135M-Instruct (issue 55): configs/distill_head.py
with ``draft.kind = 'parallel'``: EAGLE-3's layer over the fused low / middle / high features
with input norms, plus ``head.num_heads - 1`` placeholder inputs, so one forward drafts a block
of ``head.num_heads`` tokens (`specjax.drafters.heads._parallel`). Every block position is
trained at once (the loss averages them), like a training-time test of that many steps.

Run: python -m specjax.distill --config=configs/distill_parallel.py --workdir=/tmp/parallel
Draft with it: specjax generate --config=configs/generate.py --config.drafter=parallel \\
    --config.draft_model=<the export directory> --config.gamma=4
"""

from configs import distill_head


def get_config():
    c = distill_head.get_config()
    c.draft.kind = "parallel"
    c.head.ttt_steps = 1                # the block is drafted at once (no autoregressive unroll)
    c.head.num_heads = 4                # block size: the most tokens one round drafts
    c.head.input_norm = True
    c.eval.gamma = 4
    return c
