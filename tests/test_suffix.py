"""Suffix decoding across requests (`specjax.drafters.SuffixDrafter`, drafter kind ``suffix``).

* proposals against a NumPy transcription of the rule (longest suffix match over the row's own
  tokens and the corpus, then the most frequent continuation, greedily), 300 random cases;
* the host cache: a ring that overwrites its oldest documents, saved and loaded (a cut-off save
  leaves the previous file; a corrupt file is refused by name);
* exactness: greedy speculation with the suffix drafter equals target-only greedy (tiny Llama,
  chat-like prompts); at T = 1 on the tabular toy pair (V = 3, N = 6 new tokens, 20 000 rows,
  a corpus of earlier outputs), the 6-token law against the exact target law by chi-square,
  false-alarm rate 1e-4; fixed seeds;
* learning across requests: through the slot scheduler with ``draft_update``, a request repeated
  after it finished is drafted from its own earlier output (every round fully accepted), and
  `specjax generate` with ``suffix_cache_dir`` keeps a run for the next (`_after_run`);
* the suffix-hybrid (`HybridDrafter` with a suffix lookup half): suffix decoding where the
  context's suffix matches the request or the corpus, an EAGLE head elsewhere; greedy equal to
  target-only under adaptive gamma, the rule reading the corpus from the params; built by the
  'hybrid' kind with ``hybrid_lookup='suffix'``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, sampling, serving
from specjax.drafters import SuffixCache, SuffixDrafter

from _tabular import support_chisquare
from _toy import TabularModel, random_table, sequence_probs


def _reference(own, corpus_docs, gamma, max_match, min_match):
    """The rule by hand: sequences = the row's own tokens (matches must end before its last
    token) and each corpus document."""
    L = len(own)
    best, cands = 0, []
    seqs = [("own", own)] + [("doc", d) for d in corpus_docs]
    for kind, seq in seqs:
        for i in range(len(seq)):
            if kind == "own" and i >= L - 1:
                continue
            if i + 1 >= len(seq):
                continue                     # no continuation
            n = 0
            while n < max_match and i - n >= 0 and L - 1 - n >= 0 and seq[i - n] == own[L - 1 - n]:
                n += 1
            if n < min_match or n == 0:
                continue
            if n > best:
                best, cands = n, []
            if n == best:
                cands.append((seq, i))
    out, prev = [], own[-1]
    for j in range(gamma):
        nxt = [seq[i + 1 + j] for seq, i in cands if i + 1 + j < len(seq)]
        if nxt:
            counts = np.bincount(nxt)
            tok = int(np.argmax(counts))
            cands = [(seq, i) for seq, i in cands if i + 1 + j < len(seq) and seq[i + 1 + j] == tok]
        else:
            tok, cands = prev, []
        out.append(tok)
        prev = tok
    return out


@functools.cache
def _jit_propose(drafter, gamma):
    """The drafter's proposal jitted (one program per max_match; op by op, every case would
    dispatch each of its operations)."""
    return jax.jit(lambda corpus, ctx: drafter.propose(corpus, None, ctx, None, gamma, None))


def test_proposals_follow_the_rule():
    rng = np.random.default_rng(0)
    V, S, gamma = 6, 24, 4
    for case in range(300):
        docs = [rng.integers(0, V, rng.integers(1, 12)).tolist() for _ in range(rng.integers(0, 5))]
        cache = SuffixCache(64)
        for d in docs:
            cache.add(d)
        B = 3
        lens = rng.integers(1, S, B)
        toks = np.zeros((B, S), np.int32)
        for b in range(B):
            toks[b, :lens[b]] = rng.integers(0, V, lens[b])
        max_match, min_match = int(rng.integers(1, 5)), 1
        drafter = SuffixDrafter(V, max_match=max_match, min_match=min_match)
        ctx = drafters.DraftContext(tokens_BS=jnp.asarray(toks), lengths_B=jnp.asarray(lens, jnp.int32),
                                    target_cache=None)
        got, q, _ = _jit_propose(drafter, gamma)(cache.corpus(), ctx)
        assert np.asarray(q).sum(-1).tolist() == [[1.0] * gamma] * B
        for b in range(B):
            want = _reference(toks[b, :lens[b]].tolist(), docs, gamma, max_match, min_match)
            assert np.asarray(got)[b].tolist() == want, (case, b, toks[b, :lens[b]].tolist(), docs)


def test_the_cache_is_a_ring_saved_and_loaded(tmp_path):
    cache = SuffixCache(10)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6, 7])
    assert cache.tokens_M.tolist() == [1, 2, 3, -1, 4, 5, 6, 7, -1, -1]
    cache.add([8, 9])                             # does not fit before the end: starts again at 0
    assert cache.tokens_M.tolist() == [8, 9, -1, -1, 4, 5, 6, 7, -1, -1]
    cache.add(list(range(20, 40)))                # longer than the ring: its last 9 tokens
    assert cache.tokens_M.tolist()[:10] == list(range(31, 40)) + [-1]
    cache = SuffixCache(16)
    cache.add([1, 2, 3])
    cache.add([4, 5])
    cache.save(tmp_path)
    again = SuffixCache.load(tmp_path, 16)
    assert again.tokens_M.tolist() == cache.tokens_M.tolist()
    small = SuffixCache.load(tmp_path, 4)         # a smaller ring keeps the newest documents
    assert small.tokens_M.tolist() == [4, 5, -1, -1]
    assert SuffixCache.load(tmp_path / "none", 8).tokens_M.tolist() == [-1] * 8
    (tmp_path / "suffix_cache.tmp.npz").write_bytes(b"cut off")     # a save cut off midway
    assert SuffixCache.load(tmp_path, 16).tokens_M.tolist() == cache.tokens_M.tolist()
    typed = SuffixCache(16, vocab_size=50)
    typed.add([1, 49])
    with pytest.raises(ValueError, match=r"token ids in \[0, 49\]"):
        typed.add([50])
    typed.save(tmp_path / "typed")
    assert SuffixCache.load(tmp_path / "typed", 16, vocab_size=50).tokens_M.tolist()[:3] == [1, 49, -1]
    with pytest.raises(ValueError, match="a suffix cache of a 50-token vocabulary; this target has 64"):
        SuffixCache.load(tmp_path / "typed", 16, vocab_size=64)
    assert SuffixCache.load(tmp_path / "typed", 16).vocab_size == 50        # kept when not given
    (tmp_path / "suffix_cache.npz").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="suffix_cache.npz: not a suffix cache"):
        SuffixCache.load(tmp_path, 16)


V = 3
N_NEW = 6
ROWS = 20_000
PROMPT = (2, 1)


def test_sampled_output_follows_the_target_law():
    """T = 1 on the tabular toy pair: the suffix drafter's one-hot proposals from a corpus of
    earlier outputs keep the law of the 6-token continuation the target's."""
    target = random_table(jax.random.key(10), V, peak=2.0)
    cache = SuffixCache(256)
    for seq in ([2, 1, 0, 2, 2, 1, 0], [1, 0, 2, 2, 1], [0, 0, 1, 2]):
        cache.add(seq)
    config = decoding.GenerationConfig(max_new_tokens=N_NEW, gamma=3)
    engine = decoding.Engine(TabularModel(V), SuffixDrafter(V, max_match=3), config)
    batch = decoding.make_batch([list(PROMPT)] * ROWS, config, jax.random.key(7))
    out = engine.run(decoding.EngineParams(target=target, draft=cache.corpus()), sampling.SamplingConfig.make(1.0),
                     batch)
    gen = np.asarray(out.tokens_BS)[:, len(PROMPT):len(PROMPT) + N_NEW]
    exact = sequence_probs(target, PROMPT, N_NEW, lambda t: sampling.probabilities(t, sampling.SamplingConfig.make(1.0)))
    cells = list(itertools.product(range(V), repeat=N_NEW))
    law = np.array([exact[c] for c in cells])
    p, impossible, n_cells = support_chisquare(np.bincount(gen @ (V ** np.arange(N_NEW - 1, -1, -1)),
                                                           minlength=len(cells)), law / law.sum())
    m = out.metrics.summary()
    assert impossible == 0 and n_cells > 20 and 0 < m["accepted"] < m["proposed"]
    assert p > 1e-4, p


@pytest.fixture(scope="module")
def tiny():
    from _heads_common import _target
    return _target()


def test_greedy_equals_target_only_and_requests_learn_from_earlier_ones(tiny):
    """A tiny Llama through the slot scheduler: greedy answers with the suffix drafter equal
    target-only's; with ``draft_update`` adding each finished request to the corpus, a prompt
    seen before is drafted from its earlier answer and every round is fully accepted."""
    model, params = tiny
    prompts = [[5, 6, 7, 8], [9, 3, 4], [5, 6, 7, 8], [9, 3, 4]]
    gamma, new = 3, 12
    config = decoding.GenerationConfig(max_new_tokens=new, gamma=gamma)
    ref = decoding.Engine(model, None, decoding.GenerationConfig(max_new_tokens=new, gamma=0))
    want = ref.run(decoding.EngineParams(target=params), sampling.SamplingConfig.greedy_config(),
                   decoding.make_batch(prompts[:2], ref.config, jax.random.key(0))).generated()
    cache = SuffixCache(512)
    engine = decoding.Engine(model, SuffixDrafter(model.vocab_size, max_match=4), config)
    sched = serving.Scheduler(engine, decoding.EngineParams(target=params, draft=cache.corpus()), slots=1)

    def learn(request, result):
        cache.add(list(request.prompt) + list(result.tokens))
        return cache.corpus()

    reqs = [serving.Request(id=i, prompt=p, arrival_s=0.0) for i, p in enumerate(prompts)]
    out = sched.run(reqs, sampling.SamplingConfig.greedy_config(), jax.random.key(0), draft_update=learn)
    got = {r.id: r.tokens for r in out.results}
    assert [got[i] for i in range(4)] == want + want
    first, again = out.results[0].counters, out.results[2].counters
    assert again["accepted"] == again["proposed"] and again["accepted"] >= new - gamma - 1
    assert again["target_passes"] < first["target_passes"]


def test_generate_keeps_a_run_for_the_next_with_a_cache_dir(tmp_path, monkeypatch, capsys):
    """`specjax generate --config.drafter=suffix --config.suffix_cache_dir=D` on a tiny target,
    twice: the first run writes its prompt and answer to D, the second drafts from them (every
    proposal accepted) and prints the same answer."""
    import json
    import os

    import _cli_tiny
    from specjax import cli
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target, _ = _cli_tiny.write_pair(tmp_path / "pair")
    cache = tmp_path / "cache"
    runs = []
    for i in range(2):
        stats = tmp_path / f"stats{i}.jsonl"
        assert cli.dispatch(["specjax", "generate", "--config=configs/generate.py", f"--config.target={target}",
                             "--config.drafter=suffix", f"--config.suffix_cache_dir={cache}",
                             "--config.adaptive_gamma=False", "--config.gamma=3", "--config.max_new_tokens=12",
                             "--config.compilation_cache_dir=", "--config.calibration_cache=",
                             f"--config.metrics_jsonl={stats}"]) == 0
        runs.append(json.loads(stats.read_text()))
        assert (cache / "suffix_cache.npz").exists()
    capsys.readouterr()
    assert runs[1]["same_tokens_as_target_only"] is True and runs[1]["suffix_cache_dir"] == str(cache)
    assert runs[1]["accepted"] == runs[1]["proposed"] > runs[0]["accepted"]
    assert runs[1]["target_passes"] < runs[0]["target_passes"]


def test_suffix_hybrid_drafts_from_the_corpus_where_it_matches_and_the_head_elsewhere(tiny):
    """The suffix-hybrid through the slot scheduler (1 slot, adaptive gamma 0 / 1 / 3, greedy):
    every answer equals target-only's; a repeated prompt is drafted from the corpus (more
    proposals accepted, fewer target passes than its first time); the rows the corpus does not match
    draft with the head (its proposals accepted somewhere). The regime rule reads the corpus:
    the same context is a lookup row with the corpus and a model row without it."""
    from _heads_common import _head
    model, params = tiny
    head, hp = _head("eagle", "good")
    prompts = [[5, 6, 7, 8], [9, 3, 4], [5, 6, 7, 8], [9, 3, 4]]
    new = 12
    ref = decoding.Engine(model, None, decoding.GenerationConfig(max_new_tokens=new, gamma=0))
    want = ref.run(decoding.EngineParams(target=params), sampling.SamplingConfig.greedy_config(),
                   decoding.make_batch(prompts[:2], ref.config, jax.random.key(0))).generated()
    cache = SuffixCache(512, model.vocab_size)
    hybrid = drafters.HybridDrafter(SuffixDrafter(model.vocab_size, max_match=4), head, min_match=2,
                                    lookup_params=True)
    config = decoding.GenerationConfig(max_new_tokens=new, gamma=decoding.AdaptiveGamma(gammas=(0, 1, 3)))
    engine = decoding.Engine(model, hybrid, config)
    dparams = drafters.HybridParams(model=hp, lookup=cache.corpus())
    sched = serving.Scheduler(engine, decoding.EngineParams(target=params, draft=dparams), slots=1,
                              round_time_s=(1.0, 1.1, 1.3, 0.5, 0.6, 0.7))

    def learn(request, result):
        cache.add(list(request.prompt) + list(result.tokens))
        return dparams.replace(lookup=cache.corpus())

    reqs = [serving.Request(id=i, prompt=p, arrival_s=0.0) for i, p in enumerate(prompts)]
    out = sched.run(reqs, sampling.SamplingConfig.greedy_config(), jax.random.key(0), draft_update=learn)
    got = {r.id: r.tokens for r in out.results}
    assert [got[i] for i in range(4)] == want + want
    first, again = out.results[0].counters, out.results[2].counters
    assert again["accepted"] > first["accepted"] and again["target_passes"] < first["target_passes"]
    assert sum(r.counters["accepted"] for r in out.results[:2]) > 0
    # the rule: the first prompt's context after its first answer token matches the corpus (it
    # holds that answer), not the request alone
    row = list(prompts[0]) + want[0][:3]
    ctx = drafters.DraftContext(tokens_BS=jnp.asarray([row + [0] * 8], jnp.int32),
                                lengths_B=jnp.asarray([len(row)], jnp.int32), target_cache=None)
    with_corpus = drafters.HybridParams(model=hp, lookup=cache.corpus())
    without = drafters.HybridParams(model=hp, lookup=SuffixCache(512, model.vocab_size).corpus())
    regime = jax.jit(hybrid.regime_B)           # one program for both corpora (op by op: every operation)
    assert int(regime(with_corpus, ctx)[0]) == hybrid.LOOKUP
    assert int(regime(without, ctx)[0]) == hybrid.MODEL
    with pytest.raises(ValueError, match=r"give HybridParams\(model=..., lookup=...\), got dict"):
        hybrid.regime_B(hp, ctx)                 # the head's params alone: the corpus is missing


def test_the_hybrid_kind_builds_a_suffix_lookup(tiny, tmp_path):
    """drafter='hybrid' with hybrid_lookup='suffix': a suffix lookup half over the cache
    directory's corpus (loaded) and the head; an unknown lookup is refused by name."""
    from _heads_common import CFG
    model, params = tiny
    hc = drafters.HeadConfig.make("eagle", CFG)
    drafters.save_head(tmp_path / "head", hc, drafters.init_head_params(hc, jax.random.key(0)))
    drafters.remember(str(tmp_path / "cache"), 64, [[1, 2, 3, 4]])
    ctx = drafters.BuildContext(target=model, target_params=params, target_name="tiny")
    kind = drafters.drafter_kind("hybrid")
    s = kind.settings_from({"hybrid_lookup": "suffix", "draft_model": str(tmp_path / "head"), "suffix_tokens": 64,
                            "suffix_cache_dir": str(tmp_path / "cache")})
    kind.check(s, drafters.DraftJob(target="tiny"))
    dr, dp = kind.build(s, ctx)
    assert isinstance(dr.retrieval, SuffixDrafter) and dr.lookup_params and dr.min_match == 3
    assert isinstance(dp, drafters.HybridParams)
    assert np.asarray(dp.lookup.tokens_M).tolist()[:5] == [1, 2, 3, 4, -1]
    with pytest.raises(ValueError, match="hybrid_lookup='trie': expected one of ngram, suffix"):
        kind.check(kind.settings_from({"hybrid_lookup": "trie", "draft_model": "x"}), drafters.DraftJob(target="tiny"))


def test_the_cache_directory_survives_faults(tmp_path, monkeypatch):
    """A cache directory that is a file is refused before anything runs (it would read as an
    empty corpus); a save that runs out of disk keeps the previous cache whole and leaves no
    temporary file; runs that finish together each add their documents (the lock)."""
    import errno
    import threading

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"suffix_cache_dir='.*file': .*file, not a directory"):
        drafters.check_cache_dir(drafters.SuffixSettings(suffix_cache_dir=str(blocker)))
    with pytest.raises(ValueError, match=r"suffix_cache_dir='.*file/sub': "):
        drafters.check_cache_dir(drafters.SuffixSettings(suffix_cache_dir=str(blocker / "sub")))
    d = tmp_path / "cache"
    drafters.remember(str(d), 64, [[1, 2, 3]])
    before = (d / "suffix_cache.npz").read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(OSError, match=r"suffix_cache.npz not updated \(No space left on device\); the previous"):
        drafters.remember(str(d), 64, [[4, 5]])
    monkeypatch.undo()
    assert (d / "suffix_cache.npz").read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["suffix_cache.lock", "suffix_cache.npz"]
    threads = [threading.Thread(target=lambda k=k: [drafters.remember(str(d), 4096, [[10 + k, i]]) for i in range(15)])
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert SuffixCache.load(d, 4096).documents == 1 + 30


def test_the_suffix_hybrids_min_match_is_checked_against_the_suffix_lookup():
    """min_match is checked against what the suffix lookup can match, not the n-gram range."""
    kind = drafters.drafter_kind("hybrid")
    s = kind.settings_from({"hybrid_lookup": "suffix", "min_match": 9, "suffix_max_match": 8})
    job = type("Job", (), {"trees": (), "target": "smollm2-135m-instruct", "tree_setting": "tree", "tree_value": ""})()
    with pytest.raises(ValueError, match=r"min_match=9: with hybrid_lookup='suffix' expected an integer in .*\[1, 8\]"):
        kind.check(s, job)
