"""End-to-end distribution exactness of `Engine.run` (chi-square, Bonferroni).

Setup: V = 3, a peaked prefix-dependent `TabularModel` target and a perturbed draft table
(per-token rejection rate ~0.2-0.6; ~0.8 for the n-gram drafter). Every configuration generates N = 6 new tokens (N >
gamma + 1, so every sequence spans several rounds, including the catch-up round after a fully
accepted one) for B = 40 000 independent rows (one key per row: `make_batch` folds request ids
0..B-1 into the seed; all rows share the prompt), in ONE batched call. The empirical law of the
whole N-token continuation (3^6 = 729 cells) is compared with the exact target-only law (`sequence_probs` with
`sampling.probabilities` under the same `SamplingConfig`) by a chi-square goodness-of-fit test
(cells with expected count < 5 are pooled; cells of exact probability 0 must stay empty).

Statistical family: the FAMILY_SIZE configurations that must pass (listed in EXACT_CASES and
DRAFT_STATE_BUG_CASES); family-wise false-alarm rate FAMILY_WISE_ALPHA = 1e-4, so each test
uses PER_TEST_ALPHA = 1e-4 / FAMILY_SIZE (Bonferroni). All seeds are fixed, so the outcome is
deterministic.

Negative controls (must FAIL the same test, p < PER_TEST_ALPHA, proving power):
  * a drafter that samples at temperature T/2 but reports the temperature-T q;
  * a drafter that samples from q but reports a sharpened q (q^2, renormalised);
  * a target whose cache ignores the engine's rollback (keeps rejected draft tokens).

Draft-side state bugs (a drafter whose `commit` skips the rollback; a drafter without the
catch-up after a fully accepted round) can NOT bias the output: the drafter still reports the
q it actually sampled from, and speculative sampling is exact for any such q. They are
therefore tested as members of the must-pass family, together with a check that they really
are broken (their acceptance rate is much lower than the correct drafter's on the same keys).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax import decoding, drafters, models, sampling

from _tabular import support_chisquare
from _toy import TabularModel, ToyCache, random_table, sequence_probs

V = 3
N_NEW = 6
BATCH = 40_000
PROMPT = (2, 1)
FAMILY_WISE_ALPHA = 1e-4


# ----------------------------------------------------------------------------- broken variants

@dataclasses.dataclass(frozen=True)
class NoRollbackDrafter(drafters.ModelDrafter):
    """BROKEN (draft side): `commit` keeps the draft cache as it is (rejected drafts stay).
    The cache is allocated 8x larger so the growing write pointer never overflows."""

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return super().init(params, prompt_BP, prompt_lengths_B, 8 * capacity)

    def commit(self, state, new_lengths_B):
        return state


@dataclasses.dataclass(frozen=True)
class NoCatchUpDrafter(drafters.ModelDrafter):
    """BROKEN (draft side): ingests only the last committed token, never the 2 unseen tokens
    left after a fully accepted round (it writes tokens[L-1] at the cache slot of L-2)."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        tokens_BS, lengths_B = context.tokens_BS, context.lengths_B
        seen_B = state.cache.lengths_B
        last_B = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)[:, 0]
        rows = jnp.arange(tokens_BS.shape[0])
        fake_BL = tokens_BS.at[rows, seen_B].set(last_B)
        return super().propose(params, state, context.replace(tokens_BS=fake_BL, lengths_B=seen_B + 1),
                               key_B, gamma, cfg)


@dataclasses.dataclass(frozen=True)
class MisreportingDrafter(drafters.ModelDrafter):
    """BROKEN: the reported q is not the distribution the token was drawn from.

    mode 'temperature': samples at temperature T/2, reports the temperature-T q (without
      filters, softmax(l/T) is proportional to softmax(l/(T/2))^(1/2)).
    mode 'sharpened': samples from q, reports q^2 renormalised.
    """
    mode: str = "temperature"

    def propose(self, params, state, context, key_B, gamma, cfg):
        if self.mode == "temperature":
            cfg_half = cfg.replace(temperature=cfg.temperature / 2)
            toks, q_sampled, st = super().propose(params, state, context, key_B, gamma, cfg_half)
            q_rep = jnp.sqrt(q_sampled)
        else:
            toks, q_sampled, st = super().propose(params, state, context, key_B, gamma, cfg)
            q_rep = q_sampled ** 2
        return toks, q_rep / q_rep.sum(-1, keepdims=True), st


@struct.dataclass
class PtrCache:
    hist_BS: jax.Array
    lengths_B: jax.Array
    ptr_B: jax.Array     # where the model really writes; the engine only rolls back lengths_B

    def truncate(self, max_lengths_B):
        """The engine's rollback: lengths only, the write pointer stays (the bug)."""
        return self.replace(lengths_B=jnp.minimum(self.lengths_B, max_lengths_B))


@dataclasses.dataclass(frozen=True)
class NoRollbackTarget(TabularModel):
    """BROKEN (target side): its cache ignores the engine's rollback, so rejected draft tokens
    stay in the history the next round conditions on (8x capacity: no overflow)."""

    def init_cache(self, batch_size, capacity):
        z = jnp.zeros((batch_size,), jnp.int32)
        return PtrCache(jnp.zeros((batch_size, 8 * capacity), jnp.int32), z, z)

    def apply(self, table_VVV, tokens_BT, cache, num_valid_B=None):
        if cache is None:
            return super().apply(table_VVV, tokens_BT, None)
        logits, new = super().apply(table_VVV, tokens_BT, ToyCache(cache.hist_BS, cache.ptr_B), num_valid_B)
        return logits, PtrCache(new.hist_BS, new.lengths_B, new.lengths_B)


@dataclasses.dataclass(frozen=True)
class OwnProgramDrafter(drafters.ModelDrafter):
    """The model drafter under a class of its own, so an engine holding it compiles its own
    program: the broken packing below is traced into that one, not into the exact cases' program."""


def _leading_one_short(counts_B, width, size):
    """BROKEN `models.PackedRows.leading`: each row's last used position (its cut) left out."""
    return _LEADING(jnp.maximum(jnp.asarray(counts_B) - 1, 1), width, size)


_LEADING = models.PackedRows.leading


# ----------------------------------------------------------------------------- configurations

def _gen(gamma, verifier="token"):
    return decoding.GenerationConfig(max_new_tokens=N_NEW, gamma=gamma, verifier=verifier)


T1 = dict(temperature=1.0)
TOPK = dict(temperature=0.7, top_k=2)
TOPP = dict(temperature=0.7, top_p=0.8)
BUDGET = decoding.AdaptiveGamma(gammas=(decoding.RowBudget(3, 2.0),))

# name -> (sampling kwargs, GenerationConfig or None for target-only, drafter kind). Each verifier
# at gamma 1 and 3, each at T = 1 and under a filter: a verifier at gamma 1 runs under a filter only
# (its T = 1 case added a compiled engine and no path: gamma 3 has T = 1, and neither verifier's
# code depends on the sampling settings, which reach it as p and q).
EXACT_CASES = {
    "target_only_T1": (T1, None, None),
    "token_g3_T1": (T1, _gen(3), "model"),
    "block_g3_T1": (T1, _gen(3, "block"), "model"),
    "token_g3_topk2_T0.7": (TOPK, _gen(3), "model"),
    "block_g1_topk2_T0.7": (TOPK, _gen(1, "block"), "model"),
    "token_g1_topp0.8_T0.7": (TOPP, _gen(1), "model"),
    "block_g3_topp0.8_T0.7": (TOPP, _gen(3, "block"), "model"),
    "ngram_token_g3_T1": (T1, _gen(3), "ngram"),
    # a gamma per row: two proposals per row on average, handed to the rows by their estimates
    "budget_g3_w2_T1": (T1, _gen(BUDGET), "model"),
    "budget_g3_w2_topk2_T0.7": (TOPK, _gen(BUDGET), "model"),
}
DRAFT_STATE_BUG_CASES = {
    "draft_commit_skips_rollback": (T1, _gen(3), "no_rollback_drafter"),
    "draft_without_catch_up": (T1, _gen(3), "no_catch_up_drafter"),
}
NEGATIVE_CASES = {
    "q_reported_at_T_sampled_at_T/2": (T1, _gen(3), "misreport_temperature"),
    "q_reported_sharpened": (T1, _gen(3), "misreport_sharpened"),
    "target_cache_ignores_rollback": (T1, _gen(3), "no_rollback_target"),
    # a row budget whose packed target pass leaves out each row's cut position, so the row's
    # token there comes from the uniform law of an uncomputed position
    "budget_packs_one_position_short": (T1, _gen(BUDGET), "budget_one_short"),
}
FAMILY_SIZE = len(EXACT_CASES) + len(DRAFT_STATE_BUG_CASES)
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / FAMILY_SIZE


@pytest.fixture(scope="module")
def setup():
    target_table = random_table(jax.random.key(10), V, peak=2.0)
    draft_table = target_table + random_table(jax.random.key(11), V, peak=1.0)
    return dict(target_table=target_table, draft_table=draft_table, batches={}, runs={})


def _batch(setup, config):
    """BATCH copies of PROMPT, request ids 0..BATCH-1 (one key each), default capacity for `config`."""
    capacity = config.slots_needed(len(PROMPT))
    if capacity not in setup["batches"]:
        setup["batches"][capacity] = decoding.make_batch([list(PROMPT)] * BATCH, config, jax.random.key(2024))
    return setup["batches"][capacity]


def _run(setup, name, case):
    """Generate (memoised per module): returns (generated [B, N] int, rejection rate)."""
    if name in setup["runs"]:
        return setup["runs"][name]
    samp_kw, gen_cfg, kind = case
    cfg = sampling.SamplingConfig.make(**samp_kw)
    tt, dt = setup["target_table"], setup["draft_table"]
    target = TabularModel(V)
    if gen_cfg is None:
        gen_cfg = decoding.GenerationConfig(max_new_tokens=N_NEW, gamma=0)
        drafter, draft_params = None, None
    else:
        draft_params = dt
        if kind == "model":
            drafter = drafters.ModelDrafter(TabularModel(V))
        elif kind == "ngram":
            drafter, draft_params = drafters.NGramDrafter(V), None
        elif kind == "no_rollback_drafter":
            drafter = NoRollbackDrafter(TabularModel(V))
        elif kind == "no_catch_up_drafter":
            drafter = NoCatchUpDrafter(TabularModel(V))
        elif kind == "misreport_temperature":
            drafter = MisreportingDrafter(TabularModel(V), mode="temperature")
        elif kind == "misreport_sharpened":
            drafter = MisreportingDrafter(TabularModel(V), mode="sharpened")
        elif kind == "no_rollback_target":
            drafter, target = drafters.ModelDrafter(TabularModel(V)), NoRollbackTarget(V)
        elif kind == "budget_one_short":
            drafter = OwnProgramDrafter(TabularModel(V))
        else:
            raise AssertionError(kind)
    engine = decoding.Engine(target, drafter, gen_cfg)
    with pytest.MonkeyPatch.context() as mp:
        if kind == "budget_one_short":
            mp.setattr(models.PackedRows, "leading", staticmethod(_leading_one_short))
        out = engine.run(decoding.EngineParams(target=tt, draft=draft_params), cfg, _batch(setup, gen_cfg))
    lengths = np.asarray(out.lengths_B)
    assert (lengths == len(PROMPT) + N_NEW).all(), "every row must generate exactly N_NEW tokens"
    assert (np.asarray(out.status_B) == decoding.MAX_TOKENS).all()
    gen = np.asarray(out.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]
    m = out.metrics
    proposed = int(np.asarray(m.proposed_B).sum())
    rejection = 1.0 - int(np.asarray(m.accepted_B).sum()) / proposed if proposed else float("nan")
    np.testing.assert_array_equal(np.asarray(m.committed_B), N_NEW)
    if gen_cfg.has_budgets:
        # the rows really drafted different numbers of tokens (one per row per round on average)
        per_round_B = np.asarray(m.proposed_B) / np.asarray(m.rounds_B)
        assert per_round_B.max() >= 1.5 and np.mean(per_round_B != per_round_B[0]) > 0.1, \
            (per_round_B.min(), per_round_B.max())
    setup["runs"][name] = (gen, rejection)
    return gen, rejection


_PROBS = jax.jit(sampling.probabilities)      # one compiled program per sampling mode


def _pvalue(gen_BN, setup, samp_kw):
    """Pooled chi-square p-value of the N-token sequences against the exact target law;
    also returns the number of samples that fell in cells of exact probability 0."""
    cfg = sampling.SamplingConfig.make(**samp_kw)
    exact = sequence_probs(setup["target_table"], PROMPT, N_NEW, lambda t: _PROBS(t, cfg))
    cells = list(itertools.product(range(V), repeat=N_NEW))
    probs = np.array([exact[c] for c in cells], np.float64)
    probs /= probs.sum()
    index = gen_BN @ (V ** np.arange(N_NEW - 1, -1, -1))     # same order as itertools.product
    return support_chisquare(np.bincount(index, minlength=len(cells)), probs)


def _report(name, p, rejection, n_cells, extra=""):
    print(f"\n[{name}] p={p:.3g} (alpha per test {PER_TEST_ALPHA:.2g}, family {FAMILY_SIZE}) "
          f"rejection rate={rejection:.3f} cells={n_cells}{extra}")


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_matches_target_law(setup, name):
    case = EXACT_CASES[name]
    gen, rejection = _run(setup, name, case)
    p, impossible, n_cells = _pvalue(gen, setup, case[0])
    _report(name, p, rejection, n_cells)
    assert impossible == 0, f"{impossible} samples have target probability 0"
    if case[1] is not None:
        assert 0.05 < rejection < 0.95, "the tables should make both acceptance and rejection common"
    assert n_cells > 20
    assert p > PER_TEST_ALPHA, f"{name}: chi-square p={p:.3g} rejects exactness"


@pytest.mark.parametrize("name", list(DRAFT_STATE_BUG_CASES))
def test_draft_state_bugs_lower_acceptance_but_stay_exact(setup, name):
    case = DRAFT_STATE_BUG_CASES[name]
    gen, rejection = _run(setup, name, case)
    _, good_rejection = _run(setup, "token_g3_T1", EXACT_CASES["token_g3_T1"])
    p, impossible, n_cells = _pvalue(gen, setup, case[0])
    _report(name, p, rejection, n_cells, f" (correct drafter: {good_rejection:.3f})")
    # The bug is real and active: the proposals get clearly worse on the same keys...
    assert rejection > good_rejection + 0.03
    # ...but the reported q is still the sampled one, so the output law is exact.
    assert impossible == 0
    assert p > PER_TEST_ALPHA, f"{name}: chi-square p={p:.3g}"


@pytest.mark.parametrize("name", list(NEGATIVE_CASES))
def test_negative_control_is_detected(setup, name):
    case = NEGATIVE_CASES[name]
    gen, rejection = _run(setup, name, case)
    p, impossible, n_cells = _pvalue(gen, setup, case[0])
    _report(name, p, rejection, n_cells, " (negative control: must be below alpha)")
    assert p < PER_TEST_ALPHA, f"negative control {name} not detected (p={p:.3g}): test has no power"


def test_tables_are_peaked_prefix_dependent_and_different(setup):
    cfg = sampling.SamplingConfig.make(1.0)
    p = np.asarray(sampling.probabilities(setup["target_table"], cfg))
    q = np.asarray(sampling.probabilities(setup["draft_table"], cfg))
    assert p.max(-1).mean() > 0.6                          # peaked
    # prefix dependent: the distribution changes with the previous token
    assert np.abs(p[0] - p[1]).sum(-1).max() > 0.5
    alpha = np.minimum(p, q).sum(-1).mean()                 # per-token acceptance
    assert 0.4 < alpha < 0.95
