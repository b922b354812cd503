"""Bad input to the data engine and its shards (issue 53, data items 2, 4, 8, 12, 13, 14, 17, 18).

Each bad input is one error of a type the CLI shows as one line (ValueError, FileNotFoundError,
`specjax.files.WorkdirBusy`) naming the file, key or value, and nothing already written is lost
(a refused resume leaves every byte of the workdir as it was). The engine runs on a tiny random
target with SmolLM2's tokenizer (13 Spec-Bench prompts, 3 answer tokens each, one stage).
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, distill, files, models
from specjax.distill import ShardFeatures, ShardStream, shards

from _cli_tiny import _config as tiny_model_config
from _cli_tiny import data_config_and_generator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return data_config_and_generator(tmp_path_factory)


def _cfg(c, **kw):
    """13 Spec-Bench prompts (one per category), greedy answers of 3 tokens, 5 requests a shard:
    the responses_greedy stage only."""
    c = c.copy_and_resolve_references()
    c.spec_bench_per_category = 1
    c.batch_size, c.shard_requests, c.pad_multiple, c.prefill_chunk = 8, 5, 32, 64
    c.magpie.requests = 0
    c.responses.sampled, c.responses.max_new_tokens = False, 3
    c.followup.requests = 0
    for k, v in kw.items():
        c[k] = v
    return distill.data_config(c)


def _snapshot(directory) -> dict:
    """Every file's bytes under `directory` (the lock file, rewritten by whoever holds it, aside)."""
    d = pathlib.Path(directory)
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != files.LOCK_NAME}


def _quiet(_):
    pass


# ----------------------------------------------------------------------------- item 2: row status

def test_a_nan_target_stops_with_no_usable_row_and_keeps_what_it_wrote(tiny, tmp_path):
    """Before: a target whose logits are NaN gave shards of prompts with no answers
    ("responses_greedy 13 seqs / 0 loss tokens"), exit 0, no warning. Now every request it
    ends with status nan_logits is dropped and counted, and the stage stops with one error
    naming the status; the shard written stays listed, and a rerun stops again before
    generating anything."""
    c, gen = tiny
    nan = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, gen.params.target)
    broken = dataclasses.replace(gen, params=gen.params.replace(target=nan))
    with pytest.raises(ValueError, match=r"responses_greedy: 5 of the 5 requests so far did not finish normally "
                                         r"\(5 nan_logits: the target's logits were not finite.*no usable row"):
        distill.generate_data(_cfg(c), broken, tmp_path, progress=False, log=_quiet)
    m = json.loads((tmp_path / "responses_greedy" / "manifest.json").read_text())
    (entry,) = m["shards"].values()
    assert entry["sequences"] == 0 and entry["dropped"] == {"nan_logits": 5} and entry["requests"] == [0, 5]
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="nan_logits"):
        distill.generate_data(_cfg(c), broken, tmp_path, progress=False, log=_quiet)
    assert _snapshot(tmp_path) == before


def test_rows_that_do_not_finish_normally_are_dropped_counted_and_bounded(tiny, tmp_path, monkeypatch):
    """Before: a row the engine stopped early (status nan_logits, a partly broken target) became
    training data, truncated. Now it is left out of its shard, counted per status in the shard's
    manifest entry, the stage's log line and the report; above max_dropped_fraction the stage
    stops, keeping its shards; a rerun that accepts more resumes from them."""
    c, gen = tiny
    real = decoding.generate_batched

    def one_breaks(*a, **k):               # request 7 ends after one token with non-finite logits
        ids = k["request_ids"]
        for results, rep in real(*a, **k):
            for r in results:
                if ids[r.index] == 7:
                    r.status, r.tokens = "nan_logits", r.tokens[:1]
            yield results, rep
    monkeypatch.setattr(decoding, "generate_batched", one_breaks)
    with pytest.raises(ValueError, match=r"responses_greedy: 1 of the 10 requests so far did not finish normally "
                                         r"\(1 nan_logits.*more than max_dropped_fraction=0.05"):
        distill.generate_data(_cfg(c), gen, tmp_path, progress=False, log=_quiet)
    m = json.loads((tmp_path / "responses_greedy" / "manifest.json").read_text())
    assert sorted(m["shards"]) == ["shard-00000.npz", "shard-00001.npz"]          # kept
    logs = []
    report = distill.generate_data(_cfg(c, max_dropped_fraction=0.5), gen, tmp_path, progress=False,
                                   log=logs.append)
    e = json.loads((tmp_path / "responses_greedy" / "manifest.json").read_text())["shards"]
    assert e["shard-00001.npz"]["dropped"] == {"nan_logits": 1} and e["shard-00001.npz"]["sequences"] == 4
    assert e["shard-00000.npz"]["dropped"] == {} and e["shard-00002.npz"]["sequences"] == 3
    seqs = shards.read_dir(tmp_path / "responses_greedy")
    requests = [r for s in seqs for r in s.requests]
    assert requests == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]                      # 7 is not data
    stage = report["stages"]["responses_greedy"]
    assert stage["sequences"] == 12 and stage["dropped"] == {"nan_logits": 1}
    assert any("'dropped': {'nan_logits': 1}" in line for line in logs)
    assert "| 1 nan_logits |" in (tmp_path / "REPORT.md").read_text()
    # a resume whose corpus changed (here: a prompt banned by eval_prompts) is refused before
    # corpus.jsonl is replaced
    first = json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])["text"]
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"responses_greedy/manifest.json: its shards answer another corpus"):
        distill.generate_data(dataclasses.replace(_cfg(c, max_dropped_fraction=0.5), eval_texts=(first,)), gen,
                              tmp_path, progress=False, log=_quiet)
    assert _snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- item 4: target digest

def test_a_resume_with_other_weights_at_the_same_path_is_refused(tiny, tmp_path):
    """Before: shard settings recorded the target's path only; a resume after its weights
    changed listed new shards beside the old weights' shards. Now every stage records the
    sha256 of the target's files, and a resume with other weights is refused before anything
    changes, naming both digests and a new workdir; every byte of the workdir is kept."""
    c, gen = tiny
    target = tmp_path / "target"
    shutil.copytree(c.generate.target, target)
    cfg = dataclasses.replace(_cfg(c), target=str(target))
    work = tmp_path / "work"
    distill.generate_data(cfg, gen, work, progress=False, log=_quiet)
    # the same path, other weights
    model = models.Llama(tiny_model_config(2))
    models.export_hf(model, model.init_params(jax.random.key(7)), target)
    before = _snapshot(work)
    with pytest.raises(ValueError, match="made with target weights sha256 '([0-9a-f]{64})', this run has "
                                         "'([0-9a-f]{64})'.*new --workdir") as e:
        distill.generate_data(cfg, gen, work, progress=False, log=_quiet)
    assert _snapshot(work) == before
    m = json.loads((work / "responses_greedy" / "manifest.json").read_text())
    assert len(m["shards"]) == 3
    new, _ = distill._datagen.target_digest(str(target))
    assert f"sha256 '{m['settings']['target_sha256']}', this run has '{new}'" in str(e.value)
    assert new != m["settings"]["target_sha256"]


def test_a_manifest_from_before_digests_is_adopted_and_other_digests_refused(tmp_path):
    """A stage directory written before the digest was recorded (same other settings) is resumed
    and the digest recorded, with a log line; a recorded digest that differs is refused by the
    directory itself, naming both, with the directory untouched."""
    sd = shards.ShardDir(tmp_path / "s", {"stage": "s"}, vocab_size=50, sources=["a"])
    sd.write(0, shards.Sequences([np.arange(5)], [np.r_[False, True, True, True, True]], ["a"], [0]))
    logs = []
    sd = shards.ShardDir(tmp_path / "s", {"stage": "s", "target_sha256": "a" * 64}, vocab_size=50, sources=["a"],
                         log=logs.append, recorded_later=("target_sha256",))
    assert sd.done(0) and any("recorded them now" in line for line in logs)
    assert shards.read_manifest(tmp_path / "s")["settings"]["target_sha256"] == "a" * 64
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="made with target weights sha256 'a{64}', this run has 'b{64}'; new dir"):
        shards.ShardDir(tmp_path / "s", {"stage": "s", "target_sha256": "b" * 64}, vocab_size=50, sources=["a"],
                        recorded_later=("target_sha256",),
                        describe={"target_sha256": ("target weights sha256", "new dir")})
    assert _snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- item 8: the lock

def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_holder(tiny, tmp_path):
    """Before: `specjax data` took no lock; runs on one workdir renamed each other's manifests
    and set a live run's shards aside. Now a run holds the workdir's lock throughout: another
    holder (another process, or another open of the lock in this one) gets WorkdirBusy naming
    it, before anything in the workdir is touched; the lock is free again once its holder
    is gone or the run has ended (here: ended by an error)."""
    c, gen = tiny
    work = tmp_path / "work"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from specjax import files\n"
                               "with files.workdir_lock(sys.argv[1], 'specjax data'):\n"
                               "    print('held', flush=True); sys.stdin.read()", str(work)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(files.WorkdirBusy, match=f"in use by specjax data \\(pid {holder.pid} "):
            distill.generate_data(_cfg(c), gen, work, progress=False, log=_quiet)
        assert [p.name for p in work.iterdir()] == [files.LOCK_NAME]              # nothing touched
    finally:
        holder.kill()                     # a killed holder releases the lock
        holder.wait()
    with files.workdir_lock(work, "holder in this process"):
        with pytest.raises(files.WorkdirBusy, match=f"holder in this process \\(pid {os.getpid()} "):
            distill.generate_data(_cfg(c), gen, work, progress=False, log=_quiet)
    # a run that ends with an error releases the lock
    no_eos = dataclasses.replace(gen, engine=dataclasses.replace(
        gen.engine, config=dataclasses.replace(gen.engine.config, eos_ids=())))
    with pytest.raises(ValueError, match="end-of-turn ids"):
        distill.generate_data(_cfg(c), no_eos, work, progress=False, log=_quiet)
    with files.workdir_lock(work, "after"):
        pass


# ----------------------------------------------------------------------------- item 14: empty corpus

def test_an_empty_corpus_is_refused_before_running(tiny):
    """Before: magpie.requests=0 with spec_bench_train=False ran every stage on nothing and
    reported success. Now the settings are refused, naming both."""
    c, _ = tiny
    bad = c.copy_and_resolve_references()
    bad.magpie.requests, bad.spec_bench_train = 0, False
    with pytest.raises(ValueError, match=r"magpie.requests=0 and spec_bench_train=False: the corpus would be empty"):
        distill.data_config(bad)


# ----------------------------------------------------------------------------- items 12, 17: eval_prompts

@pytest.mark.parametrize("lines, match", [
    ([b'{"text": "a fine prompt"}', b'{"prompt": "x"}'], r":2: no 'turns' or 'text' \(keys: \['prompt'\]\)"),
    ([b'{"turns": []}'], r":1: 'turns' = \[\]: expected a non-empty list of strings"),
    ([b'{"turns": ["ok", 3]}'], r":1: 'turns' holds 3, not a string"),
    ([b'{"text": 5}'], r":1: 'text' = 5: expected a string"),
    ([b'["a list"]'], r":1: a JSON list, expected an object"),
    ([b'{"text": "a"}', b'', b'{"text": "b"'], r":3: not JSON \("),
    ([b'{"text": "a"}', b'{"text": "caf\xe9"}'], r":2: not UTF-8 \(byte 0xe9"),
])
def test_bad_eval_prompts_name_the_file_and_line(tiny, tmp_path, lines, match):
    """Before: a line without text was a KeyError, `turns: []` an IndexError, a non-string turn
    went on into the corpus cleaning, bad JSON or latin-1 bytes a decoder error not naming the
    file. Now: one ValueError naming the file, the line and what is wrong."""
    c, _ = tiny
    path = tmp_path / "eval.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    bad = c.copy_and_resolve_references()
    bad.eval_prompts = str(path)
    with pytest.raises(ValueError, match=f"eval_prompts {path}{match}"):
        distill.data_config(bad)


def test_good_eval_prompts_are_read(tiny, tmp_path):
    c, _ = tiny
    path = tmp_path / "eval.jsonl"
    path.write_text('{"turns": ["first", "second"]}\n\n{"text": "plain"}\n', encoding="utf-8")
    good = c.copy_and_resolve_references()
    good.eval_prompts = str(path)
    assert distill.data_config(good).eval_texts == ("first", "plain")


# ----------------------------------------------------------------------------- items 12, 18: manifests

def _shard_dir(directory, vocab=50, sources=("a",), ids=(1, 2, 3, 4)):
    sd = shards.ShardDir(directory, {"stage": "s"}, vocab_size=vocab, sources=list(sources))
    t = np.asarray(ids)
    sd.write(0, shards.Sequences([t], [np.r_[False, np.ones(len(t) - 1, bool)]], [sources[-1]], [0]))
    return directory / shards.MANIFEST


def _edit(manifest, change):
    m = json.loads(manifest.read_text())
    change(m)
    manifest.write_text(json.dumps(m))


@pytest.mark.parametrize("change, match", [
    (lambda m: m.pop("settings"), r"no 'settings'"),
    (lambda m: m.update(shards=list(m["shards"])), r"'shards' is a JSON list, expected an object"),
    (lambda m: m["shards"]["shard-00000.npz"].pop("sha256"), r"the entry of shard-00000.npz has no 'sha256'"),
    (lambda m: m["shards"]["shard-00000.npz"].update(sequences="1"),
     r"the entry of shard-00000.npz has 'sequences' = '1': expected an integer >= 0"),
    (lambda m: m.update(vocab_size=None), r"'vocab_size' = None"),
    (lambda m: m.update(sources="a"), r"'sources' is a JSON str"),
])
def test_malformed_manifests_are_named(tmp_path, change, match):
    """Before: a manifest without settings, with `shards` a list or an entry without sha256
    raised KeyError / AttributeError (a traceback) on resume and when streamed. Now one
    ValueError naming the manifest and the key, and the directory is left as it was."""
    manifest = _shard_dir(tmp_path / "s")
    _edit(manifest, change)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"{manifest}: {match}"):
        shards.ShardDir(tmp_path / "s", {"stage": "s"}, vocab_size=50, sources=["a"])
    with pytest.raises(ValueError, match=f"{manifest}: {match}"):
        ShardStream([tmp_path / "s"], seed=0, widths=(8,))
    assert _snapshot(tmp_path) == before


def test_a_source_index_out_of_range_is_named(tmp_path):
    """Before: a shard's source index past the manifest's sources was an IndexError (a negative
    one silently named the last source). Now a ValueError naming the shard and the index."""
    manifest = _shard_dir(tmp_path / "s", sources=("a", "b"))          # the sequence's source: index 1
    _edit(manifest, lambda m: m.update(sources=["a"]))
    with pytest.raises(ValueError, match=r"shard-00000.npz: source index 1 outside the manifest's 1 sources"):
        ShardStream([tmp_path / "s"], seed=0, widths=(8,))
    with pytest.raises(ValueError, match=r"shard-00000.npz: source index 1 outside"):
        shards.ShardDir(tmp_path / "s", {"stage": "s"}, vocab_size=50, sources=["a"]).read(0)


def test_a_listed_path_outside_the_directory_is_never_read(tmp_path):
    """Before: a hand-edited manifest listing ``../outside.npz`` (with that file's sha256) was
    read from outside the shard directory. Now only plain shard names are accepted: the
    manifest is refused naming the entry, on resume, when streamed and when read directly."""
    _shard_dir(tmp_path / "other")
    outside = tmp_path / "outside.npz"
    shutil.copy(tmp_path / "other" / "shard-00000.npz", outside)
    manifest = _shard_dir(tmp_path / "s")
    _edit(manifest, lambda m: m.update(shards={"../outside.npz": m["shards"]["shard-00000.npz"]}))
    match = r"lists '../outside.npz', not a shard file name of this directory"
    with pytest.raises(ValueError, match=match):
        shards.read_manifest(tmp_path / "s")
    with pytest.raises(ValueError, match=match):
        ShardStream([tmp_path / "s"], seed=0, widths=(8,))
    with pytest.raises(ValueError, match=match):
        shards.ShardDir(tmp_path / "s", {"stage": "s"}, vocab_size=50, sources=["a"])
    m = json.loads(manifest.read_text())
    with pytest.raises(ValueError, match=match):
        shards.read_listed(tmp_path / "s", m, "../outside.npz")
    assert outside.is_file() and (tmp_path / "s" / "shard-00000.npz").is_file()


def test_token_ids_past_the_manifests_vocabulary_are_refused_when_read(tmp_path):
    """Before: a shard's token ids were read unchecked (a manifest edited to a smaller
    vocabulary streamed ids past it). Now every read checks them against the manifest's
    vocab_size, naming the shard, the id and the size."""
    manifest = _shard_dir(tmp_path / "s", vocab=2000, ids=(5, 1999, 7, 8))
    _edit(manifest, lambda m: m.update(vocab_size=1000))
    match = r"shard-00000.npz: token id 1999 outside the vocabulary \[0, 1000\)"
    with pytest.raises(ValueError, match=match):
        ShardStream([tmp_path / "s"], seed=0, widths=(8,))
    with pytest.raises(ValueError, match=match):
        shards.ShardDir(tmp_path / "s", {"stage": "s"}, vocab_size=1000, sources=["a"]).read(0)


# ----------------------------------------------------------------------------- item 13: vocab in training

def test_shards_of_a_larger_vocabulary_are_refused_for_training(tmp_path):
    """Before: shards written for a target with a larger vocabulary were streamed into the
    trainer (the manifest's vocab_size never compared with the target's), ending in a
    misleading "features are not finite". Now the stream compares them where it is opened
    for a target (``vocab_size=``), where the feature cache is computed with the target's
    forward and where the reduced head counts tokens, naming both sizes; directories of
    different vocabularies are not streamed together."""
    _shard_dir(tmp_path / "big", vocab=2000, ids=(5, 1999, 7, 8, 9))
    _shard_dir(tmp_path / "small", vocab=1000, ids=(5, 999, 7, 8, 9))
    match = r"shards written for a target with a vocabulary of 2000 tokens, but the target has 1000"
    with pytest.raises(ValueError, match=match):
        ShardStream([tmp_path / "big"], seed=0, widths=(8,), vocab_size=1000)
    st = ShardStream([tmp_path / "big"], seed=0, widths=(8,))
    with pytest.raises(ValueError, match=match):
        st.token_counts(1000)
    cfg = models.ModelConfig(vocab_size=1000, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, max_position=64)
    target = models.Llama(cfg)
    feats = ShardFeatures(st, tmp_path / "cache", key={"target": "tiny"}, layers=[0], final_layer=0, hidden_size=16)
    with pytest.raises(ValueError, match=match):
        feats.compute(distill.shard_feature_forward(target), target.init_params(jax.random.key(0)))
    assert not list((tmp_path / "cache").rglob("*.npy"))                       # nothing computed
    with pytest.raises(ValueError, match=r"different vocabularies: .*big \(2000\), .*small \(1000\)"):
        ShardStream([tmp_path / "big", tmp_path / "small"], seed=0, widths=(8,))
    assert ShardStream([tmp_path / "small"], seed=0, widths=(8,), vocab_size=1000).vocab_size == 1000
    # a smaller vocabulary (one tokenizer, another padding, as Qwen2.5 0.5B against 7B) is accepted
    assert ShardStream([tmp_path / "small"], seed=0, widths=(8,), vocab_size=1024).vocab_size == 1000


def test_review_a_stage_directory_that_is_a_file_is_refused_before_any_stage_runs(tmp_path):
    """Before: with ``WORKDIR/responses_greedy`` a file, the Magpie stage ran first (hours by
    default) and only then did the stage's mkdir fail. Now `run` checks every stage directory and
    top-level file before anything runs, and leaves the file as it was."""
    (tmp_path / "responses_greedy").write_text("not a directory\n")
    with pytest.raises(ValueError, match=r"responses_greedy is a file, not a directory; nothing was run"):
        distill.generate_data(None, None, tmp_path)
    assert (tmp_path / "responses_greedy").read_text() == "not a directory\n"
    assert not (tmp_path / "instructions").exists()


def test_review_a_short_write_names_the_file(tmp_path, monkeypatch):
    """Before: a full disk while a shard or manifest was written raised OSError(ENOSPC) with no
    file name, so the CLI's one line named nothing. Now it names the file being written."""
    import errno
    import os as os_mod
    _shards = distill.shards
    real_fsync = os_mod.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(_shards.os, "fsync", full)
    with pytest.raises(OSError) as e:
        _shards._atomic_write(tmp_path / "manifest.json", b"{}")
    monkeypatch.setattr(_shards.os, "fsync", real_fsync)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "manifest.json.tmp")
    assert not (tmp_path / "manifest.json").exists()


def test_review_the_digest_covers_only_the_files_a_load_reads(tmp_path):
    """Before: every weight-like file below a checkpoint directory was hashed, so a trainer's
    optimizer.pt or a GGUF export saved beside the model changed the digest and refused a
    resume of an unchanged target. Now only the files the loader reads and config.json count."""
    _datagen = distill._datagen
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    before = _datagen.target_digest(str(tmp_path))[0]
    (tmp_path / "optimizer.pt").write_bytes(b"state")
    (tmp_path / "stale-copy.safetensors").write_bytes(b"old")
    assert _datagen.target_digest(str(tmp_path))[0] == before
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert _datagen.target_digest(str(tmp_path))[0] != before
