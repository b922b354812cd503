"""Restartable distillation: a run killed with SIGKILL mid-run resumes to the same draft as an
uninterrupted run, and damaged or partial newest checkpoints are reported and skipped.

The uninterrupted reference is one in-process `specjax.distill.train` of the CLI test's config
(module fixture `reference`) on the toy target of tests/_distill_toy.py. The CLI test kills
`python -m specjax.distill` as a user would (a subprocess, async checkpoint saves on; it
inherits this process's XLA options, tests/conftest.py: backend code generation turned down, so
it and the in-process runs compile alike and share one compilation cache) and resumes it with
the same command line through `cli.dispatch` in this process; the damage test runs
`specjax.distill.train` in-process on the same config, falls back over a damaged and a partial
checkpoint and ends on the same draft; the `Checkpointer.restore_latest` tests use a small pytree.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import checkpoint as ckpt_lib
from specjax import cli, distill

import _distill_toy as toy

REPO = pathlib.Path(__file__).resolve().parents[1]

# A restore that fails inside Orbax leaves a tensorstore callback that later fires on Orbax's closed
# event loop ("RuntimeError: Event loop is closed", reported by pytest as unraisable): harmless noise
# of a deliberately failing restore.
failing_restores = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# ~110 loss tokens per toy step (one sequence width, below): ~55 steps, of which the killed run
# does only the first ~5 (killed before half the budget: ~20 steps of margin after the checkpoint
# it waits for).
CLI_BUDGET = 6_000
CLI_EVERY = 5
KILL_AT = 5           # SIGKILL once a checkpoint of at least this step is on disk
# The toy config keeps configs/distill.py's on-policy share (draft_weight 0.3): its one refresh
# (the draft's continuations, cached in the workdir: the resumed run must read the killed run's
# set back) is made small, 8 prompts x 16 new tokens in one batch, instead of 48 x 128 in two
# batches (two generation programs and ~2.5 s per run). One sequence width (64: every toy
# sequence fits) makes one train-step program per run instead of two.
OVERRIDES = {"data.draft_prompts": 8, "data.draft_max_new_tokens": 16, "data.gen_batch_size": 8,
            "data.widths": (64,)}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_resume")
    return dict(root=root, target_dir=toy.write_target(root / "target"),
                data_path=toy.write_data(root / "data.jsonl"), data_root=root / "data_root")


def _toy_args(toy_run, export_dir) -> dict:
    return dict(target_dir=toy_run["target_dir"], data_path=toy_run["data_path"], data_root=toy_run["data_root"],
                budget=CLI_BUDGET, checkpoint_every=CLI_EVERY, export_dir=export_dir)


def _config(toy_run, export_dir):
    """The CLI test's config, in-process (the test passes the same settings as flags)."""
    return distill.with_overrides(toy.config(**_toy_args(toy_run, export_dir)), OVERRIDES)


@pytest.fixture(scope="module")
def reference(toy_run, tmp_path_factory):
    """An uninterrupted in-process run of `_config` (it also writes the shared data cache that the
    later runs read): the draft that every interrupted run below must end on, byte for byte."""
    root = tmp_path_factory.mktemp("reference")
    summary = distill.train(_config(toy_run, root / "export"), root / "run")
    return dict(workdir=root / "run", export=root / "export", summary=summary)


def _metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _events(workdir, name) -> list[dict]:
    return [r for r in _metrics(workdir) if r.get("kind") == "event" and r.get("event") == name]


def _steps_on_disk(ckpt_dir) -> list[int]:
    """Finished steps (Orbax renames a step's temporary directory to the bare number when done)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


# ----------------------------------------------------------------------------- SIGKILL and resume (CLI)

def test_cli_killed_mid_run_resumes_to_the_same_draft(toy_run, reference, tmp_path, capsys):
    env = dict(os.environ, JAX_PLATFORMS="cpu")       # this process's XLA options (tests/conftest.py)

    def args(workdir, export_dir):
        # `_config` as command-line flags: the reference's config apart from where the run and its
        # draft go (same data cache).
        flags = {**toy.overrides(**_toy_args(toy_run, export_dir)), **OVERRIDES}
        return [f"--config={REPO / 'configs' / 'distill.py'}", f"--workdir={workdir}",
                *(f"--config.{k}={v}" for k, v in flags.items())]

    def log_tail():
        return (tmp_path / "killed.log").read_text()[-4000:]

    killed_dir, killed_export = tmp_path / "killed", tmp_path / "killed_export"
    ref_dir, ref_export = reference["workdir"], reference["export"]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "specjax.distill", *args(killed_dir, killed_export)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while True:
            steps = _steps_on_disk(killed_dir / "checkpoints")
            if steps and steps[-1] >= KILL_AT:
                proc.send_signal(signal.SIGKILL)
                break
            assert proc.poll() is None, (
                f"the run ended (rc {proc.returncode}) before a checkpoint of step {KILL_AT}: increase CLI_BUDGET "
                f"if it finished\n{log_tail()}")
            assert time.monotonic() < deadline, f"no checkpoint of step {KILL_AT} in time\n{log_tail()}"
            time.sleep(0.02)
        proc.wait(60)
        # Really killed mid-run: no summary, no draft, far from the end of the budget.
        assert proc.returncode == -signal.SIGKILL
        assert not (killed_dir / "final.json").exists()
        assert not (killed_export / "draft.safetensors").exists()
        killed_train = [r for r in _metrics(killed_dir) if r["kind"] == "train"]
        assert killed_train and killed_train[-1]["tokens"] < CLI_BUDGET / 2
        at_kill = _steps_on_disk(killed_dir / "checkpoints")
        assert at_kill and at_kill[-1] >= KILL_AT

        # The same command again resumes and runs to the end (in this process: `python -m
        # specjax.distill ARGS` is `cli.dispatch(["specjax", "distill", *ARGS])`).
        capsys.readouterr()
        rc = cli.dispatch(["specjax", "distill", *args(killed_dir, killed_export)])
        resumed = capsys.readouterr()
        assert rc == 0, f"{resumed.out[-3000:]}\n{resumed.err[-3000:]}"
    finally:
        _stop(proc)
        log.close()

    resumes = _events(killed_dir, "resume")
    # From the newest checkpoint on disk at the kill.
    assert len(resumes) == 1 and resumes[0]["step"] == at_kill[-1] and resumes[0]["step"] % CLI_EVERY == 0
    assert f"resumed from step {resumes[0]['step']}" in resumed.out
    # A SIGKILL during an asynchronous save leaves only a temporary directory, never a listed step
    # that fails to read.
    assert _events(killed_dir, "unreadable_checkpoint") == []
    assert "unreadable" not in resumed.out
    # The resumed process started right after the checkpoint (it did not redo the steps before it).
    # Steps the killed run logged after that checkpoint run again, after a `rewind` marker.
    recs = _metrics(killed_dir)
    after = recs[recs.index(resumes[0]) + 1:]
    if after[0].get("event") == "rewind":
        assert after[0]["step"] == resumes[0]["step"] and after[0]["logged_up_to"] > resumes[0]["step"]
        after = after[1:]
    assert after[0]["kind"] == "train" and after[0]["step"] == resumes[0]["step"] + 1
    assert not _events(ref_dir, "resume")

    final, ref_final = (json.loads((d / "final.json").read_text()) for d in (killed_dir, ref_dir))
    assert final["steps"] == ref_final["steps"] > 6 * KILL_AT        # most of the run came after the kill
    assert final["tokens"] == ref_final["tokens"] >= CLI_BUDGET
    # Bit-identical drafts: the same bytes, the same recorded sha256, the same description.
    assert (killed_export / "draft.safetensors").read_bytes() == (ref_export / "draft.safetensors").read_bytes()
    desc, ref_desc = (json.loads((d / "draft.json").read_text()) for d in (killed_export, ref_export))
    assert desc["sha256"] == ref_desc["sha256"] == final["export"]["sha256"] == ref_final["export"]["sha256"]
    assert desc == ref_desc


# ----------------------------------------------------------------------------- damaged checkpoints (in-process)

def _truncate_array_data(step_dir: pathlib.Path) -> int:
    """Cut every OCDBT data file of the step's `state` item to half its size."""
    n = 0
    for f in sorted((step_dir / "state").rglob("*")):
        if f.is_file() and f.parent.name == "d":
            blob = f.read_bytes()
            f.write_bytes(blob[: len(blob) // 2])
            n += 1
    return n


@failing_restores
def test_damaged_and_partial_newest_checkpoints_are_reported_and_skipped(toy_run, reference, tmp_path, capsys):
    budget, every = CLI_BUDGET, CLI_EVERY          # the reference's config (~55 steps)

    def cfg(export_dir):
        c = _config(toy_run, export_dir)
        c.keep_checkpoints = 3
        return c

    work = tmp_path / "run"
    distill.train(cfg(tmp_path / "export"), work, stop_after_steps=3 * every)
    ck = work / "checkpoints"
    assert _steps_on_disk(ck) == [every, 2 * every, 3 * every]
    # (a stopped run writes its summary too; it is short of the budget and has no draft)
    assert json.loads((work / "final.json").read_text())["tokens"] < budget
    assert not (tmp_path / "export" / "draft.safetensors").exists()

    # A partial step that Orbax lists: its directory and `meta` item are there, the `state` item is
    # missing (copied from the last good step, so only the missing item can make it fail).
    partial = 4 * every
    shutil.copytree(ck / str(3 * every), ck / str(partial))
    shutil.rmtree(ck / str(partial) / "state")
    # The previously newest step has its array data truncated.
    assert _truncate_array_data(ck / str(3 * every)) >= 1
    capsys.readouterr()

    summary = distill.train(cfg(tmp_path / "export"), work)
    out = capsys.readouterr().out
    assert f"[checkpoint] step {partial} unreadable" in out
    assert f"[checkpoint] step {3 * every} unreadable" in out
    assert f"resumed from step {2 * every}" in out
    bad = _events(work, "unreadable_checkpoint")
    assert [e["step"] for e in bad] == [partial, 3 * every] and all(e["error"] for e in bad)
    assert "state" in bad[0]["error"]
    resumes = _events(work, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] == 2 * every
    recs = _metrics(work)
    after = recs[recs.index(resumes[0]) + 1:]
    assert after[0]["event"] == "rewind" and after[0]["step"] == 2 * every     # steps past it were logged
    assert after[1]["kind"] == "train" and after[1]["step"] == 2 * every + 1

    # It finished, saving over the skipped step numbers again, and the last checkpoint is its end.
    final = json.loads((work / "final.json").read_text())
    assert final["tokens"] >= budget and summary["steps"] == final["steps"] > partial
    steps = _steps_on_disk(ck)
    assert steps[-1] == final["steps"] and len(steps) <= 3
    assert json.loads((ck / str(steps[-1]) / "meta" / "metadata").read_text())["tokens"] == final["tokens"]

    # Falling back two steps changes nothing: the same draft as the uninterrupted run (`reference`,
    # the same config but the number of checkpoints kept, which does not change the training).
    ref = reference["summary"]
    assert ref["steps"] == final["steps"] and ref["export"]["sha256"] == final["export"]["sha256"]
    assert (tmp_path / "export" / "draft.safetensors").read_bytes() == \
        (reference["export"] / "draft.safetensors").read_bytes()


# ----------------------------------------------------------------------------- Checkpointer.restore_latest

def _tree(x: float):
    return {"w": jnp.full((8, 16), x, jnp.float32), "b": {"c": jnp.arange(5, dtype=jnp.int32) + int(x)},
            "key": jax.random.key_data(jax.random.key(int(x)))}


def _save_steps(directory, *steps):
    c = ckpt_lib.Checkpointer(directory, keep=5)
    for s in steps:
        c.save(s, _tree(float(s)), {"tokens": 10 * s})
    c.close()


@failing_restores
def test_restore_latest_skips_a_corrupt_newest_step(tmp_path, capsys):
    _save_steps(tmp_path, 1, 2)
    assert _truncate_array_data(tmp_path / "2") >= 1
    c = ckpt_lib.Checkpointer(tmp_path, keep=5)
    assert c.steps() == [1, 2]
    r = c.restore_latest(_tree(0.0))
    assert r.step == 1 and r.meta == {"tokens": 10}
    assert [s for s, _ in r.skipped] == [2] and r.skipped[0][1]
    for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(_tree(1.0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "[checkpoint] step 2 unreadable" in capsys.readouterr().out
    # The skipped step is gone, so a resumed run can save that step number again.
    assert c.steps() == [1]
    c.save(2, _tree(2.0), {"tokens": 20})
    c.close()
    c = ckpt_lib.Checkpointer(tmp_path, keep=5)
    r = c.restore_latest(_tree(0.0))
    assert r.step == 2 and r.skipped == [] and r.meta == {"tokens": 20}
    c.close()


@failing_restores
def test_restore_latest_with_every_step_unreadable_raises(tmp_path):
    _save_steps(tmp_path, 1, 2)
    _truncate_array_data(tmp_path / "2")
    (tmp_path / "1" / "meta" / "metadata").write_text("{not json")
    c = ckpt_lib.Checkpointer(tmp_path, keep=5)
    with pytest.raises(RuntimeError, match="no readable checkpoint"):
        c.restore_latest(_tree(0.0))
    assert c.steps() == [1, 2]          # nothing is deleted when nothing could be restored
    c.close()


def test_restore_latest_of_an_empty_directory_is_none(tmp_path):
    c = ckpt_lib.Checkpointer(tmp_path / "none_yet", keep=5)
    assert c.steps() == [] and c.restore_latest(_tree(0.0)) is None
    c.close()
