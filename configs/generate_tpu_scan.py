"""The TPU profile before 2026-12-06, kept for comparison (`specjax aot`, the bf16 checks):
bfloat16, layers under `lax.scan` over stacked weights and caches, unfused projections, the
einsum attention op, each target pass its own size.

Run: specjax generate --config=configs/generate_tpu_scan.py
"""

from configs import generate


def get_config():
    c = generate.get_config()
    c.dtype = "bfloat16"
    c.scan_layers = True
    c.fuse_projections = False
    c.cpu_kernel = "off"
    c.attention_op = "reference"
    c.block_tokens = 0
    c.mesh.update(data=1, fsdp=1, model=-1)
    return c
