"""The generation command's TPU profile: bfloat16 weights and cache, layers under `lax.scan`
(one compiled layer), XLA's matmuls (no CPU kernel), the einsum attention op, every device on
the mesh's model axis (rows over data when set).

Run: specjax generate --config=configs/generate_tpu.py [--config.mesh.data=N]
"""

from configs import generate


def get_config():
    c = generate.get_config()
    c.dtype = "bfloat16"
    c.scan_layers = True
    c.fuse_projections = False
    c.cpu_kernel = "off"
    c.attention_op = "reference"
    c.mesh.update(data=1, fsdp=1, model=-1)
    return c
