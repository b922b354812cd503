"""specjax: lossless speculative decoding and draft distillation in JAX/Flax.

Floors: a module imports only from its own floor or the floors below it (the numbers are
tests/test_layering.py's, which checks the imports from the source; experiments/ and tests/ use
only public names):

    6  cli.py            the command line: each command's config typed once
       config_files.py   a command's config file, with every drafter kind's keys
    5  distill/          trainer and data engine
       serving/          the slot-refilling scheduler
       aot/              every program compiled for a TPU topology or GPU host, deviceless
       bench.py  generate.py  tools.py      the commands on their typed settings (bench, generate,
                                            eval, export, data)
    4  build/            typed settings -> the target, the drafter, the engine
    3  decoding/         the engine object and the one request path
    2  drafters/         who proposes
       verify/           exact acceptance / residual sampling
       sharding.py       logical axes -> mesh axes; params and caches placed on a mesh
    1  models/           one decoder for every family, KV cache, attention ops, loaders, tokenizer
    0  kernels/          CPU custom calls through XLA's FFI (panel matmul, decode attention)
       sampling.py  analysis.py  trees.py  calibration.py  checkpoint.py  files.py
       distributed.py  specbench.py  reporting.py  settings.py  constraints.py   primitives

Shape suffixes. An array's name ends in its axes, one capital letter each (``q_BGV``: batch,
drafted tokens, vocabulary), with one meaning per letter throughout the package:

    B  batch rows                        T  positions of one model call (query block)
    S  cache slots: the capacity of every per-row buffer (KV cache, tokens, features)
    P  prompt width (padded)             V  vocabulary
    U  rows of a draft vocabulary (a reduced head's tokens, a subset of V)
    D  model width                       F  feature width (the chosen layers' features side by side)
    I  MLP width                         H  attention head dim
    Q  query heads                       K  KV heads
    L  layers                            E  experts
    M  rows of a flattened matmul (B T)  W  columns a tree call sees besides its own (window)
    G  tokens drafted per round (gamma)  C  a round's committed block (max gamma + 1)
    N  nodes of a draft tree             A  positions along an accepted path (the tree's depth)
    O  candidate nodes of a dynamic tree's expansion pool
    J  drafting steps of a head          R  regimes of the adaptive policy (draft sources)
    Z  the adaptive policy's candidate gammas
    X  any further axes

A digit after a letter adds to it (``p_BG1V``: G + 1 distributions; ``q_BN1V``: the root and N
nodes); a digit alone is a literal size (``keys_B2``); a lowercase letter is a count named in
the code (``experts_Mk``: k experts per token).
"""

from specjax import analysis, decoding, drafters, models, sampling, specbench, trees, verify
from specjax.decoding import AdaptiveGamma, Engine, EngineParams, GenerationConfig, Generator, RowBudget, make_batch
from specjax.sampling import SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "analysis", "decoding", "drafters", "models", "sampling", "specbench", "trees", "verify",
    "AdaptiveGamma", "Engine", "EngineParams", "GenerationConfig", "Generator", "RowBudget", "SamplingConfig",
    "make_batch",
]
