"""The generation command's GPU profile: bfloat16 weights and cache, unrolled layers over
per-layer weights and caches, fused projections (q|k|v and gate|up as one matmul each), XLA's
matmuls (no CPU kernel), the einsum attention op, every device on the mesh's model axis.

Why not the TPU profile's `lax.scan`: compiled for an H100 without a GPU (experiments/aot), the
scanned decode step copies each layer's slice of the stacked weights before its matmuls; the
unrolled one reads each weight in place. `jax.nn.dot_product_attention` (attention_op
'dot_product') transposes and concatenates every layer's cache there, so the einsum op stays.
configs/generate_gpu_scan.py is the profile before this one, kept for comparison.

Run: specjax generate --config=configs/generate_gpu.py
"""

from configs import generate_tpu


def get_config():
    c = generate_tpu.get_config()
    c.scan_layers = False
    c.fuse_projections = True
    return c
