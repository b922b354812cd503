"""Fault injection for checkpoints (issue 18 item 7).

A tiny state is saved at steps 1, 2, 3; the newest step is then damaged in place in every way we
could think of: a data file truncated, bytes flipped in each kind of file Orbax writes (array
data, OCDBT manifests, array/step metadata, the JSON `meta` item, commit markers), a file
missing, a non-finite state, and read errors (an `OSError` from the reader once, or every time).
The documented outcome (specjax/checkpoint.py): corrupt -> fall back to step 2, one report line,
the corrupt step deleted; a read error once -> read again and use step 3; a persistent read
error -> fall back, step 3 moved whole to `<dir>.kept/3`, reported, never deleted. Steps 1 and 2
(good) are never touched, and no failed Orbax restore happens (so no "Event loop is closed"
noise: unraisable exceptions fail these tests). Retention never removes the last verified step.
A distillation-level test resumes a tiny `train()` over a byte-flipped newest checkpoint.
"""
import errno
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import checkpoint as ckpt_lib

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def _tree(x: float):
    return {"w": jnp.full((8, 16), x, jnp.float32), "b": {"c": jnp.arange(5, dtype=jnp.int32) + int(x)},
            "key": jax.random.key_data(jax.random.key(int(x)))}


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _save(directory, steps, keep=5, tree=_tree):
    c = ckpt_lib.Checkpointer(directory, keep=keep)
    for s in steps:
        c.save(s, tree(float(s)), {"tokens": 10 * s})
    c.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("pristine") / "ck"
    _save(d, [1, 2, 3])
    return d


@pytest.fixture
def ck(pristine, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(pristine, d)
    return d


def _files(step_dir: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())


def _good_steps_intact(d, steps=(1, 2)):
    for s in steps:
        assert ckpt_lib.verify_manifest(d / str(s)) is True


def _expect_fallback(d, capsys, what):
    c = ckpt_lib.Checkpointer(d, keep=5)
    r = c.restore_latest(_tree(0.0))
    out = capsys.readouterr().out
    assert r.step == 2 and r.meta == {"tokens": 20}, what
    _same(r.state, _tree(2.0))
    assert [s for s, _ in r.skipped] == [3] and "corrupt" in r.skipped[0][1], (what, r.skipped)
    lines = [ln for ln in out.splitlines() if ln.startswith("[checkpoint]")]
    assert len(lines) == 1 and lines[0].startswith("[checkpoint] step 3 unreadable (corrupt"), (what, out)
    assert "Traceback" not in out
    assert r.kept == [] and not (d.parent / "ck.kept").exists()
    assert c.steps() == [1, 2]          # the corrupt step is gone, the good ones are all there
    _good_steps_intact(d)
    c.save(3, _tree(3.0), {"tokens": 30})     # the resumed run can save that step again
    c.close()
    r = ckpt_lib.Checkpointer(d, keep=5).restore_latest(_tree(0.0))
    assert r.step == 3 and r.skipped == []
    return r


def test_every_file_of_a_step_is_in_its_manifest(pristine):
    files = _files(pristine / "3")
    assert ckpt_lib.MANIFEST in files
    listed = json.loads((pristine / "3" / ckpt_lib.MANIFEST).read_text())["files"]
    assert sorted(listed) == [f for f in files if f != ckpt_lib.MANIFEST]
    kinds = " ".join(listed)
    for kind in ("/d/", "manifest.ocdbt", "_METADATA", "_sharding", "array_metadatas", "meta/metadata",
                 "_CHECKPOINT_METADATA", "commit_success"):
        assert kind in kinds, kind


def test_truncated_data_file_falls_back(ck, capsys):
    data = [f for f in _files(ck / "3") if "/d/" in f]
    assert data
    f = ck / "3" / data[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _expect_fallback(ck, capsys, "truncated")


def test_byte_flips_in_every_file_kind_fall_back(pristine, tmp_path, capsys):
    manifest = "specjax_checksums.json"
    rels = [f for f in _files(pristine / "3") if f != manifest] + [manifest] * (manifest in _files(pristine / "3"))
    assert len(rels) >= 10
    for i, rel in enumerate(rels):
        d = tmp_path / f"case{i}" / "ck"
        shutil.copytree(pristine, d)
        f = d / "3" / rel
        blob = bytearray(f.read_bytes())
        lo = len(blob) // 2 - min(32, len(blob) // 2)
        for j in range(lo, min(len(blob), lo + 64)):
            blob[j] ^= 0xFF
        f.write_bytes(bytes(blob))          # same size: only the checksum can tell
        r = _expect_fallback(d, capsys, rel)
        assert r.step == 3


def test_missing_file_falls_back(ck, capsys):
    for kind in ("meta/metadata", "/d/"):
        rel = next(f for f in _files(ck / "3") if kind in f)     # (data file names differ per save)
        (ck / "3" / rel).unlink()
        c = ckpt_lib.Checkpointer(ck, keep=5)
        r = c.restore_latest(_tree(0.0))
        assert r.step == 2 and "missing" in r.skipped[0][1] and rel in r.skipped[0][1]
        c.save(3, _tree(3.0), {"tokens": 30})
        c.close()
        _good_steps_intact(ck, (1, 2, 3))
    capsys.readouterr()


def test_non_finite_state_falls_back(tmp_path, capsys):
    d = tmp_path / "ck"
    _save(d, [1, 2])
    c = ckpt_lib.Checkpointer(d, keep=5)
    bad = _tree(3.0)
    bad["w"] = bad["w"].at[3, 4].set(jnp.nan)
    c.save(3, bad, {"tokens": 30})
    c.close()
    r = _expect_fallback(d, capsys, "nan")
    assert r.step == 3


def test_no_manifest_restores_unverified_and_says_so(ck, capsys):
    (ck / "3" / ckpt_lib.MANIFEST).unlink()
    r = ckpt_lib.Checkpointer(ck, keep=5).restore_latest(_tree(0.0))
    assert r.step == 3 and r.skipped == []
    _same(r.state, _tree(3.0))
    assert "step 3 has no checksum manifest" in capsys.readouterr().out


def _failing_reader(monkeypatch, step_dir: pathlib.Path, times: int):
    """Wrap the reader: reading any file of `step_dir` raises EIO `times` times in all."""
    real, calls = ckpt_lib._file_digest, {"n": 0}

    def reader(path):
        if pathlib.Path(path).is_relative_to(step_dir) and calls["n"] < times:
            calls["n"] += 1
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)
    monkeypatch.setattr(ckpt_lib, "_file_digest", reader)
    return calls


def test_transient_read_error_once_is_read_again(ck, capsys, monkeypatch):
    calls = _failing_reader(monkeypatch, ck / "3", times=1)
    r = ckpt_lib.Checkpointer(ck, keep=5).restore_latest(_tree(0.0))
    assert calls["n"] == 1 and r.step == 3 and r.skipped == [] and r.kept == []
    _same(r.state, _tree(3.0))
    out = capsys.readouterr().out
    assert "step 3: read error" in out and "read again, restored" in out
    _good_steps_intact(ck, (1, 2, 3))


@pytest.mark.parametrize("where", ["reader", "orbax"])
def test_persistent_read_error_keeps_the_step_and_reports_it(ck, capsys, monkeypatch, where):
    c = ckpt_lib.Checkpointer(ck, keep=5)
    if where == "reader":
        _failing_reader(monkeypatch, ck / "3", times=10 ** 6)
    else:
        real = c.manager.restore

        def restore(step, *a, **k):
            if step == 3:
                raise OSError(errno.EIO, "Input/output error")
            return real(step, *a, **k)
        monkeypatch.setattr(c.manager, "restore", restore)
    r = c.restore_latest(_tree(0.0))
    assert r.step == 2
    _same(r.state, _tree(2.0))
    kept = ck.parent / "ck.kept" / "3"
    assert r.kept == [(3, str(kept))] and [s for s, _ in r.skipped] == [3]
    assert "read error" in r.skipped[0][1] and str(kept) in r.skipped[0][1]
    out = capsys.readouterr().out
    assert "[checkpoint] step 3 unreadable (read error" in out and f"step 3 kept at {kept}" in out
    monkeypatch.undo()
    assert ckpt_lib.verify_manifest(kept) is True      # moved whole, bytes intact, not deleted
    assert c.steps() == [1, 2]
    _good_steps_intact(ck)
    c.save(3, _tree(3.0), {"tokens": 30})
    c.close()
    assert ckpt_lib.Checkpointer(ck, keep=5).restore_latest(_tree(0.0)).step == 3


def test_nothing_restorable_touches_nothing(ck, capsys, monkeypatch):
    for s in (1, 2, 3):
        f = ck / str(s) / "meta" / "metadata"
        f.write_bytes(b"X" + f.read_bytes()[1:])
    before = {s: _files(ck / str(s)) for s in (1, 2, 3)}
    c = ckpt_lib.Checkpointer(ck, keep=5)
    with pytest.raises(RuntimeError, match="no readable checkpoint"):
        c.restore_latest(_tree(0.0))
    assert c.steps() == [1, 2, 3] and {s: _files(ck / str(s)) for s in (1, 2, 3)} == before
    c.close()


def test_retention_keeps_newest_and_never_the_last_verified(tmp_path, capsys, monkeypatch):
    d = tmp_path / "ck"
    _save(d, [1, 2, 3, 4, 5], keep=2)
    assert sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) == [4, 5]
    # Saves whose checksums cannot be written are not verified: the last verified step (5, restored)
    # outlives any number of them, although only 2 are to be kept.
    c = ckpt_lib.Checkpointer(d, keep=2)
    assert c.restore_latest(_tree(0.0)).step == 5

    def no_read(path):
        raise OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(ckpt_lib, "_file_digest", no_read)
    for s in (6, 7, 8, 9):
        c.save(s, _tree(float(s)), {"tokens": 10 * s})
    c.wait()
    assert c.steps() == [5, 6, 7, 8, 9]
    assert "could not write its checksum manifest" in capsys.readouterr().out
    monkeypatch.undo()
    c.save(10, _tree(10.0), {"tokens": 100})
    c.close()                               # 10 verified: back to the newest 2
    assert ckpt_lib.Checkpointer(d, keep=2).steps() == [9, 10]


# ----------------------------------------------------------------------------- distillation level

def test_distill_resumes_from_the_previous_step_over_a_byte_flipped_checkpoint(tmp_path, capsys):
    import _distill_toy as toy
    from specjax import distill

    every = 4
    c = toy.config(target_dir=toy.write_target(tmp_path / "target"), data_path=toy.write_data(tmp_path / "d.jsonl"),
                   data_root=tmp_path / "data_root", budget=2600, checkpoint_every=every, export_dir="")
    c.keep_checkpoints = 2
    # On-policy data off (no draft generation; a resume that reads an on-policy set back is
    # tests/test_distill_resume.py's): the fixed toy set only, in one sequence width (64, every toy
    # sequence fits: one train-step program, not two).
    distill.with_overrides(c, {"data.draft_weight": 0.0, "data.widths": (64,)})
    work = tmp_path / "run"
    distill.train(c, work, stop_after_steps=3 * every)
    ck = work / "checkpoints"
    step_dir = ck / str(3 * every)
    data = max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    blob = bytearray(data.read_bytes())
    for j in range(len(blob) // 2, len(blob) // 2 + 64):
        blob[j] ^= 0xFF
    data.write_bytes(bytes(blob))
    capsys.readouterr()
    summary = distill.train(c, work)
    out = capsys.readouterr().out
    assert f"[checkpoint] step {3 * every} unreadable (corrupt" in out
    assert f"resumed from step {2 * every}" in out
    recs = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    assert train and all(np.isfinite(r["loss"]) for r in train)
    assert summary["steps"] > 3 * every and summary["tokens"] >= 2600
    steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert steps[-1] == summary["steps"] and len(steps) <= 2
    assert all(ckpt_lib.verify_manifest(ck / str(s)) for s in steps)


def test_intact_step_that_does_not_restore_is_kept_not_deleted(tmp_path, capsys):
    d = tmp_path / "ck"
    _save(d, [1, 2])
    c = ckpt_lib.Checkpointer(d, keep=5)
    other = _tree(3.0)
    other["w"] = jnp.zeros((4, 4), jnp.float32)       # bytes as saved, but not this template's shapes
    c.save(3, other, {"tokens": 30})
    c.close()
    c = ckpt_lib.Checkpointer(d, keep=5)
    r = c.restore_latest(_tree(0.0))
    assert r.step == 2 and [s for s, _ in r.skipped] == [3] and "files intact" in r.skipped[0][1]
    assert r.kept == [(3, str(tmp_path / "ck.kept" / "3"))]
    assert ckpt_lib.verify_manifest(tmp_path / "ck.kept" / "3") is True
    assert c.steps() == [1, 2]
    c.close()
    capsys.readouterr()
