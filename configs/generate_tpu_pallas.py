"""The TPU profile (configs/generate_tpu.py) with attention by the Pallas kernel
(`attention_op='pallas'`, `specjax.kernels.cache_attention`): every target pass attends over
the written cache in place, reading slot blocks only up to each row's live length, and token
trees take the same kernel with their visibility. On CPU the kernel runs in Pallas interpret
mode (slow; for checking), on a GPU the reference op runs instead.

Run: specjax generate --config=configs/generate_tpu_pallas.py
"""

from configs import generate_tpu


def get_config():
    c = generate_tpu.get_config()
    c.attention_op = "pallas"
    return c
