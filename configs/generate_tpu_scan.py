"""The TPU profile before 2026-12-06, kept for comparison (`specjax aot`, the bf16 checks): the
TPU profile with layers under `lax.scan` over stacked weights and caches, each target pass its
own size, attending before it writes the cache, XLA free to keep excess precision.

Run: specjax generate --config=configs/generate_tpu_scan.py
"""

from configs import generate_tpu


def get_config():
    c = generate_tpu.get_config()
    c.scan_layers = True
    c.block_tokens = 0
    c.write_then_attend = False
    c.strict_precision = False
    return c
