"""The generation command's GPU profile: the TPU profile with `jax.nn.dot_product_attention` as
the attention op (XLA's fused attention; a registered cuDNN or Pallas op plugs in the same way).

Run: specjax generate --config=configs/generate_gpu.py
"""

from configs import generate_tpu


def get_config():
    c = generate_tpu.get_config()
    c.attention_op = "dot_product"
    return c
