"""Engine metrics: the counters obey their identities and the summary aggregates them."""

import jax
import numpy as np

from _toy import TabularModel, random_table
from specjax import decoding, drafters, sampling


def test_metric_identities_and_summary():
    V = 5
    model = TabularModel(V)
    target = random_table(jax.random.key(0), V)
    draft = target + 0.8 * random_table(jax.random.key(1), V)
    cfg = decoding.GenerationConfig(max_new_tokens=40, gamma=3)
    batch = decoding.make_batch([[1, 2, 3], [4], [0, 1, 2, 3]], cfg, jax.random.key(2))
    engine = decoding.Engine(model, drafters.ModelDrafter(model), cfg)
    out = engine.run(decoding.EngineParams(target=target, draft=draft), sampling.SamplingConfig.make(1.0), batch)
    m = jax.device_get(out.metrics)
    generated = np.asarray(out.lengths_B - out.prompt_lengths_B)
    np.testing.assert_array_equal(m.committed_B, generated)
    np.testing.assert_array_equal(m.proposed_B, 3 * m.rounds_B)
    np.testing.assert_array_equal(m.draft_passes_B, 3 * m.rounds_B)
    # every round commits accepted + 1 tokens, except a final round cut by max_new_tokens
    assert np.all(m.committed_B <= m.accepted_B + m.rounds_B)
    assert np.all(m.committed_B >= m.accepted_B + m.rounds_B - 3)
    np.testing.assert_array_equal(m.accepted_at_BG.sum(1), m.accepted_B)
    np.testing.assert_array_equal(m.tested_at_BG[:, 0], m.rounds_B)       # position 0 is always tested
    assert np.all(m.tested_at_BG[:, 1:] == m.accepted_at_BG[:, :-1])       # j reached iff j-1 accepted
    s = out.metrics.summary()
    assert s["committed"] == int(generated.sum()) and s["wasted"] == s["proposed"] - s["accepted"]
    assert abs(s["mean_accepted_tokens_per_pass"] - generated.sum() / m.rounds_B.sum()) < 1e-9
    assert 0.0 < s["acceptance_rate"] < 1.0 and len(s["acceptance_per_position"]) == 3
    assert s["rounds_per_gamma"] == [int(m.rounds_B.max())]
