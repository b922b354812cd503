"""Non-finite numbers inside the loop: a broken draft q, NaN target logits under the block
verifier, and NaN K/V left in masked cache slots of a real attention model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from _toy import TabularModel, random_table
from specjax import decoding, drafters, models, sampling

V = 5


@dataclasses.dataclass(frozen=True)
class NaNRowDrafter(drafters.ModelDrafter):
    """A model drafter whose q is NaN for batch row 0 (e.g. a bf16 draft that overflowed)."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, q, state = super().propose(params, state, context, key_B, gamma, cfg)
        return toks, q.at[0].set(jnp.nan), state


def _generate(target, target_params, drafter, draft_params, prompts, key, samp, config, capacity=None):
    batch = decoding.make_batch(prompts, config, key, capacity=capacity)
    engine = decoding.Engine(target, drafter, config)
    return engine.run(decoding.EngineParams(target=target_params, draft=draft_params), samp, batch)


def _setup():
    model = TabularModel(V)
    target = random_table(jax.random.key(0), V)
    draft = target + 0.5 * random_table(jax.random.key(1), V)
    return model, target, draft, [[1, 2, 3], [4, 0], [2]], jax.random.key(2)


def test_nonfinite_draft_q_discards_proposals_and_stays_exact_greedy():
    model, target, draft, prompts, key = _setup()
    greedy = sampling.SamplingConfig.make(0.0)
    ref = _generate(model, target, None, None, prompts, key, greedy, decoding.GenerationConfig(24, gamma=0))
    out = _generate(model, target, NaNRowDrafter(model), draft, prompts, key, greedy,
                    decoding.GenerationConfig(24, gamma=3))
    assert out.generated() == ref.generated()
    m = jax.device_get(out.metrics)
    assert m.invalid_draft_rounds_B[0] == m.rounds_B[0] == 24     # row 0: one token per round
    assert m.accepted_B[0] == 0 and m.proposed_B[0] == 0
    assert m.invalid_draft_rounds_B[1:].sum() == 0 and m.accepted_B[1:].sum() > 0


def test_nonfinite_draft_q_row_samples_inside_target_support():
    model, target, draft, prompts, key = _setup()
    target = target.at[:, :, 4].set(-jnp.inf)          # token 4 has zero target probability
    out = _generate(model, target, NaNRowDrafter(model), draft, prompts, key, sampling.SamplingConfig.make(1.0),
                    decoding.GenerationConfig(40, gamma=3))
    gen = out.generated()
    assert all(t != 4 for row in gen for t in row) and len(gen[0]) == 40
    assert int(out.status_B[0]) == decoding.MAX_TOKENS
    assert not np.isnan(float(out.metrics.summary()["acceptance_rate"]))


def test_block_verifier_never_commits_past_nan_target_logits():
    """Target logits turn NaN after token 3; the draft proposes token 3 and then more.
    Whatever the verifier, nothing from a NaN position may be committed, and every committed
    token must have positive target probability."""
    model = TabularModel(V)
    target = jnp.zeros((V, V, V)).at[:, :, 3].set(2.0).at[:, 3, :].set(jnp.nan)
    target = target.at[:, :, 4].set(-jnp.inf).at[:, 3, :].set(jnp.nan)
    draft = jnp.zeros((V, V, V)).at[:, :, 4].set(0.0)   # uniform draft, proposes token 4 too
    for verifier in ("token", "block"):
        out = _generate(model, target, drafters.ModelDrafter(model), draft, [[0, 1]] * 64, jax.random.key(5),
                        sampling.SamplingConfig.make(1.0), decoding.GenerationConfig(12, gamma=4, verifier=verifier))
        for row, status in zip(out.generated(), np.asarray(out.status_B)):
            assert 4 not in row, (verifier, row)                 # zero target probability
            if 3 in row:                                         # logits after token 3 are NaN
                assert row.index(3) == len(row) - 1 and status == decoding.NAN_LOGITS, (verifier, row)
            else:
                assert status == decoding.MAX_TOKENS


def test_nan_kv_in_rejected_slot_does_not_poison_later_rounds():
    """A rejected draft position whose forward is NaN leaves NaN K/V in a slot past the
    committed length; the next rounds must not read it (masked slots carry zero weight)."""
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, tie_embeddings=False)   # NaN input row only
    model = models.Llama(cfg)
    params = model.init_params(jax.random.key(0))
    bad = 31
    # Token `bad` embeds to NaN: any forward that feeds it yields NaN K/V and logits there.
    params["embed"] = params["embed"].at[bad].set(jnp.nan)
    # Make the target never choose `bad` and the draft always propose it second.
    greedy = sampling.SamplingConfig.make(0.0)
    prompts, key = [[1, 2, 3]], jax.random.key(0)
    ref = _generate(model, params, None, None, prompts, key, greedy, decoding.GenerationConfig(10, gamma=0),
                    capacity=20)
    assert bad not in ref.generated()[0]

    @dataclasses.dataclass(frozen=True)
    class Scripted:
        vocab_size: int = 32
        capabilities = drafters.Capabilities()

        def init(self, *a):
            return ()

        def forward_passes(self, gamma):
            return 0     # no model

        def propose(self, params, state, context, key_B, gamma, cfg):
            lengths_B = context.lengths_B
            nxt = ref.tokens_BS[:, :][jnp.arange(1)[:, None], lengths_B[:, None]]   # the right next token
            toks = jnp.concatenate([nxt, jnp.full((1, gamma - 1), bad, jnp.int32)], axis=1)
            return toks, jax.nn.one_hot(toks, 32), state

        def commit(self, state, new_lengths_B):
            return state

    out = _generate(model, params, Scripted(), None, prompts, key, greedy, decoding.GenerationConfig(10, gamma=3),
                    capacity=20)
    assert out.generated() == ref.generated()
    assert int(out.status_B[0]) == decoding.MAX_TOKENS
