"""specjax: lossless speculative decoding and draft distillation in JAX/Flax.

Floors (a module imports only from floors below it):

    cli.py, build.py, experiments/      what users run
    serving/   distill/   bench.py      slot-refilling scheduler; trainer; benchmarks
    decoding/                           the engine object and the one request path
    drafters/   verify/                 who proposes; exact acceptance / residual sampling
    models/                             one decoder for every family, KV cache, attention ops, loaders, tokenizer
    sampling.py  analysis.py  sharding.py  specbench.py  trees.py  reporting.py     primitives
    kernels/                            CPU custom calls through XLA's FFI (panel matmul)
"""

from specjax import analysis, decoding, drafters, models, sampling, specbench, trees, verify
from specjax.decoding import AdaptiveGamma, Engine, EngineParams, GenerationConfig, Generator, make_batch
from specjax.sampling import SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "analysis", "decoding", "drafters", "models", "sampling", "specbench", "trees", "verify",
    "AdaptiveGamma", "Engine", "EngineParams", "GenerationConfig", "Generator", "SamplingConfig", "make_batch",
]
