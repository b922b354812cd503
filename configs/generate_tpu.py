"""The generation command's TPU profile: bfloat16 weights and cache, unrolled layers over
per-layer weights and caches, fused projections (q|k|v and gate|up as one matmul each), XLA's
matmuls (no CPU kernel), the einsum attention op, one block shape for every target pass
(`block_tokens=-1`), every device on the mesh's model axis (rows over data when set).

Why these: compiled without a TPU (`specjax aot`, experiments/aot), the unrolled step reads the
same bytes as the scanned one on v5e, v5p and v6e, and on an H100 the scanned step copies every
layer's weights first; with one block shape a verification block's rows are the decode step's
computation, bit for bit (tests/test_block_step_bitwise.py), so greedy speculative output is
target-only's in bfloat16. configs/generate_tpu_scan.py is the profile before this one.

Run: specjax generate --config=configs/generate_tpu.py [--config.mesh.data=N]
"""

from configs import generate


def get_config():
    c = generate.get_config()
    c.dtype = "bfloat16"
    c.scan_layers = False
    c.fuse_projections = True
    c.cpu_kernel = "off"
    c.attention_op = "reference"
    c.block_tokens = -1
    c.mesh.update(data=1, fsdp=1, model=-1)
    return c
