"""The generation command's CPU profile, named: configs/generate.py as it is (float32, unrolled
layers over per-layer params, fused projections, specjax's CPU kernel where it was built).

Run: specjax generate --config=configs/generate_cpu.py
"""

from configs import generate


def get_config():
    return generate.get_config()
