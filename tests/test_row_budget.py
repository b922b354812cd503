"""A gamma per row in one round (`specjax.RowBudget`): the allocation, the settings it refuses,
and greedy equality with target-only decoding on small random Llama models, where the target's
pass really packs the rows' positions (`specjax.models.PackedRows`).

The distribution of sampled row-budget rounds is tested with the other engine configurations
in tests/test_engine_distribution.py (chi-square, with a negative control for the cut).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, models, sampling
from specjax.decoding import AdaptiveGamma, RowBudget


def test_allocate_hands_out_prefixes_by_marginal_gain():
    budget = RowBudget(3, 2.0)                           # 8 slots for 4 rows: 4 proposals
    alpha = jnp.asarray([0.9, 0.2, 0.6, 0.95], jnp.float32)
    active = jnp.asarray([True, True, True, True])
    got = np.asarray(decoding.adaptive.allocate(budget, alpha, active))
    # gains: row 3: .95 .90 .86, row 0: .9 .81 .73, row 2: .6, row 1: .2 -> the 4 largest
    np.testing.assert_array_equal(got, [1, 0, 0, 3])
    assert got.sum() == budget.slots(4) - 4
    # inactive rows get nothing, their share goes to the others (up to gamma each)
    got = np.asarray(decoding.adaptive.allocate(budget, alpha, jnp.asarray([False, True, True, False])))
    np.testing.assert_array_equal(got, [0, 1, 3, 0])             # .6 .36 .216 of row 2, then .2 of row 1
    got = np.asarray(decoding.adaptive.allocate(RowBudget(3, 4.0), alpha, jnp.asarray([True, False, False, False])))
    np.testing.assert_array_equal(got, [3, 0, 0, 0])
    # equal estimates (even a = 1): spread evenly, the lower positions first, then the lower rows
    got = np.asarray(decoding.adaptive.allocate(RowBudget(2, 1.5), jnp.ones((4,)), active))
    np.testing.assert_array_equal(got, [1, 1, 0, 0])


def test_budget_slots_and_pricing():
    assert [RowBudget(3, 2.0).slots(b) for b in (1, 4, 16)] == [2, 8, 32]
    assert RowBudget(4, 1.25).slots(4) == 5 and RowBudget(4, 1.1).slots(4) == 5      # at least one proposal
    assert RowBudget(2, 3.0).slots(3) == 9
    # evenly spread: width 2.5 at a = 0.5 mixes gamma 1 (1.5 tokens) and gamma 2 (1.75)
    np.testing.assert_allclose(float(RowBudget(3, 2.5).expected_tokens(jnp.float32(0.5))), 1.625, rtol=1e-6)
    # priced by rows: the budget's tokens are the allocated rows' sum
    policy = AdaptiveGamma(gammas=(0, 2, RowBudget(2, 2.0)))
    state = decoding.adaptive.init_policy(policy, [[1.0, 1.5, 1.2]])
    alpha_B = jnp.asarray([0.9, 0.1], jnp.float32)
    chosen, _ = decoding.adaptive.choose(policy, state, 0, alpha_B, jnp.asarray([True, True]))
    # gamma 2 for both: (2.71 + 1.11) / 1.5 = 2.55 tokens per unit; the budget gives row 0 both
    # proposals: (2.71 + 1) / 1.2 = 3.09; gamma 0: 2 / 1 = 2
    assert int(chosen) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0, width=1.5), "gamma must be an int >= 1"),
    (dict(gamma=3, width=1.0), r"width .* must be in \(1, gamma \+ 1 = 4\], got 1.0"),
    (dict(gamma=3, width=4.5), r"got 4.5"),
])
def test_bad_budgets_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RowBudget(**kwargs)


def test_budgets_refuse_the_block_verifier_and_a_padded_block():
    budget = AdaptiveGamma(gammas=(0, RowBudget(3, 2.0)))
    with pytest.raises(ValueError, match="exact for token verification only; got verifier='block'"):
        decoding.GenerationConfig(max_new_tokens=4, gamma=budget, verifier="block")
    with pytest.raises(ValueError, match="padded block size"):
        decoding.GenerationConfig(max_new_tokens=4, gamma=budget, block_tokens=-1)
    with pytest.raises(ValueError, match="dynamic tree"):
        AdaptiveGamma(gammas=(0, RowBudget(3, 2.0), "tree"))


TARGET_CFG = models.ModelConfig(vocab_size=61, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                                ffn_size=64, rope_theta=10000.0, rms_eps=1e-5, scan_layers=False)
PROMPTS = [[5, 9, 11], [1, 2, 3, 4, 8, 8, 2], [7], [30, 31, 32, 33, 34]]


def _params(model, seed, scale):
    p = models.canonical_params(model.init_params(jax.random.key(seed)), model.config)
    return model.prepare_params(jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, p))


def test_greedy_budget_rounds_equal_target_only():
    """Rows with different gammas in every round (the draft is the target's first two layers, so
    acceptance is partial and differs by row), packed target passes; float32.
    Near-ties: none can decide a token here (the test asserts the top-2 gap of every reference
    step exceeds 1e-4, far above float32 rounding of these logits)."""
    target = models.Llama(TARGET_CFG)
    tp = _params(target, 0, 4.0)
    dp, draft_cfg = models.truncate_layers(tp, TARGET_CFG, 2)
    draft = models.Llama(draft_cfg)
    greedy = sampling.SamplingConfig.make(0.0)
    policy = AdaptiveGamma(gammas=(RowBudget(3, 2.0), RowBudget(3, 3.0)), initial_alpha=0.7)
    spec_cfg = decoding.GenerationConfig(max_new_tokens=20, gamma=policy)
    ref_cfg = decoding.GenerationConfig(max_new_tokens=20, gamma=0)
    batch = decoding.make_batch(PROMPTS, spec_cfg, jax.random.key(0))
    ref_batch = decoding.make_batch(PROMPTS, ref_cfg, jax.random.key(0))
    spec = decoding.Engine(target, drafters.ModelDrafter(draft), spec_cfg)
    out = spec.run(decoding.EngineParams(target=tp, draft=dp), greedy, batch)
    ref = decoding.Engine(target, None, ref_cfg).run(decoding.EngineParams(target=tp), greedy, ref_batch)
    L_B = np.asarray(batch.prompt_lengths_B)
    got = np.stack([np.asarray(out.tokens_BS)[b, L:L + 20] for b, L in enumerate(L_B)])
    want = np.stack([np.asarray(ref.tokens_BS)[b, L:L + 20] for b, L in enumerate(L_B)])
    np.testing.assert_array_equal(got, want)
    # near-ties: the reference's own logits along its greedy sequence
    forward = jax.jit(lambda p, t: target.apply(p, t, None)[0])
    for b, L in enumerate(L_B):
        full = np.concatenate([np.asarray(PROMPTS[b]), want[b]])[None]
        logits = np.asarray(forward(tp, jnp.asarray(full)))[0, L - 1:-1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-4).all()
    m = out.metrics
    per_round = np.asarray(m.proposed_B) / np.asarray(m.rounds_B)
    assert len(set(np.round(per_round, 3))) > 1, per_round                # the rows' gammas differed
    # the packed passes scored at most the wider budget's slots per round (12 for 4 rows), not
    # the widest row's block (16)
    assert np.asarray(m.scored_B).sum() <= RowBudget(3, 3.0).slots(4) * int(np.asarray(m.rounds_B).max())


class _NoRowsTarget:
    """A target model whose apply takes no ``rows``: it cannot score a packed block."""
    vocab_size = 61

    def init_cache(self, batch_size, capacity):
        return None

    def apply(self, params, tokens_BT, cache, num_valid_B=None, tree=None):
        raise AssertionError("not called")


def test_a_target_without_packed_passes_is_named():
    config = decoding.GenerationConfig(max_new_tokens=4, gamma=AdaptiveGamma(gammas=(0, RowBudget(3, 2.0))))
    with pytest.raises(ValueError, match="the target model _NoRowsTarget takes no rows"):
        decoding.Engine(_NoRowsTarget(), drafters.NGramDrafter(61), config)
    decoding.Engine(_NoRowsTarget(), drafters.NGramDrafter(61), dataclasses.replace(config, gamma=3))     # fine without budgets
