"""The generation command's GPU profile: the TPU profile's layout (bfloat16, unrolled per-layer
weights and caches, fused projections, XLA's matmuls, the einsum attention op, one block shape
for every target pass), every device on the mesh's model axis.

Compiled for an H100 without a GPU (`specjax aot`, experiments/aot), the scanned decode step of
the profile before this one copied each layer's slice of the stacked weights before its
matmuls (2.98x the ideal bytes against 1.02x unrolled), and `jax.nn.dot_product_attention`
(attention_op 'dot_product') transposed and concatenated the cache in every layer.
configs/generate_gpu_scan.py is that profile, kept for comparison.

Run: specjax generate --config=configs/generate_gpu.py
"""

from configs import generate_tpu


def get_config():
    return generate_tpu.get_config()
