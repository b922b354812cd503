"""The generation command's GPU profile: the TPU profile (bfloat16, unrolled per-layer weights
and caches, XLA's matmuls, the einsum attention op, one block shape for every target pass) with
fused projections (q|k|v and gate|up as one matmul each), every device on the mesh's model axis.

Compiled for an H100 without a GPU (`specjax aot`, experiments/aot), the scanned decode step of
the profile before this one copied each layer's slice of the stacked weights before its
matmuls, and `jax.nn.dot_product_attention` (attention_op 'dot_product') transposed and
concatenated the cache in every layer. Fused projections read the same bytes in two matmuls
instead of five on one GPU; over a model axis of several GPUs they cost collective permutes
(configs/generate_tpu.py), so set fuse_projections=False there. configs/generate_gpu_scan.py is
the profile before this one, kept for comparison.

Run: specjax generate --config=configs/generate_gpu.py
"""

from configs import generate_tpu


def get_config():
    c = generate_tpu.get_config()
    c.fuse_projections = True
    return c
