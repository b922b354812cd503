"""Bad input and faults in distillation (issue 18, items 5, 6 and 9), on the toy target of
tests/_distill_toy.py: empty data is an error where it arises (never a hang), a non-finite step
stops the run (or is skipped, by config) and nothing non-finite is saved or exported, and a
workdir's checkpoints are checked against a changed config before anything there is written.
"""
import contextlib
import json
import pathlib
import signal

import numpy as np
import pytest

from specjax import distill

import _distill_toy as toy


@pytest.fixture(scope="module")
def toy_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input_distill")
    return dict(root=root, target_dir=toy.write_target(root / "target"),
                data_path=toy.write_data(root / "data.jsonl"), data_root=root / "data_root")


@contextlib.contextmanager
def deadline(seconds: int):
    """TimeoutError after `seconds` (a hang fails the test instead of blocking it)."""
    def handler(signum, frame):
        raise TimeoutError(f"no result within {seconds} s (hang)")
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cfg(env, **over):
    """The toy config with one sequence width (64, every toy sequence fits): one train-step program
    per run instead of two."""
    c = toy.config(target_dir=env["target_dir"], data_path=over.pop("data_path", env["data_path"]),
                   data_root=env["data_root"], budget=over.pop("budget", 1200), checkpoint_every=1,
                   export_dir=over.pop("export_dir", ""))
    return distill.with_overrides(c, {"data.widths": (64,), **over})


def _steps_on_disk(workdir) -> list[int]:
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def test_item5_empty_batch_plan_is_an_error(toy_env, tmp_path):
    # Fixed JSONL data whose prompts are all longer than max_prompt_tokens.
    path = tmp_path / "long_prompts.jsonl"
    rng = np.random.default_rng(1)
    path.write_text("".join(json.dumps({"tokens": rng.integers(0, toy.VOCAB, 20).tolist(), "prompt_length": 10})
                            + "\n" for _ in range(8)))
    c = _cfg(toy_env, data_path=path, **{"data.max_prompt_tokens": 4})
    with deadline(60), pytest.raises(ValueError, match=r"long_prompts\.jsonl.*max_prompt_tokens=4"):
        distill.train(c, tmp_path / "work", log=lambda s: None)
    # A generated set with no token after any prompt (what a NaN draft's on-policy refresh gives).
    seqs = distill.SequenceSet([np.arange(5), np.arange(7)], [5, 7], "draft-r3")
    data = distill.TeacherData(seqs, np.zeros((0, 32), np.float32), 64)
    with deadline(10), pytest.raises(ValueError, match=r"draft-r3.*generated 0 tokens"):
        distill.BatchPlan(data, seed=0, tokens_per_batch=256, widths=(32, 64)).batch(0)


def test_item6_nonfinite_step_stops_or_is_skipped(toy_env, tmp_path):
    # learning_rate 1e30: the first update after warm-up starts sends the parameters past float32.
    over = {"optim.learning_rate": 1e30, "optim.warmup_steps": 1}
    work, export = tmp_path / "stop", tmp_path / "export_stop"
    with deadline(120), pytest.raises(FloatingPointError, match=r"step (\d+)") as err:
        distill.train(_cfg(toy_env, export_dir=export, **over), work, log=lambda s: None)
    import re
    bad = int(re.search(r"step (\d+)", str(err.value)).group(1))
    assert all(s < bad for s in _steps_on_disk(work)), (bad, _steps_on_disk(work))
    assert not export.exists()
    events = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "nonfinite"] == [bad]
    assert not any(e.get("kind") == "train" and e["step"] >= bad for e in events)

    # 'skip': the bad steps leave the parameters alone; the run ends, counts them, exports a finite draft
    # (on-policy data off: a draft this far diverged generates nothing, which item 5 makes an error).
    export = tmp_path / "export_skip"
    with deadline(120):
        summary = distill.train(_cfg(toy_env, export_dir=export, **over, **{"optim.on_nonfinite": "skip",
                                                                             "data.draft_weight": 0.0}),
                                tmp_path / "skip", log=lambda s: None)
    assert summary["skipped_steps"] >= 1
    from safetensors.numpy import load_file
    files = list(export.glob("*.safetensors"))
    assert files
    for f in files:
        for name, x in load_file(f).items():
            assert np.isfinite(x.astype(np.float32)).all(), name


def test_item9_changed_draft_config_refused_before_writing(toy_env, tmp_path):
    work = tmp_path / "work"
    with deadline(120):
        distill.train(_cfg(toy_env), work, log=lambda s: None, stop_after_steps=2)
    assert _steps_on_disk(work)

    def snapshot():
        return {str(p.relative_to(work)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
                for p in sorted(work.rglob("*"))}
    before = snapshot()
    c = _cfg(toy_env, **{"draft.layers": (0, 1), "optim.accumulate": 2})
    with deadline(60), pytest.raises(ValueError) as err:
        distill.train(c, work, log=lambda s: None)
    msg = str(err.value)
    assert "draft.layers: [0] -> [0, 1]" in msg and "optim.accumulate: 1 -> 2" in msg, msg
    assert "draft.head_vocab" not in msg
    assert snapshot() == before


def test_a_torn_metrics_line_is_set_aside_on_resume_and_rewound_steps_are_marked(toy_env, tmp_path):
    """Issue 39, defect 4: a run that dies mid-write (disk full, `ulimit -f`) leaves a torn last
    line in metrics.jsonl; before, every later run on the workdir failed parsing it. Now the next
    run keeps the complete records, sets the torn bytes aside (named in the log and in a
    `torn_metrics` event) and resumes; the steps logged after the last checkpoint (6, 7) run
    again after a `rewind` event. Every line of the file is JSON again. (On-policy data off: no
    draft generation; a resume that reads an on-policy set back is tests/test_distill_resume.py's.)"""
    work = tmp_path / "work"
    c = _cfg(toy_env, **{"checkpoint_every": 5, "budget_tokens": 3000, "data.draft_weight": 0.0})
    with deadline(120):
        distill.train(c, work, log=lambda s: None, stop_after_steps=7)
    metrics = work / "metrics.jsonl"
    whole = metrics.read_bytes()
    with open(metrics, "ab") as f:
        f.write(b'{"kind": "train", "step": 8, "lo')                 # the torn write
    logs = []
    with deadline(120):
        s = distill.train(c, work, log=logs.append)
    aside = work / "metrics.jsonl.torn-0"
    assert aside.read_bytes() == b'{"kind": "train", "step": 8, "lo'
    assert any("torn" in m and aside.name in m for m in logs)
    data = metrics.read_bytes()
    assert data.startswith(whole)
    [json.loads(l) for l in data.decode().splitlines()]                          # all whole again
    recs = [json.loads(l) for l in data[len(whole):].decode().splitlines()]     # this run's
    events = [r for r in recs if r["kind"] == "event" and r["event"] != "onpolicy_refresh"]
    assert [e["event"] for e in events[:3]] == ["torn_metrics", "resume", "rewind"]
    assert events[2]["step"] == 5 and events[2]["logged_up_to"] == 7
    after = [r["step"] for r in recs[recs.index(events[2]):] if r["kind"] == "train"]
    assert after[0] == 6 and after[-1] == s["steps"]
