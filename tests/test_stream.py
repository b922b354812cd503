"""`specjax.distill.ShardStream`: training batches streamed from data-engine shards.

Synthetic shard directories (random token ids, prompts of random length, answers with loss bits,
one multi-turn sequence shape with two answer spans) written by the data engine's own
`ShardDir`. Checked: one epoch covers every used sequence exactly once with its own tokens and
the mask "position t predicts token t + 1, counted where token t + 1 is a loss token"; the
stream holds at most `window` decoded shards and a batch reads only its group's shards; the
order is a pure function of the seed and the batch index (a fresh stream asked for batch i
alone gives the same batch); data-size cuts are nested prefixes; bad input is named.
"""

import json

import numpy as np
import pytest

from specjax.distill import ShardStream, shards

VOCAB = 500


def _sequences(rng, n, start_request):
    toks, masks = [], []
    for i in range(n):
        p, a = int(rng.integers(1, 40)), int(rng.integers(0, 60))
        t = rng.integers(0, VOCAB, p + a)
        m = np.r_[np.zeros(p, bool), np.ones(a, bool)]
        if i % 7 == 3 and a > 10:                      # a second user turn inside the answer: no loss there
            m[p + 4:p + 8] = False
        toks.append(t)
        masks.append(m)
    return shards.Sequences(toks, masks, ["s"] * n, list(range(start_request, start_request + n)))


def _write(directory, num_shards, per_shard, seed):
    rng = np.random.default_rng(seed)
    sd = shards.ShardDir(directory, {"stage": directory.name}, vocab_size=VOCAB, sources=["s"])
    content = []
    for k in range(num_shards):
        seqs = _sequences(rng, per_shard, k * per_shard)
        sd.write(k, seqs)
        content.append(seqs)
    return content


@pytest.fixture
def corpus(tmp_path):
    a = _write(tmp_path / "greedy", 5, 23, 0)
    b = _write(tmp_path / "sampled", 3, 17, 1)
    return tmp_path, {"greedy": a, "sampled": b}


def _stream(root, **kw):
    kw = {"seed": 3, "tokens_per_batch": 256, "widths": (32, 64), "window": 2, **kw}
    return ShardStream([root / "greedy", root / "sampled"], **kw)


def _expected_loss(m, W):
    return int(m[1:min(len(m), W)].sum())


def test_one_epoch_covers_each_sequence_once_with_its_tokens_and_mask(corpus):
    root, content = corpus
    st = _stream(root)
    W = 64
    want = {}
    for name, shard_list in content.items():
        for seqs in shard_list:
            for t, m in zip(seqs.tokens, seqs.loss_masks):
                if _expected_loss(m, W):
                    want[tuple(t[:W].tolist())] = m[:W]
    seen, loss = [], 0
    for i in range(st.batches_per_epoch):
        b = st.batch(i)
        B, Wb = b["tokens"].shape
        assert Wb in (32, 64) and B == 256 // Wb
        for r in range(B):
            mrow = b["mask"][r]
            if not mrow.any():
                assert not b["tokens"][r].any()        # a padding row
                continue
            # the row is some sequence: find it by its tokens (random ids make prefixes unique)
            keys = [k for k in want if np.array_equal(np.asarray(k[:Wb]), b["tokens"][r, :min(len(k), Wb)])
                    and len(k) <= Wb]
            assert len(keys) == 1
            k = keys[0]
            m = want[k]
            n = len(k)
            np.testing.assert_array_equal(mrow[:n - 1], m[1:n].astype(np.float32))
            assert not mrow[n - 1:].any() and not b["tokens"][r, n:].any()
            seen.append(k)
            loss += int(mrow.sum())
    assert sorted(seen) == sorted(want)                # each once, none missing
    assert loss == st.loss_tokens_used() == sum(_expected_loss(m, W) for m in want.values())
    assert st.num_sequences == len(want)


def test_long_sequences_are_cut_at_the_widest_width(tmp_path):
    sd = shards.ShardDir(tmp_path / "d", {"stage": "d"}, vocab_size=VOCAB, sources=["s"])
    t = np.arange(100) % VOCAB
    m = np.r_[np.zeros(10, bool), np.ones(90, bool)]
    sd.write(0, shards.Sequences([t], [m], ["s"], [0]))
    st = ShardStream([tmp_path / "d"], seed=0, tokens_per_batch=64, widths=(16, 64), window=1)
    b = st.batch(0)
    assert b["tokens"].shape == (1, 64)
    np.testing.assert_array_equal(b["tokens"][0], t[:64])
    assert b["mask"][0, :9].sum() == 0 and b["mask"][0, 9:63].all() and b["mask"][0, 63] == 0
    assert st.loss_tokens_used() == 54


def test_memory_is_bounded_by_the_window_and_batches_stay_in_their_group(corpus):
    root, _ = corpus
    st = _stream(root, window=2)
    for e in range(2):
        for j, (_, rows) in enumerate(st.epoch(e)):
            assert len({s for s, _ in rows}) <= 2
    for i in range(2 * st.batches_per_epoch):
        st.batch(i)
        assert len(st._cache) <= 2


def test_order_is_a_function_of_seed_and_index_and_resumes_mid_epoch(corpus):
    root, _ = corpus
    a, b = _stream(root), _stream(root)
    n = a.batches_per_epoch
    run = [a.batch(i) for i in range(n + 5)]             # into the second epoch
    for i in (n + 4, 3, n - 1, n):                         # a fresh stream asked out of order
        got = b.batch(i)
        np.testing.assert_array_equal(got["tokens"], run[i]["tokens"])
        np.testing.assert_array_equal(got["mask"], run[i]["mask"])
    other = _stream(root, seed=4)
    assert any(not np.array_equal(other.batch(i)["tokens"], run[i]["tokens"]) for i in range(3))
    # epochs differ in order
    assert [sorted(map(tuple, r)) for _, r in a.epoch(0)] != [sorted(map(tuple, r)) for _, r in a.epoch(1)]
    assert a.fingerprint() == b.fingerprint() == other.fingerprint()


def test_group_by_length_batches_similar_answers_keeps_every_sequence_and_resumes(corpus):
    """``group_by_length``: an epoch holds the same sequences as without it, each once, batches
    stay inside their window group, a batch's answers are of similar length (the mean spread of
    loss tokens within a batch below half the shuffled order's), the order is still a
    function of seed and index (a fresh stream gives batch i alone), and the fingerprint differs
    (a run cannot resume across the change)."""
    root, _ = corpus
    plain, grouped = _stream(root), _stream(root, group_by_length=True)
    rows = lambda st, e: sorted(r for _, batch in st.epoch(e) for r in map(tuple, batch))  # noqa: E731
    assert rows(grouped, 0) == rows(plain, 0) and len(set(rows(grouped, 0))) == len(rows(grouped, 0))
    assert all(len({s for s, _ in batch}) <= 2 for _, batch in grouped.epoch(0))

    def spread(st):
        out = []
        for i in range(st.batches_per_epoch):
            m = st.batch(i)["mask"]
            counts = m.sum(1)[m.any(1)]
            out.append(float(counts.max() - counts.min()) if counts.size else 0.0)
        return float(np.mean(out))
    assert spread(grouped) < spread(plain) / 2, (spread(grouped), spread(plain))
    fresh = _stream(root, group_by_length=True)
    n = grouped.batches_per_epoch
    for i in (n + 2, 1, n - 1):
        np.testing.assert_array_equal(fresh.batch(i)["tokens"], grouped.batch(i)["tokens"])
    assert grouped.fingerprint() != plain.fingerprint()


def test_data_size_cuts_are_nested_prefixes(corpus):
    root, _ = corpus
    full = _stream(root)
    sizes = [200, 600, 1500]
    sets = []
    for n in sizes:
        st = _stream(root, max_loss_tokens=n)
        assert n <= st.loss_tokens_used() < n + 64            # cut at a sequence boundary
        assert not st.complete and st.fingerprint() != full.fingerprint()
        sets.append({(st.shards[s], q) for _, rows in st.epoch(0) for s, q in rows})
    assert sets[0] < sets[1] < sets[2]
    assert _stream(root, max_loss_tokens=10 ** 9).complete


def test_token_counts_count_the_loss_tokens(corpus):
    root, content = corpus
    st = _stream(root)
    want = np.zeros(VOCAB, np.int64)
    for shard_list in content.values():
        for seqs in shard_list:
            for t, m in zip(seqs.tokens, seqs.loss_masks):
                t, m = t[:64], m[:64]
                np.add.at(want, t[1:][m[1:]], 1)
    np.testing.assert_array_equal(st.token_counts(VOCAB), want)


def test_max_prompt_leaves_out_long_prompts(corpus):
    root, content = corpus
    st = _stream(root, max_prompt=20)
    firsts = [int(np.argmax(m)) for sl in content.values() for s in sl for m in s.loss_masks if m[1:64].any()]
    assert st.num_sequences == sum(f <= 20 for f in firsts)


def test_bad_input_is_named(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(FileNotFoundError, match="no shard manifest"):
        ShardStream([root / "missing"], seed=0)
    shard = root / "sampled" / "shard-00001.npz"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00001.npz.*sha256"):
        _stream(root)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / shards.MANIFEST).write_text(json.dumps(
        {"format": shards.FORMAT, "settings": {}, "sources": ["s"], "vocab_size": VOCAB, "shards": {}}))
    with pytest.raises(ValueError, match="no shards"):
        ShardStream([tmp_path / "empty"], seed=0)
    with pytest.raises(ValueError, match="window"):
        ShardStream([root / "greedy"], seed=0, window=0)
