"""The data engine (`specjax data`, `specjax.distill.generate_data`) on a tiny random target with
SmolLM2's tokenizer: every stage's shards and manifest, the corpus report, determinism, and
resumption (a run stopped mid-stage, a shard written but not listed, a damaged shard)."""

import json
import shutil

import jax
import pytest

from specjax import decoding, distill, serving

from _cli_tiny import data_config_and_generator


@pytest.fixture(scope="module")
def tiny_generator(tmp_path_factory):
    return data_config_and_generator(tmp_path_factory)


@pytest.fixture(scope="module")
def batched_run(tiny_generator, tmp_path_factory):
    """(workdir, report) of one uninterrupted run of every stage through length-sorted batches
    (refill_rounds 0): the tests below read it and compare with it, none writes to it."""
    c, gen = tiny_generator
    workdir = tmp_path_factory.mktemp("batched")
    report = distill.generate_data(_config(c, refill_rounds=0), gen, workdir, progress=False, log=lambda s: None)
    return workdir, report


def _config(c, **kw):
    """13 Spec-Bench prompts (two of them ~700 tokens), 5 Magpie requests and 4 follow-up turns,
    5 requests a shard, batches of 4 rows. Compilation is most of this file's time, one set of
    programs per (stage sampling, rows, width, capacity): every stage generates 5 tokens (one
    engine config for all of them); the Magpie requests are one shard (no lone request of their
    sampling on a slot of its own); the follow-up turns are sampled with the answers' top-p (0.95;
    configs/data.py's have none), so their batch of 4 short prompts runs the answers' programs;
    widths and capacities round up to 256 tokens, so the short prompts (all but the two long
    ones) share one width; the long prompts are prefilled in chunks of 256 (3 and 4). The
    slot-refilling run (`_refill_config`) differs in its slots and widths only."""
    c = c.copy_and_resolve_references()
    c.spec_bench_per_category = 1
    c.batch_size, c.shard_requests, c.pad_multiple, c.prefill_chunk = 4, 5, 256, 256
    c.magpie.requests, c.magpie.max_new_tokens = 5, 5
    c.responses.max_new_tokens = 5
    c.followup.requests, c.followup.max_new_tokens, c.followup.response.max_new_tokens = 4, 5, 5
    c.followup.top_p = c.responses.top_p
    for k, v in kw.items():
        c[k] = v
    return distill.data_config(c)


def _refill_config(c, **kw):
    """`_config` with slot refilling (3 rounds per host trip) on 2 slots and widths rounded to 512:
    a shard's short prompts are one group (up to 5 requests on the 2 slots: slots are refilled)
    and its long prompt another (width 1024 for both long prompts). 2 slots and one long width,
    instead of 4 slots and widths of 256, 768 and 1024, leave fewer (rows, width) to compile."""
    return _config(c, refill_rounds=3, batch_size=2, pad_multiple=512, **kw)


def _manifests(d):
    return {s: json.loads((d / s / "manifest.json").read_text())["shards"]
            for s in distill.DATA_STAGES if (d / s / "manifest.json").is_file()}


def test_stages_shards_and_report(batched_run):
    workdir, report = batched_run
    corpus = [json.loads(line) for line in (workdir / "corpus.jsonl").read_text().splitlines()]
    total = report["corpus"]["total"]
    assert total["offered"] == 13 + 5 and total["kept"] == len(corpus) >= 13 - total["leaks"]
    assert {r["source"] for r in report["corpus"]["rows"]} >= {"spec_bench_train", "magpie"}
    assert total["offered"] == sum(total[k] for k in ("rejected", "exact_duplicates", "near_duplicates", "leaks",
                                                        "kept"))
    for stage in ("instructions", "responses_greedy", "responses_sampled", "followups"):
        seqs = [s for s in distill.shards.read_dir(workdir / stage)]
        n = sum(len(s) for s in seqs)
        assert n == report["stages"][stage]["sequences"] > 0
        for s in seqs:
            for toks, mask in zip(s.tokens, s.loss_masks):
                # the loss covers exactly the generated tail: a prefix of False, then True
                k = int(mask.argmax())
                assert not mask[:k].any() and mask[k:].all() and 1 <= mask.sum() <= 5
    assert report["stages"]["responses_greedy"]["sequences"] == len(corpus)
    assert (workdir / "REPORT.md").read_text().startswith("# Data engine report")
    _assert_generation_recorded(workdir, report, rows=4)
    # shards from before entries recorded their generation are counted apart
    m = json.loads((workdir / "responses_greedy" / "manifest.json").read_text())     # several shards (5 a shard)
    first = sorted(m["shards"])[0]
    del m["shards"][first]["generation"]
    second = sorted(m["shards"])[1]
    m["shards"][second]["generation"] = {"new_tokens": 5}          # a damaged record: not summed
    (rec,) = distill._datagen.recorded_throughput(m)
    assert rec["shards_unrecorded"] == 2 and rec["shards"] == len(m["shards"]) - 2


def _assert_generation_recorded(workdir, report, rows):
    """Every shard's manifest entry records its generation (its new tokens are its loss tokens:
    the loss covers exactly the generated tail), and the report sums them per CPU."""
    for stage, entries in _manifests(workdir).items():
        for e in entries.values():
            g = e["generation"]
            assert g["new_tokens"] == e["loss_tokens"] and g["seconds"] > 0 and 1 <= g["max_rows"] <= rows
            assert g["prompt_tokens"] == e["tokens"] - e["loss_tokens"] and g["batches"] >= 1
        (rec,) = report["stages"][stage]["recorded"]
        assert rec["new_tokens"] == report["stages"][stage]["loss_tokens"] and rec["shards_unrecorded"] == 0
        assert rec["shards"] == len(entries) and rec["new_tokens_per_s"] > 0
    assert "Generation throughput, every run" in (workdir / "REPORT.md").read_text()


@pytest.mark.parametrize("refill_rounds", [0, 3])
def test_resume_gives_the_same_shards(tiny_generator, batched_run, tmp_path, monkeypatch, refill_rounds):
    """Length-sorted batches (refill_rounds 0) and slot refilling (`_refill_config`: 2 slots,
    widths of 512 where the batches have 4 rows and widths of 256): a run killed mid-stage and
    resumed writes the shards of an uninterrupted run, the shared length-sorted one
    (`batched_run`): for slot refilling, every shard of the resumed run is also one of the other
    path, so both generation paths (and both row counts and paddings) write the same shards (each
    request keyed by its id)."""
    c, gen = tiny_generator
    rows = 2 if refill_rounds else 4
    cfg = _refill_config(c) if refill_rounds else _config(c, refill_rounds=0)
    whole = batched_run[0]
    # A run that dies in its third call of generation ...
    resumed = tmp_path / "resumed"
    module, name = (serving, "generate_offline") if refill_rounds else (decoding, "generate_batched")
    real, calls = getattr(module, name), [0]

    def dying_batches(*a, **k):
        for out in real(*a, **k):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt("killed")
            yield out

    def dying_call(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)
    monkeypatch.setattr(module, name, dying_call if refill_rounds else dying_batches)
    with pytest.raises(KeyboardInterrupt):
        distill.generate_data(cfg, gen, resumed, progress=False, log=lambda s: None)
    monkeypatch.setattr(module, name, real)
    assert len(_manifests(resumed).get("instructions", {})) >= 1
    # ... and a shard written but never listed (a kill between the file and the manifest)
    d = resumed / "instructions"
    m = json.loads((d / "manifest.json").read_text())
    last = sorted(m["shards"])[-1]
    del m["shards"][last]
    (d / "manifest.json").write_text(json.dumps(m))
    logs = []
    report = distill.generate_data(cfg, gen, resumed, progress=False, log=logs.append)
    _assert_generation_recorded(resumed, report, rows=rows)
    assert (d / (last + ".unlisted")).is_file() and any("set aside" in s for s in logs)
    a, b = _manifests(whole), _manifests(resumed)
    assert {s: {k: v["sha256"] for k, v in e.items()} for s, e in a.items()} == \
        {s: {k: v["sha256"] for k, v in e.items()} for s, e in b.items()}
    # a damaged shard is named, not trusted
    shard = resumed / "responses_greedy" / "shard-00000.npz"
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    with pytest.raises(ValueError, match="shard-00000.npz.*sha256"):
        distill.generate_data(cfg, gen, resumed, progress=False, log=lambda s: None)
    # other settings in the same directory are refused, naming the setting
    shutil.rmtree(resumed / "responses_greedy")
    with pytest.raises(ValueError, match="max_new_tokens"):
        distill.generate_data(_with(cfg, magpie_tokens=7), gen, resumed,
                              progress=False, log=lambda s: None)


def _with(cfg, magpie_tokens):
    import dataclasses
    return dataclasses.replace(cfg, magpie=dataclasses.replace(cfg.magpie, max_new_tokens=magpie_tokens))


def test_bad_settings_fail_before_loading(tiny_generator):
    c, _ = tiny_generator
    for key, value, match in (("batch_size", 0, "batch_size"), ("shard_requests", -1, "shard_requests")):
        bad = c.copy_and_resolve_references()
        bad[key] = value
        with pytest.raises(ValueError, match=match):
            distill.data_config(bad)
    bad = c.copy_and_resolve_references()
    bad.responses.top_p = 1.5
    with pytest.raises(ValueError, match="top_p"):
        distill.data_config(bad)


def test_corpus_rules():
    """The cleaning steps in order, each counted: a long curated prompt is kept, a long generated
    one rejected; exact and near duplicates and 8-gram leaks dropped."""
    long_text = " ".join(f"word{i}" for i in range(900))           # > MAX_CHARS characters
    base = "please write a short poem about the quiet sea at night under the stars"
    cands = [distill.Candidate(long_text, "spec_bench_train", "summarization"),
             distill.Candidate(long_text + " more", "magpie", "writing", generated=True),
             distill.Candidate(base, "magpie", "writing", generated=True),
             distill.Candidate(base.upper() + "!", "magpie", "writing", generated=True),           # exact (normalized)
             distill.Candidate(base + " please", "magpie", "writing", generated=True),             # near duplicate
             distill.Candidate("unfinished request text here", "magpie", "qa", finished=False, generated=True),
             distill.Candidate("tell me how the held out question about rivers and lakes is answered", "magpie",
                               "qa", generated=True)]
    kept, report = distill.build_corpus(cands, ["the held out question about rivers and lakes is answered well"])
    assert [c.text for c in kept] == [long_text, base]
    t = report["total"]
    assert (t["rejected"], t["exact_duplicates"], t["near_duplicates"], t["leaks"], t["kept"]) == (2, 1, 1, 1, 2)
