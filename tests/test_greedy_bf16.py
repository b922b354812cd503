"""The engine's one block shape (`GenerationConfig.block_tokens=-1`, the accelerator profiles'
setting) end to end in bfloat16: greedy speculative output equal to target-only greedy token for
token, the target-only run in the same block shape (`Generator.target_only`), on a model small
enough to run in CI. (On SmolLM2's real weights the engine does not have this yet:
experiments/greedy_exactness, variant bf16.)

A tiny random Gemma 2 (soft-caps, sliding windows, sandwich norms) in bfloat16 with weights large enough that
rounding matters; the draft is the target's first layer (early exit), which agrees with the
target often but not always, so rounds accept some tokens and reject others. Chains (gamma 3)
and a static tree, at batch 1 and at batch 3 with prompts of different lengths: every generated
token equal to the target-only run's (`Generator.target_only` keeps the block shape), with no
tolerance and no near-tie rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, models, sampling, trees

from test_block_step_bitwise import _config

PROMPTS = [[5, 17, 3, 9, 44, 2, 7], [8, 1], [60, 61, 62, 63, 64, 3, 19, 20, 5, 5, 11]]
GREEDY = sampling.SamplingConfig.make(0.0)


def _target(kind: str):
    model = models.Llama(_config(kind))
    params = model.init_params(jax.random.key(11))
    params = jax.tree.map(lambda x: (x.astype(jnp.float32) * (1.0 if x.ndim == 1 else 8.0)).astype(x.dtype), params)
    return model, params


@pytest.mark.parametrize("gamma", [3, trees.TreeShape.from_branching((2, 2, 1))], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["gemma2"])
def test_greedy_speculative_equals_target_only_in_bf16(kind, gamma):
    model, params = _target(kind)
    drafter, draft_params = drafters.EarlyExitDrafter.from_target(model, params, 1)
    config = decoding.GenerationConfig(max_new_tokens=24, gamma=gamma, block_tokens=-1,
                                       tree_children="deterministic" if not isinstance(gamma, int) else "iid")
    gen = decoding.Generator(decoding.Engine(model, drafter, config),
                             decoding.EngineParams(target=params, draft=draft_params), None)
    accepted = 0
    for prompts in (PROMPTS[:1], PROMPTS):
        batch = gen.batch(prompts, jax.random.key(0), chat=False)
        spec = jax.device_get(gen.run(batch, GREEDY))
        ref = jax.device_get(gen.target_only().run(batch, GREEDY))
        assert spec.generated() == ref.generated(), f"{kind} {gamma} batch {len(prompts)}"
        accepted += int(np.sum(spec.metrics.accepted_B))
        assert int(np.sum(spec.metrics.accepted_B)) < int(np.sum(spec.metrics.proposed_B))   # some rejected
    assert accepted > 0
