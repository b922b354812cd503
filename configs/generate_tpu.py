"""The generation command's TPU profile: bfloat16 weights and cache, unrolled layers over
per-layer weights and caches, separate q, k, v, gate and up projections, XLA's matmuls (no CPU
kernel), the einsum attention op, the block's K/V written before it attends
(`write_then_attend`), one block shape for every target pass (`block_tokens=-1`), every bfloat16
result rounded as written (`strict_precision`), every device on the mesh's model axis (rows over
data when set).

Why these: compiled without a TPU (`specjax aot`, experiments/aot), the unrolled step reads the
bytes the scanned one reads on v5e, v5p and v6e, and on an H100 the scanned step copies every
layer's weights first; with one block shape and write-then-attend a verification block's rows
are the decode step's computation, bit for bit (tests/test_block_step_bitwise.py), so greedy
speculation with a chain drafter reproduces target-only greedy in bfloat16 (token trees not yet:
experiments/greedy_exactness/README.md, "bfloat16").
Fused q|k|v over a model axis of several chips needs collective
permutes to split the heads again (experiments/aot/README.md), so the projections stay separate
here. configs/generate_tpu_scan.py is the profile before this one.

Run: specjax generate --config=configs/generate_tpu.py [--config.mesh.data=N]
"""

from configs import generate


def get_config():
    c = generate.get_config()
    c.dtype = "bfloat16"
    c.scan_layers = False
    c.fuse_projections = False
    c.cpu_kernel = "off"
    c.attention_op = "reference"
    c.block_tokens = -1
    c.write_then_attend = True
    c.strict_precision = True
    c.mesh.update(data=1, fsdp=1, model=-1)
    return c
