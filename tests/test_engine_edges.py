"""Edge cases of the generation loop, checked round by round through `Engine.init` / `Engine.step`.

After every round, for every row still running:
  * the committed tokens are the target-only (greedy) reference prefix, PAD after `lengths`;
  * the target cache holds exactly the committed prefix minus its last token
    (`lengths - 1` slots, contents equal to the committed tokens);
  * the draft cache likewise (the scripted drafter below keeps `lengths - 1` always);
  * the next round's target logits, computed through the cache, equal a fresh recompute
    (`TabularModel.apply(..., cache=None)`) on the committed prefix.

The target is an "arithmetic progression" table over V = 8: greedy continues
next = 2 * cur - prev (mod 8), so each prompt below has its own stride (1, 3, 5, 7), every row
visits its own set of (prev, cur) pairs, and a NaN planted at one pair hits exactly one row.
The logits also carry prefix-dependent noise, so a stale or wrong history changes them.

A deterministic `ScriptedDrafter` (drafter protocol, one-hot q) proposes, for absolute
position i, `script[b, i]`: the greedy reference with chosen positions "poisoned" (+1 mod V),
which forces rejections exactly where wanted.

Also: gamma = 0, EOS inside an accepted block, max_new_tokens mid-block, NaN rows,
determinism / batch invariance / key dependence at temperature 1, host-side errors, the
trace count (one compilation per static configuration), `Engine.stream` and `Engine.step`
driven by hand against `Engine.run` (same tokens, statuses and metrics; the stream copies only
each round's `Commit` to the host), and a drafter that reads the target's cache through its
`DraftContext` (the early-exit pattern).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax import decoding, drafters, models, sampling

from _toy import TabularModel, random_table

V = 8
GAMMA = 4
MAX_NEW = 12
PROMPTS = [[3, 4], [2, 5], [1, 6, 3], [7]]        # strides 1, 3, 5, 7
P = max(len(p) for p in PROMPTS)
GREEDY = sampling.SamplingConfig.make(0.0)
TARGET = TabularModel(V)

CFG = decoding.GenerationConfig(MAX_NEW, gamma=GAMMA)
CFG_EOS = decoding.GenerationConfig(MAX_NEW, gamma=GAMMA, eos_ids=(6,))
CFG_G0 = decoding.GenerationConfig(MAX_NEW, gamma=0)
KEY0 = jax.random.key(0)


def batch_for(config, prompts=PROMPTS, key=KEY0, **kw):
    return decoding.make_batch(prompts, config, key, **kw)


def run_engine(table, config, drafter=None, draft_params=None, prompts=PROMPTS, sampling_cfg=GREEDY, key=KEY0,
               round_time_s=None, **batch_kw):
    engine = decoding.Engine(TARGET, drafter, config)
    return engine.run(decoding.EngineParams(target=table, draft=draft_params), sampling_cfg,
                      batch_for(config, prompts, key, **batch_kw), round_time_s=round_time_s)


def progression_table(seed=0, margin=6.0):
    prev = np.arange(V)[:, None]
    cur = np.arange(V)[None, :]
    succ = (2 * cur - prev) % V
    noise = random_table(jax.random.key(seed), V, peak=1.0)
    return noise + margin * jax.nn.one_hot(jnp.asarray(succ), V)


def greedy_reference(table, prompt, n):
    """Host greedy continuation of `prompt` (n tokens; stops early at a NaN, like the engine)."""
    t = np.asarray(table)
    seq = list(prompt)
    out = []
    for _ in range(n):
        prev = seq[-2] if len(seq) >= 2 else 0
        logits = t[prev, seq[-1]]
        if np.isnan(logits).any():
            break
        nxt = int(np.argmax(logits))
        seq.append(nxt)
        out.append(nxt)
    return out


# ----------------------------------------------------------------------------- scripted drafter

@struct.dataclass
class ScriptState:
    cache: object


@dataclasses.dataclass(frozen=True)
class ScriptedDrafter:
    """Proposes params['script'][b, L + j] for j < gamma with one-hot q. Keeps its own toy
    cache of the committed prefix (it feeds [last, d_1 .. d_gamma] each round, so after the
    engine's commit it holds exactly lengths - 1 tokens, also after a fully accepted round)."""
    vocab_size: int
    capabilities = drafters.Capabilities(own_cache=True)

    def _model(self):
        return TabularModel(self.vocab_size)

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        cache = self._model().init_cache(prompt_BP.shape[0], capacity)
        _, cache = self._model().apply(params["table"], prompt_BP, cache, num_valid_B=prompt_lengths_B - 1)
        return ScriptState(cache)

    def forward_passes(self, gamma):
        return 1     # one (gamma+1)-token forward of its toy model

    def propose(self, params, state, context, key_B, gamma, cfg):
        tokens_BS, lengths_B = context.tokens_BS, context.lengths_B
        script = params["script"]
        last_B = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)
        idx_BG = jnp.clip(lengths_B[:, None] + jnp.arange(gamma)[None], 0, script.shape[1] - 1)
        draft_BG = jnp.take_along_axis(script, idx_BG, axis=1).astype(jnp.int32)
        _, cache = self._model().apply(params["table"], jnp.concatenate([last_B, draft_BG], 1), state.cache)
        return draft_BG, jax.nn.one_hot(draft_BG, self.vocab_size, dtype=jnp.float32), ScriptState(cache)

    def commit(self, state, new_lengths_B):
        return ScriptState(state.cache.truncate(new_lengths_B - 1))


def make_script(refs, poison, width):
    """script[b, P_b + o] = refs[b][o], +1 (mod V) at the offsets in poison[b]."""
    script = np.zeros((len(PROMPTS), width), np.int32)
    for b, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        for o, tok in enumerate(ref):
            if len(prompt) + o < width:
                script[b, len(prompt) + o] = (tok + 1) % V if o in poison[b] else tok
    return jnp.asarray(script)


# ----------------------------------------------------------------------------- stepping harness

@dataclasses.dataclass
class Snap:
    tokens: np.ndarray
    lengths: np.ndarray
    done: np.ndarray
    status: np.ndarray
    t_len: np.ndarray
    t_hist: np.ndarray
    d_len: np.ndarray | None
    d_hist: np.ndarray | None
    accepted: np.ndarray
    proposed: np.ndarray
    committed: np.ndarray
    gamma_rounds: np.ndarray
    next_cached: np.ndarray     # next round's target logits through the cache [B, V]
    next_fresh: np.ndarray      # the same recomputed without a cache on the committed prefix (the
                                # whole token buffer: the toy's logits at a position read only it
                                # and the token before, so what follows the prefix cannot change them)


def _np(x):
    """A host copy (the state's buffers are donated to the next `Engine.step`)."""
    return np.array(x, copy=True)


@jax.jit
def _next_logits(table, tokens_BS, lengths_B, target_cache):
    """(through the cache, fresh) next-round target logits [B, V], in one compiled program (op by
    op, every row length compiled its own slices)."""
    last = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)
    cached = TARGET.apply(table, last, target_cache)[0][:, 0]
    fresh = TARGET.apply(table, tokens_BS, None)[0]
    return cached, jnp.take_along_axis(fresh, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


def _snap(state, table):
    tokens = _np(state.tokens_BS)
    lengths = _np(state.lengths_B)
    cached, fresh = (_np(x) for x in _next_logits(table, state.tokens_BS, state.lengths_B, state.target_cache))
    cache = getattr(state.draft_state, "cache", None)
    return Snap(tokens=tokens, lengths=lengths, done=_np(state.done_B), status=_np(state.status_B),
                t_len=_np(state.target_cache.lengths_B), t_hist=_np(state.target_cache.hist_BS),
                d_len=None if cache is None else _np(cache.lengths_B),
                d_hist=None if cache is None else _np(cache.hist_BS),
                accepted=_np(state.metrics.accepted_B), proposed=_np(state.metrics.proposed_B),
                committed=_np(state.metrics.committed_B),
                gamma_rounds=_np(state.metrics.gamma_rounds_Z),
                next_cached=cached, next_fresh=fresh)


def run_rounds(table, config, drafter=None, draft_params=None, prompts=PROMPTS, sampling_cfg=GREEDY,
               key=KEY0, round_time_s=None, extra_snap=None):
    """Drive `Engine.step` by hand; a snapshot after prefill and after every round."""
    engine = decoding.Engine(TARGET, drafter, config)
    params = decoding.EngineParams(target=table, draft=draft_params)
    if round_time_s is None:
        round_time_s = [1.0] * len(config.gammas)
    state = engine.init(params, batch_for(config, prompts, key), round_time_s=round_time_s)
    snaps = [_snap(state, table)]
    extras = [None if extra_snap is None else extra_snap(state)]
    for _ in range(config.max_rounds or config.max_new_tokens):
        state, _ = engine.step(params, sampling_cfg, state)
        snaps.append(_snap(state, table))
        extras.append(None if extra_snap is None else extra_snap(state))
        if snaps[-1].done.all():
            break
    return snaps if extra_snap is None else (snaps, extras)


def check_invariants(snaps, plens, refs, draft_exact=True):
    """Per round: committed prefix == reference prefix, PAD tail, cache lengths and contents,
    next-round logits == fresh recompute (for rows still running)."""
    for r, s in enumerate(snaps):
        for b in range(len(plens)):
            L = int(s.lengths[b])
            gen = s.tokens[b, plens[b]:L].tolist()
            assert gen == refs[b][:len(gen)], f"round {r} row {b}: {gen} is not a prefix of {refs[b]}"
            assert (s.tokens[b, L:] == decoding.PAD_ID).all(), f"round {r} row {b}: written past lengths"
            if s.done[b]:
                continue
            assert s.t_len[b] == L - 1, f"round {r} row {b}: target cache {s.t_len[b]} != {L - 1}"
            np.testing.assert_array_equal(s.t_hist[b, :L - 1], s.tokens[b, :L - 1])
            np.testing.assert_array_equal(s.next_cached[b], s.next_fresh[b],
                                          err_msg=f"round {r} row {b}: cached logits != fresh")
            if s.d_len is not None and draft_exact:
                assert s.d_len[b] == L - 1, f"round {r} row {b}: draft cache {s.d_len[b]} != {L - 1}"
                np.testing.assert_array_equal(s.d_hist[b, :L - 1], s.tokens[b, :L - 1])


def simulate(poison, gamma=GAMMA, max_new=MAX_NEW):
    """Expected (n_accepted, n_committed) per round for one row under greedy + script."""
    o, rounds = 0, []
    while o < max_new:
        k = next((j for j in range(gamma) if o + j in poison), gamma)
        n = min(k + 1, max_new - o)
        rounds.append((k, n))
        o += n
    return rounds


def per_round(snaps, field, b):
    vals = [int(getattr(s, field)[b]) for s in snaps]
    return [y - x for x, y in zip(vals, vals[1:])]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def env():
    table = progression_table()
    refs = [greedy_reference(table, p, MAX_NEW + GAMMA + 2) for p in PROMPTS]
    plens = [len(p) for p in PROMPTS]
    width = CFG.slots_needed(P) + GAMMA

    def ar(tab, eos_ids=()):
        return run_engine(tab, decoding.GenerationConfig(MAX_NEW, gamma=0, eos_ids=eos_ids))

    def spec(tab, drafter, draft_params, config):
        return run_engine(tab, config, drafter, draft_params)

    return dict(table=table, refs=refs, plens=plens, width=width, ar=ar, spec=spec)


def test_reference_is_the_engines_target_only_output(env):
    out = env["ar"](env["table"])
    assert out.generated() == [r[:MAX_NEW] for r in env["refs"]]
    # each row has its own stride, so the (prev, cur) pairs whose logits a row uses are disjoint
    strides = [{(b - a) % V for a, b in zip(p[-1:] + r, r)} for p, r in zip(PROMPTS, env["refs"])]
    assert strides == [{1}, {3}, {5}, {7}]
    used = [set(zip(([0] + p + r)[len(p) - 1:], (p + r)[len(p) - 1:])) for p, r in zip(PROMPTS, env["refs"])]
    assert all(not (used[i] & used[j]) for i in range(4) for j in range(i))
    assert (3, 6) in used[1] and all((0, 4) not in u for u in used)


# ----------------------------------------------------------------------------- rejection positions

EXTRA = [set(), {6}, {7, 8}, {10}]       # later poisons, different per row
SCENARIOS = {
    "reject_first": ({0}, 0),
    "reject_middle": ({2}, 2),
    "reject_last": ({3}, 3),
    "fully_accepted": (set(), GAMMA),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rejection_position_and_cache_consistency(env, scenario):
    first, expected_first_round = SCENARIOS[scenario]
    poison = [first | e for e in EXTRA]
    params = dict(table=env["table"], script=make_script(env["refs"], poison, env["width"]))
    snaps = run_rounds(env["table"], CFG, ScriptedDrafter(V), params)
    check_invariants(snaps, env["plens"], env["refs"])
    for b in range(len(PROMPTS)):
        expected = simulate(poison[b])
        acc = per_round(snaps, "accepted", b)
        com = per_round(snaps, "committed", b)
        assert acc[0] == expected_first_round
        assert com[:len(expected)] == [n for _, n in expected], f"row {b}"
        for r, (k, n) in enumerate(expected):
            if n == k + 1:
                assert acc[r] == k, f"row {b} round {r + 1}"
            else:   # truncated by max_new_tokens: the metric may count the verifier's or the kept drafts
                assert n - 1 <= acc[r] <= k, f"row {b} round {r + 1}"
        assert all(x == 0 for x in acc[len(expected):] + com[len(expected):]), "finished rows stay inert"
    final = snaps[-1]
    assert (final.status == decoding.MAX_TOKENS).all()
    np.testing.assert_array_equal(final.lengths - np.asarray(env["plens"]), MAX_NEW)


def test_max_new_tokens_reached_mid_block(env):
    """All proposals right: rounds commit 5, 5, then only 2 of the 4 accepted + bonus."""
    params = dict(table=env["table"], script=make_script(env["refs"], [set()] * 4, env["width"]))
    snaps = run_rounds(env["table"], CFG, ScriptedDrafter(V), params)
    check_invariants(snaps, env["plens"], env["refs"])
    assert len(snaps) == 4
    for b in range(4):
        assert per_round(snaps, "accepted", b)[:2] == [GAMMA, GAMMA]
        assert per_round(snaps, "committed", b) == [5, 5, 2]
    assert [s.status.tolist() for s in snaps[1:3]] == [[decoding.RUNNING] * 4] * 2
    assert (snaps[-1].status == decoding.MAX_TOKENS).all()
    np.testing.assert_array_equal(snaps[-1].lengths - np.asarray(env["plens"]), MAX_NEW)
    # the accepted drafts beyond max_new_tokens were not written (some of them are non-PAD ids)
    assert any(r[MAX_NEW] != decoding.PAD_ID for r in env["refs"])
    out = env["spec"](env["table"], ScriptedDrafter(V), params, CFG)
    assert out.generated() == env["ar"](env["table"]).generated()


def test_gamma_zero_is_one_target_token_per_round(env):
    snaps = run_rounds(env["table"], CFG_G0)
    check_invariants(snaps, env["plens"], env["refs"])
    assert len(snaps) == MAX_NEW + 1
    for b in range(4):
        assert per_round(snaps, "committed", b) == [1] * MAX_NEW
        assert per_round(snaps, "accepted", b) == [0] * MAX_NEW
    assert snaps[0].d_len is None
    assert (snaps[-1].status == decoding.MAX_TOKENS).all()


# ----------------------------------------------------------------------------- EOS

def test_eos_inside_accepted_block(env):
    eos = CFG_EOS.eos_ids[0]
    refs = env["refs"]
    first = [r.index(eos) for r in refs]
    # precondition: every EOS sits at an accepted draft slot (offset % 5 < 4) and rows stop in
    # different rounds; after some EOS the block held further non-PAD tokens
    assert all(o % (GAMMA + 1) < GAMMA for o in first)
    stop_round = [o // (GAMMA + 1) + 1 for o in first]
    assert len(set(stop_round)) > 1
    assert any(any(t != decoding.PAD_ID for t in refs[b][first[b] + 1:(stop_round[b]) * (GAMMA + 1)])
               for b in range(4))
    params = dict(table=env["table"], script=make_script(refs, [set()] * 4, env["width"]))
    snaps = run_rounds(env["table"], CFG_EOS, ScriptedDrafter(V), params)
    check_invariants(snaps, env["plens"], refs)
    for b in range(4):
        gen = snaps[-1].tokens[b, env["plens"][b]:snaps[-1].lengths[b]].tolist()
        assert gen == refs[b][:first[b] + 1]
        assert snaps[-1].status[b] == decoding.EOS
        # the row stopped in its round and never changed afterwards
        for r, s in enumerate(snaps):
            assert bool(s.done[b]) == (r >= stop_round[b])
            if r >= stop_round[b]:
                np.testing.assert_array_equal(s.tokens[b], snaps[-1].tokens[b])
                assert s.status[b] == decoding.EOS
    # while finished rows were frozen, another row kept growing
    early = min(stop_round)
    late = [b for b in range(4) if stop_round[b] > early]
    assert any(snaps[-1].lengths[b] > snaps[early].lengths[b] for b in late)
    out = env["spec"](env["table"], ScriptedDrafter(V), params, CFG_EOS)
    ref = env["ar"](env["table"], eos_ids=(eos,))
    assert out.generated() == ref.generated()
    np.testing.assert_array_equal(np.asarray(out.status_B), np.asarray(ref.status_B))


# ----------------------------------------------------------------------------- NaN logits

def _nan_table(table, pair):
    return table.at[pair[0], pair[1]].set(jnp.nan)


def test_nan_row_stops_and_others_finish(env):
    """NaN on the pair (3, 6), visited only by row 1 (stride 3: 0, 3, 6, ...). With a
    rejection at offset 2 the row commits [0, 3, 6] and the next round's first position is
    NaN: status NAN_LOGITS, tokens kept and frozen; the other rows equal the NaN-free run."""
    refs = env["refs"]
    assert refs[1][:3] == [0, 3, 6]
    table = _nan_table(env["table"], (3, 6))
    poison = [{2}, {2}, {2}, {2}]
    params = dict(table=table, script=make_script(refs, poison, env["width"]))
    snaps = run_rounds(table, CFG, ScriptedDrafter(V), params)
    check_invariants(snaps, env["plens"], refs)
    final = snaps[-1]
    assert final.status.tolist() == [decoding.MAX_TOKENS, decoding.NAN_LOGITS, decoding.MAX_TOKENS,
                                     decoding.MAX_TOKENS]
    assert final.tokens[1, env["plens"][1]:final.lengths[1]].tolist() == [0, 3, 6]
    assert snaps[1].status[1] == decoding.RUNNING and snaps[2].status[1] == decoding.NAN_LOGITS
    for s in snaps[2:]:
        np.testing.assert_array_equal(s.tokens[1], final.tokens[1])
    assert len(snaps) > 3                       # other rows ran on after the NaN row stopped
    out = env["spec"](table, ScriptedDrafter(V), params, CFG)
    clean = env["ar"](env["table"]).generated()
    assert [g for b, g in enumerate(out.generated()) if b != 1] == [g for b, g in enumerate(clean) if b != 1]
    ar = env["ar"](table)
    assert out.generated() == ar.generated()
    np.testing.assert_array_equal(np.asarray(out.status_B), np.asarray(ar.status_B))


def test_nan_inside_accepted_block_commits_like_target_only(env):
    """Same NaN pair, but every proposal is right, so the NaN position (predicting offset 3)
    lies inside round 1's block after three accepted drafts. Target-only decoding commits
    [0, 3, 6] and then stops on the NaN; greedy speculative decoding must return the same
    tokens and status (the drafts before the NaN were verified against finite logits)."""
    table = _nan_table(env["table"], (3, 6))
    params = dict(table=table, script=make_script(env["refs"], [set()] * 4, env["width"]))
    ar = env["ar"](table)
    assert ar.generated()[1] == [0, 3, 6]
    assert np.asarray(ar.status_B).tolist() == [decoding.MAX_TOKENS, decoding.NAN_LOGITS,
                                                 decoding.MAX_TOKENS, decoding.MAX_TOKENS]
    out = env["spec"](table, ScriptedDrafter(V), params, CFG)
    np.testing.assert_array_equal(np.asarray(out.status_B), np.asarray(ar.status_B))
    assert out.generated() == ar.generated()


def test_nan_after_a_rejected_draft_does_not_stop_the_row(env):
    """Row 1's draft at offset 1 is wrong (4 instead of 3) and the target's logits after the
    pair (0, 4) are NaN. That position is never used: the draft is rejected before it and
    target-only decoding never visits (0, 4) (no row has stride 4). The row must finish
    normally, equal to the target-only output."""
    refs = env["refs"]
    assert refs[1][:2] == [0, 3]
    table = _nan_table(env["table"], (0, 4))
    ar = env["ar"](table)
    assert ar.generated() == env["ar"](env["table"]).generated()
    assert (np.asarray(ar.status_B) == decoding.MAX_TOKENS).all()
    params = dict(table=table, script=make_script(refs, [set(), {1}, set(), set()], env["width"]))
    out = env["spec"](table, ScriptedDrafter(V), params, CFG)
    np.testing.assert_array_equal(np.asarray(out.status_B), np.asarray(ar.status_B))
    assert out.generated() == ar.generated()


# ----------------------------------------------------------------------------- ModelDrafter cache

ADAPTIVE = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=2)
ADAPTIVE_TIMES = (1.0, 1.9, 3.7)          # drafting dear at the prior: gamma 0 first, then probes


@pytest.mark.parametrize("gamma", [3, ADAPTIVE], ids=["fixed_gamma3", "adaptive_with_gamma0"])
def test_model_drafter_cache_follows_committed_prefix(env, gamma):
    """ModelDrafter with the target table as draft (so every proposal is right). After a round
    that called the drafter, its cache holds the committed prefix minus the last token, or
    minus the last two after a fully accepted round (caught up by the next propose); a gamma-0
    round does not call it. Adaptive: expensive draft rounds make the policy start at gamma 0
    (then probe gamma 1): after those rounds the drafter must catch up on ALL the tokens
    committed meanwhile, otherwise it proposes continuations of a stale prefix."""
    config = decoding.GenerationConfig(MAX_NEW, gamma=gamma)
    rt = None if isinstance(gamma, int) else jnp.asarray(ADAPTIVE_TIMES, jnp.float32)
    drafter = drafters.ModelDrafter(TabularModel(V))
    snaps = run_rounds(env["table"], config, drafter, env["table"], round_time_s=rt)
    check_invariants(snaps, env["plens"], env["refs"], draft_exact=False)
    ran = [config.gammas[int(np.argmax(s.gamma_rounds - prev.gamma_rounds))]
           for prev, s in zip(snaps, snaps[1:])]
    print("\ngamma per round:", ran)
    if not isinstance(gamma, int):
        assert ran[:2] == [0, 0] and any(g > 0 for g in ran), "precondition: gamma 0, then positive"
    for r, (prev, s) in enumerate(zip(snaps, snaps[1:])):
        for b in range(4):
            if s.done[b]:
                continue
            L, d = int(s.lengths[b]), int(s.d_len[b])
            np.testing.assert_array_equal(s.d_hist[b, :d], s.tokens[b, :d])
            if ran[r] == 0:
                assert d == int(prev.d_len[b])
            else:
                full = int(s.accepted[b] - prev.accepted[b]) == ran[r]
                assert d == (L - 2 if full else L - 1), \
                    f"round {r + 1} (gamma {ran[r]}) row {b}: draft cache {d}, lengths {L}"
    # the self draft is always right: nothing is ever rejected
    np.testing.assert_array_equal(snaps[-1].accepted, snaps[-1].proposed)
    assert (snaps[-1].accepted > 0).all()


# ----------------------------------------------------------------------------- randomness

@pytest.fixture(scope="module")
def sampled():
    table = progression_table(seed=3, margin=1.0)        # flat enough that samples vary
    draft = random_table(jax.random.key(4), V, peak=1.5)
    drafter = drafters.ModelDrafter(TabularModel(V))
    config = decoding.GenerationConfig(MAX_NEW, gamma=3)
    cfg = sampling.SamplingConfig.make(1.0)
    # request id -> prompt (ids not listed use prompt 2); every batch pads to width 3
    prompts = {0: [3, 4], 1: [2, 5], 2: [1, 6, 3], 3: [7], 10: [5, 5, 5], 11: [0]}

    def run(ids, key=jax.random.key(42)):
        out = run_engine(table, config, drafter, draft, [prompts.get(i, prompts[2]) for i in ids], cfg, key,
                         request_ids=ids)
        return out.generated(), out
    return run


def test_same_keys_same_output(sampled):
    a, out_a = sampled([0, 1, 2, 3])
    b, out_b = sampled([0, 1, 2, 3])
    assert a == b
    np.testing.assert_array_equal(np.asarray(out_a.tokens_BS), np.asarray(out_b.tokens_BS))
    np.testing.assert_array_equal(np.asarray(out_a.metrics.accepted_B), np.asarray(out_b.metrics.accepted_B))


def test_sample_is_independent_of_batch_layout(sampled):
    batch, _ = sampled([0, 1, 2, 3])
    alone, _ = sampled([2])
    other, _ = sampled([10, 2, 11, 0])       # different neighbours and row positions
    assert alone[0] == batch[2]
    assert other[1] == batch[2]
    assert other[3] == batch[0]


def test_different_keys_different_samples(sampled):
    same_prompt, _ = sampled([2, 102, 202, 302])          # ids 102.. map to prompt 2 as well
    assert len({tuple(g) for g in same_prompt}) >= 3
    base, _ = sampled([0, 1, 2, 3])
    other_key, _ = sampled([0, 1, 2, 3], key=jax.random.key(43))
    assert base != other_key


# ----------------------------------------------------------------------------- stream and step vs run

@pytest.fixture(scope="module", params=["greedy_adaptive", "sampled_g3"])
def pair(request, env):
    """(engine, params, sampling, batch, round_time_s): greedy with adaptive gamma (gamma-0
    rounds, then positive ones, a draft that is often rejected), and temperature 1 with gamma 3
    (the `sampled` configuration, so its `run` program is shared)."""
    drafter = drafters.ModelDrafter(TabularModel(V))
    if request.param == "greedy_adaptive":
        config = decoding.GenerationConfig(MAX_NEW, gamma=ADAPTIVE)
        params = decoding.EngineParams(target=env["table"], draft=random_table(jax.random.key(7), V, peak=2.0))
        return (decoding.Engine(TARGET, drafter, config), params, GREEDY, batch_for(config),
                ADAPTIVE_TIMES)
    config = decoding.GenerationConfig(MAX_NEW, gamma=3)
    params = decoding.EngineParams(target=progression_table(seed=3, margin=1.0),
                                   draft=random_table(jax.random.key(4), V, peak=1.5))
    return (decoding.Engine(TARGET, drafter, config), params, sampling.SamplingConfig.make(1.0),
            batch_for(config, key=jax.random.key(42)), None)


def _assert_same_output(a, b):
    np.testing.assert_array_equal(np.asarray(a.tokens_BS), np.asarray(b.tokens_BS))
    for name in ("lengths_B", "prompt_lengths_B", "status_B"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    for name, x, y in zip(a.metrics.__dataclass_fields__, jax.tree.leaves(a.metrics), jax.tree.leaves(b.metrics)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"metrics.{name}")


def test_stream_yields_the_tokens_of_run(pair, monkeypatch):
    """Same keys, same tokens: the concatenated per-round tokens are `run`'s continuation, the
    last event carries `run`'s output, and the only host copies are the rounds' `Commit`s (also
    with every adaptive candidate precompiled on copies of the state)."""
    engine, params, samp, batch, rt = pair
    ref = engine.run(params, samp, batch, round_time_s=rt)
    if engine.config.adaptive:
        k = np.asarray(ref.metrics.gamma_rounds_Z)
        assert k[0] >= 1 and k[1:].sum() >= 1, "precondition: gamma-0 and drafting rounds"
    assert 0 < int(ref.metrics.accepted_B.sum()) < int(ref.metrics.proposed_B.sum()), "precondition: rejections"
    copied = []
    real_device_get = jax.device_get

    def spy(x):
        copied.append(x)
        return real_device_get(x)

    monkeypatch.setattr(jax, "device_get", spy)
    # Under adaptive gamma every candidate's round compiles (and runs on a copy) before round 1.
    events = list(engine.stream(params, samp, batch, round_time_s=rt, precompile=True))
    monkeypatch.undo()
    assert [e.round for e in events] == list(range(1, len(events) + 1))
    assert all(e.output is None for e in events[:-1]) and events[-1].output is not None
    assert all(events[-1].done) and not all(events[-2].done)
    assert int(ref.metrics.rounds_B.max()) == len(events)
    streamed = [sum((e.new_tokens[b] for e in events), []) for b in range(len(PROMPTS))]
    assert streamed == ref.generated()
    assert [decoding.timing_summary(events, row=b)["tokens"] for b in range(len(PROMPTS))] == \
        [len(g) for g in ref.generated()]
    _assert_same_output(events[-1].output, ref)
    # a row's events stop growing once it is done
    for b in range(len(PROMPTS)):
        first_done = next(i for i, e in enumerate(events) if e.done[b])
        assert all(e.new_tokens[b] == [] for e in events[first_done + 1:])
    # one host copy per round, and it is the round's Commit (never the token buffer or the
    # state); under adaptive gamma first the policy's choice for round 1 (a scalar)
    if engine.config.adaptive:
        first, copied = copied[0], copied[1:]
        assert np.shape(first) == () and 0 <= int(first) < len(engine.config.gammas)
        assert all(c.next_index is not None for c in copied)
    assert len(copied) == len(events)
    assert all(isinstance(c, decoding.Commit) for c in copied)
    K = engine.config.max_gamma + 1
    assert all(c.tokens_BC.shape == (len(PROMPTS), K) for c in copied)


def test_step_by_hand_equals_run(pair):
    """`init` + `step` (state donated) until every row is done gives `run`'s output, and each
    round's `Commit` describes exactly what the round wrote."""
    engine, params, samp, batch, rt = pair
    ref = engine.run(params, samp, batch, round_time_s=rt)
    state = engine.init(params, batch, round_time_s=rt)
    tokens = np.array(state.tokens_BS, copy=True)
    lengths = np.array(state.lengths_B, copy=True)
    K = engine.config.max_gamma + 1
    rounds = 0
    while not np.asarray(state.done_B).all():
        assert rounds < MAX_NEW, "every round commits at least one token per running row"
        state, commit = engine.step(params, samp, state)
        rounds += 1
        c = jax.device_get(commit)
        new_tokens = np.array(state.tokens_BS, copy=True)
        new_lengths = np.array(state.lengths_B, copy=True)
        np.testing.assert_array_equal(c.start_B, lengths)
        np.testing.assert_array_equal(c.n_B, new_lengths - lengths)
        np.testing.assert_array_equal(c.done_B, np.asarray(state.done_B))
        for b in range(len(PROMPTS)):
            n = int(c.n_B[b])
            np.testing.assert_array_equal(c.tokens_BC[b, :n], new_tokens[b, lengths[b]:lengths[b] + n])
            assert (c.tokens_BC[b, n:] == decoding.PAD_ID).all()
            np.testing.assert_array_equal(new_tokens[b, :lengths[b]], tokens[b, :lengths[b]])   # prefix kept
        assert c.tokens_BC.shape == (len(PROMPTS), K)
        tokens, lengths = new_tokens, new_lengths
    assert rounds == int(np.asarray(state.round)) == int(ref.metrics.rounds_B.max())
    _assert_same_output(decoding.GenerateOutput.from_state(state), ref)


def test_round_times_measures_each_gamma_and_feeds_run(env):
    """`round_times` (adaptive gamma's calibration): one positive time per configured gamma,
    and the times it returns are accepted by `run` (the engine of the `pair` fixture's adaptive
    case: its `run` program)."""
    config = decoding.GenerationConfig(MAX_NEW, gamma=ADAPTIVE)
    engine = decoding.Engine(TARGET, drafters.ModelDrafter(TabularModel(V)), config)
    params = decoding.EngineParams(target=env["table"], draft=env["table"])
    times = engine.round_times(params, GREEDY, batch_for(config), repeats=1)
    assert len(times) == len(ADAPTIVE.gammas) and all(t > 0 for t in times)
    out = engine.run(params, GREEDY, batch_for(config), round_time_s=times)
    assert out.generated() == [r[:MAX_NEW] for r in env["refs"]]
    with pytest.raises(ValueError, match="round_time_s"):
        engine.run(params, GREEDY, batch_for(config), round_time_s=times + [1.0])
    with pytest.raises(ValueError, match="repeats >= 1"):      # no timed round: no median (NaN) to price with
        engine.round_times(params, GREEDY, batch_for(config), repeats=0)


# ----------------------------------------------------------------------------- drafter on the target cache

@struct.dataclass
class SeenState:
    seen_cache_B: jax.Array      # the target cache's length as the drafter saw it (last round)
    seen_context_B: jax.Array    # the committed length in the same DraftContext
    ok_B: jax.Array              # every round so far: cache history == committed prefix minus last


@dataclasses.dataclass(frozen=True)
class TargetCacheDrafter:
    """The early-exit pattern on the toy model: no cache of its own, it drafts from the target's
    cache handed over in `DraftContext` (feed the last committed token, then roll out gamma
    tokens with `drafters.rollout`; the speculative entries are dropped after proposing).
    With the target's own table as draft params every proposal is right iff the cache it sees
    holds exactly the committed prefix minus its last token."""
    vocab_size: int
    capabilities = drafters.Capabilities()

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        z = jnp.zeros(prompt_BP.shape[:1], jnp.int32)
        return SeenState(z, z, jnp.ones(prompt_BP.shape[:1], bool))

    def forward_passes(self, gamma):
        return gamma

    def propose(self, params, state, context, key_B, gamma, cfg):
        model = TabularModel(self.vocab_size)
        cache = context.target_cache
        L_B = context.lengths_B
        pos_S = jnp.arange(cache.hist_BS.shape[1])[None]
        same = jnp.where(pos_S < L_B[:, None] - 1, cache.hist_BS == context.tokens_BS[:, :cache.hist_BS.shape[1]],
                         True).all(axis=1)
        last_B1 = jnp.take_along_axis(context.tokens_BS, (L_B - 1)[:, None], axis=1)
        logits_B1V, cache = model.apply(params, last_B1, cache)
        toks, q, _ = drafters.rollout(model, params, cache, logits_B1V[:, 0], key_B, gamma, cfg)
        ok_B = state.ok_B & same & (context.target_cache.lengths_B == L_B - 1)
        return toks, q, SeenState(context.target_cache.lengths_B, L_B, ok_B)

    def commit(self, state, new_lengths_B):
        return state


@pytest.mark.parametrize("gamma", [GAMMA, ADAPTIVE], ids=["fixed_gamma4", "adaptive_with_gamma0"])
def test_drafter_reads_target_cache_through_context(env, gamma):
    config = decoding.GenerationConfig(MAX_NEW, gamma=gamma)
    rt = None if isinstance(gamma, int) else ADAPTIVE_TIMES
    snaps, seen = run_rounds(env["table"], config, TargetCacheDrafter(V), env["table"], round_time_s=rt,
                             extra_snap=lambda s: jax.tree.map(_np, s.draft_state))
    check_invariants(snaps, env["plens"], env["refs"])
    ran = [config.gammas[int(np.argmax(s.gamma_rounds - prev.gamma_rounds))] for prev, s in zip(snaps, snaps[1:])]
    if not isinstance(gamma, int):
        assert ran[:2] == [0, 0] and any(g > 0 for g in ran), "precondition: gamma 0, then positive"
    for r, (prev, s, d) in enumerate(zip(snaps, snaps[1:], seen[1:])):
        if ran[r] == 0:
            continue
        for b in range(4):
            if prev.done[b]:
                continue
            # what it saw in this round's context: the target cache of the state before the round
            assert int(d.seen_context_B[b]) == int(prev.lengths[b])
            assert int(d.seen_cache_B[b]) == int(prev.t_len[b]) == int(prev.lengths[b]) - 1
    assert np.asarray(seen[-1].ok_B).all()
    np.testing.assert_array_equal(snaps[-1].accepted, snaps[-1].proposed)   # the self draft is always right
    assert (snaps[-1].accepted > 0).all()
    np.testing.assert_array_equal(snaps[-1].lengths - np.asarray(env["plens"]), MAX_NEW)


# ----------------------------------------------------------------------------- host-side errors

def test_vocab_mismatch_raises(env):
    for drafter in (drafters.ModelDrafter(TabularModel(V + 1)), drafters.NGramDrafter(V - 1)):
        with pytest.raises(ValueError, match="vocab"):
            decoding.Engine(TARGET, drafter, CFG)
    with pytest.raises(ValueError, match="drafter"):
        decoding.Engine(TARGET, None, CFG)


def test_capacity_too_small_raises(env):
    need = CFG.slots_needed(P)
    assert need == P + MAX_NEW + GAMMA + 1
    assert batch_for(CFG).capacity == need                      # the default is exactly enough
    assert batch_for(CFG, pad_multiple=8).capacity == 24        # rounded up to the multiple
    params = decoding.EngineParams(target=env["table"], draft=dict(table=env["table"], script=None))
    engine = decoding.Engine(TARGET, ScriptedDrafter(V), CFG)
    small = batch_for(CFG, capacity=need - 1)
    with pytest.raises(models.CacheCapacityError):
        engine.run(params, GREEDY, small)
    with pytest.raises(models.CacheCapacityError):
        engine.init(params, small)
    with pytest.raises(models.CacheCapacityError):
        next(engine.stream(params, GREEDY, small))
    ar = decoding.Engine(TARGET, None, CFG_G0)
    with pytest.raises(models.CacheCapacityError):
        ar.run(decoding.EngineParams(target=env["table"]), GREEDY, batch_for(CFG_G0, capacity=P + MAX_NEW))
    assert batch_for(CFG_G0).capacity == P + MAX_NEW + 1
    # enough slots for the tokens, but the padded prompt is wider than the cache
    wide = batch_for(CFG_G0, pad_multiple=32, capacity=P + MAX_NEW + 1)
    assert wide.prompt_BP.shape[1] == 32
    with pytest.raises(models.CacheCapacityError, match="width"):
        ar.run(decoding.EngineParams(target=env["table"]), GREEDY, wide)
    assert issubclass(models.CacheCapacityError, ValueError)


@pytest.mark.parametrize("prompts", [[], [[1, 2], []], [[1, 2 ** 40]]], ids=["no_prompts", "empty_prompt", "beyond_int32"])
def test_make_batch_rejects_bad_prompts(prompts):
    with pytest.raises(ValueError):
        batch_for(CFG, prompts)


@pytest.mark.parametrize("prompts", [[[1, V]], [[-1, 2]], [[0], [3, 2 * V]]],
                         ids=["id_eq_vocab", "negative_id", "second_row_bad"])
def test_engine_rejects_ids_outside_the_target_vocabulary(env, prompts):
    """Every entry point checks ids on the host (a gather would clamp them silently)."""
    engine = decoding.Engine(TARGET, None, CFG_G0)
    params = decoding.EngineParams(target=env["table"])
    batch = batch_for(CFG_G0, prompts)
    for call in (lambda: engine.run(params, GREEDY, batch), lambda: engine.init(params, batch),
                 lambda: next(engine.stream(params, GREEDY, batch))):
        with pytest.raises(ValueError, match="outside"):
            call()
    # an id beyond a row's length is padding, whose outputs are never used: accepted, the same
    # tokens as the prompt [1] padded to the same width and capacity (one compiled program)
    padded = dataclasses.replace(batch_for(CFG_G0, [[1, V]]), prompt_lengths_B=jnp.asarray([1], jnp.int32))
    plain = batch_for(CFG_G0, [[1]], pad_multiple=2, capacity=padded.capacity)
    assert plain.prompt_BP.shape == padded.prompt_BP.shape
    assert engine.run(params, GREEDY, padded).generated() == engine.run(params, GREEDY, plain).generated()


@pytest.mark.parametrize("lengths", [[0], [3], [1, 1]], ids=["zero", "wider_than_padding", "wrong_count"])
def test_engine_rejects_hand_built_batches_with_bad_lengths(env, lengths):
    engine = decoding.Engine(TARGET, None, CFG_G0)
    batch = dataclasses.replace(batch_for(CFG_G0, [[1, 2]]), prompt_lengths_B=jnp.asarray(lengths, jnp.int32))
    with pytest.raises(ValueError, match="prompt lengths"):
        engine.run(decoding.EngineParams(target=env["table"]), GREEDY, batch)


def test_make_batch_rejects_wrong_number_of_request_ids():
    with pytest.raises(ValueError, match="request ids"):
        batch_for(CFG, [[1], [2]], request_ids=[0])


def test_make_batch_layout():
    batch = batch_for(CFG, [[1, 2, 3], [7]], request_ids=[5, 9])
    np.testing.assert_array_equal(np.asarray(batch.prompt_BP), [[1, 2, 3], [7, decoding.PAD_ID, decoding.PAD_ID]])
    np.testing.assert_array_equal(np.asarray(batch.prompt_lengths_B), [3, 1])
    np.testing.assert_array_equal(jax.random.key_data(batch.key_B),
                                  jax.random.key_data(decoding.request_keys(KEY0, [5, 9])))
    padded = batch_for(CFG, [[1, 2, 3], [7]], pad_multiple=4)
    np.testing.assert_array_equal(np.asarray(padded.prompt_BP),
                                  [[1, 2, 3, decoding.PAD_ID], [7] + [decoding.PAD_ID] * 3])
    np.testing.assert_array_equal(np.asarray(padded.prompt_lengths_B), [3, 1])
    assert padded.capacity % 4 == 0 and padded.capacity >= CFG.slots_needed(3)


# ----------------------------------------------------------------------------- compilation count

@dataclasses.dataclass(frozen=True)
class CountingTabular(TabularModel):
    """TabularModel that counts how often its apply is traced (Python runs only at trace time)."""
    traces = []  # class attribute (not a dataclass field): shared mutable counter

    def apply(self, table_VVV, tokens_BT, cache, num_valid_B=None):
        CountingTabular.traces.append(tokens_BT.shape)
        return super().apply(table_VVV, tokens_BT, cache, num_valid_B)


def test_one_compilation_per_static_configuration(env):
    target = CountingTabular(V)
    drafter = drafters.ModelDrafter(TabularModel(V))
    params = decoding.EngineParams(target=env["table"], draft=random_table(jax.random.key(9), V))
    config = decoding.GenerationConfig(8, gamma=2)

    def call(prompts, key, temperature, cfg=config, stream=False):
        engine = decoding.Engine(target, drafter, cfg)          # a fresh but equal engine each call
        batch = decoding.make_batch(prompts, cfg, jax.random.key(key))
        samp = sampling.SamplingConfig.make(temperature)
        if stream:
            return list(engine.stream(params, samp, batch))[-1].output
        out = engine.run(params, samp, batch)
        jax.block_until_ready(out.tokens_BS)
        return out

    call([[1, 2, 3], [4, 5]], 0, 0.8)
    n_first = len(CountingTabular.traces)
    assert n_first > 0
    call([[6], [7, 0, 1]], 1, 1.3)           # other contents, lengths (same max), keys, temperature
    call([[2, 2, 2], [5, 1, 0]], 2, 2.0)
    assert len(CountingTabular.traces) == n_first, "retraced for new values of traced inputs"
    # the stream: init and step compile once, then never again for new values
    call([[1, 2, 3], [4, 5]], 0, 0.8, stream=True)
    n_stream = len(CountingTabular.traces)
    assert n_stream > n_first
    call([[6], [7, 0, 1]], 1, 1.3, stream=True)
    assert len(CountingTabular.traces) == n_stream, "the stream retraced for new values of traced inputs"
    # sanity: the counter does see a new static configuration (its prefill alone: cheap to compile)
    config3 = decoding.GenerationConfig(8, gamma=3)
    decoding.Engine(target, drafter, config3).init(
        params, decoding.make_batch([[1, 2, 3], [4, 5]], config3, jax.random.key(0)))
    assert len(CountingTabular.traces) > n_stream


def test_engine_rejects_a_batch_of_non_integer_ids(env):
    """A hand-built batch of float ids is named, not reduced or gathered into nonsense."""
    engine = decoding.Engine(TARGET, None, CFG_G0)
    batch = batch_for(CFG_G0, [[1, 2]])
    bad = dataclasses.replace(batch, prompt_BP=jnp.asarray(batch.prompt_BP, jnp.float32))
    with pytest.raises(ValueError, match="prompt ids must be integers"):
        engine.run(decoding.EngineParams(target=env["table"]), GREEDY, bad)
