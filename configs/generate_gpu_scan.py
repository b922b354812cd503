"""The GPU profile before 2026-12-06, kept for comparison (`specjax aot`, the GPU workload): the
old TPU profile (layers under `lax.scan`) with `jax.nn.dot_product_attention` as the attention op.

Run: specjax generate --config=configs/generate_gpu_scan.py
"""

from configs import generate_tpu_scan


def get_config():
    c = generate_tpu_scan.get_config()
    c.attention_op = "dot_product"
    return c
