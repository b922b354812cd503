"""Bad input, round 4 (issue 53, items 1, 3, 9, 10, 11, 15, 19): the commands' workdirs, the
generation's NaN status, one run per workdir, a resume in another data order, OS errors, EAGLE-3
configs and exports, and the mesh and seed settings. Each bad input is ONE line naming the
problem (the setting, the path, the value), nothing already written is lost, and a later
correct command resumes.

The distillation runs use the toy target of tests/_distill_toy.py (in-process, except the file
size limit, which a subprocess sets); the generation the tiny pair of tests/_cli_tiny.py with
the target's final norm set to NaN.
"""
import errno
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _cli_tiny
import _distill_toy as toy
from specjax import cli, distill, drafters, files, generate, models
from specjax.models import CorruptCheckpointError

_loop = distill._loop     # the trainer's module, whose file writes the disk-full test intercepts

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("round4_toy")
    return dict(root=root, target_dir=toy.write_target(root / "target"),
                data_path=toy.write_data(root / "data.jsonl"), data_root=root / "data_root")


def _dispatch(*args) -> int:
    return cli.dispatch(["specjax", *args])


# The toy runs train on the fixed set only (no on-policy refreshes: faster, and the same data).
TOY = {"data.draft_weight": 0.0}


def _flags(env, budget=700, **over) -> list[str]:
    """`specjax distill` flags of a short toy run (~5 steps, a checkpoint every 2)."""
    flags = toy.cli_flags(target_dir=env["target_dir"], data_path=env["data_path"], data_root=env["data_root"],
                          budget=budget, checkpoint_every=2)
    return flags + [f"--config.{k}={v}" for k, v in {**TOY, **over}.items()]


def _cfg(env, budget=700, **over):
    c = toy.config(target_dir=env["target_dir"], data_path=env["data_path"], data_root=env["data_root"],
                   budget=budget, checkpoint_every=2)
    return distill.with_overrides(c, {**TOY, **over})


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def _one_error(capsys) -> str:
    """The single stderr line of a refused command (and no traceback)."""
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("specjax: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a bad input")
    for name in ("load", "load_with_tokenizer"):
        monkeypatch.setattr(models, name, no_load)


def _records(work) -> list[dict]:
    return [json.loads(x) for x in (pathlib.Path(work) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _snapshot(work) -> dict:
    work = pathlib.Path(work)
    return {str(p.relative_to(work)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(work.rglob("*"))}


# ----------------------------------------------------------------------------- 1. an empty --workdir

@pytest.mark.parametrize("command", ["distill", "data"])
@pytest.mark.parametrize("value", ["", "  "])
def test_item1_an_empty_workdir_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys, no_model_loads,
                                                                command, value):
    """Before: ``--workdir=`` meant the current directory: `data` started the whole default job
    there and `distill` wrote checkpoints/, config.json, metrics.jsonl and final.json into it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    config = str(REPO / "configs" / f"{command}.py")
    assert _dispatch(command, f"--config={config}", f"--workdir={value}") == 2
    line = _one_error(capsys)
    assert "--workdir" in line and "empty" in line and "current directory" in line, line
    assert list(cwd.iterdir()) == []
    with pytest.raises(ValueError, match="workdir=.*empty"):            # the library refuses it too
        distill.train({}, value)
    assert list(cwd.iterdir()) == []


# ----------------------------------------------------------------------------- 3. NaN logits in generate

@pytest.fixture(scope="module")
def nan_pair(tmp_path_factory):
    """(a target whose logits are all NaN: its final norm is NaN, a working draft)."""
    d = tmp_path_factory.mktemp("round4_nan")
    target_dir, draft_dir = _cli_tiny.write_pair(d)
    target, params = models.load(str(target_dir))
    params = dict(params, final_norm=jnp.full_like(params["final_norm"], jnp.nan))
    models.export_hf(target, params, d / "nan_target")
    models.load_tokenizer("smollm2-135m-instruct").save(d / "nan_target")
    return d / "nan_target", draft_dir


def test_item3_generate_with_nan_logits_names_the_status_and_fails(nan_pair, tmp_path, monkeypatch, capsys):
    """Before: an empty answer, ``0 tokens, nan tokens/s`` and exit 0; nothing said nan_logits.
    Now: one line naming the status and the cause, exit 1, no 'nan tokens/s'; the stats record
    (metrics_jsonl) holds the status."""
    monkeypatch.chdir(REPO)
    target, draft = nan_pair
    stats = tmp_path / "stats.jsonl"
    # (the settings of tests/test_cli_commands.py's generation on the same architecture: the same
    # programs, which a suite run's compilation cache then holds)
    rc = _dispatch("generate", "--config=configs/generate.py", f"--config.target={target}", "--config.drafter=model",
                   f"--config.draft_model={draft}", "--config.adaptive_gamma=False", "--config.gamma=2",
                   "--config.compilation_cache_dir=", "--config.calibration_cache=", "--config.max_new_tokens=10",
                   f"--config.metrics_jsonl={stats}")
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    errors = [ln for ln in err.splitlines() if ln.startswith("specjax: error:")]
    assert len(errors) == 1 and "nan_logits after 0 tokens" in errors[0] and "not finite" in errors[0], err
    assert "nan tokens/s" not in out + err and "Traceback" not in err
    rec = json.loads(stats.read_text())
    assert rec["status"] == "nan_logits" and rec["new_tokens"] == 0


def test_item3_a_row_that_stopped_early_is_described_and_rates_are_never_nan():
    """The line for a row that stopped at NaN logits after some tokens (a warning; the run still
    prints what it made), none for a normal finish; a rate that cannot be measured is 'n/a'."""
    assert generate.row_status_line(0, "nan_logits", 3) == (
        "row 0 stopped: nan_logits after 3 tokens (the target's logits were not finite (NaN or +inf) at the next "
        "position)")
    assert generate.row_status_line(0, "eos", 3) is None and generate.row_status_line(1, "max_new_tokens", 9) is None
    assert "nan" not in generate.rate_text(float("nan")) and generate.rate_text(12.34) == "12.3 tokens/s"


# ----------------------------------------------------------------------------- 9. one run per workdir

def test_item9_a_second_distill_on_a_busy_workdir_is_refused_naming_the_holder(toy_env, tmp_path, capsys):
    """Before: two `specjax distill` runs on one workdir both ran to exit 0, metrics.jsonl held
    duplicated steps and Orbax warned it could not find a step to delete. Now the run holds the
    workdir's lock (`files.workdir_lock`) from before it writes anything to its end; a second
    one is one line naming the holder and writes nothing. The lock is released at the end."""
    work = tmp_path / "work"
    with files.workdir_lock(work, "specjax distill (the first run)"):
        assert _dispatch("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}",
                         *_flags(toy_env)) == 2
        line = _one_error(capsys)
        assert "in use by specjax distill (the first run)" in line and str(work) in line, line
        assert sorted(p.name for p in work.iterdir()) == [files.LOCK_NAME]        # nothing else written
    assert _dispatch("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}",
                     *_flags(toy_env)) == 0
    assert json.loads((work / "final.json").read_text())["tokens"] >= 700
    steps = [r["step"] for r in _records(work) if r["kind"] == "train"]
    assert steps == sorted(set(steps))
    assert "specjax distill (pid" in (work / files.LOCK_NAME).read_text()
    with files.workdir_lock(work, "after"):          # released when the run ended
        pass


# ----------------------------------------------------------------------------- 10. another data order

def test_item10_a_resume_in_another_data_order_is_refused_unless_allowed(toy_env, tmp_path):
    """Before: a resume with another seed, data.tokens_per_batch or data.shards.window went on
    in another batch order, overwrote config.json and recorded only 'resume'. Now it is refused
    naming each key (old -> new) before anything is written; allow_data_order_change=True
    continues and records the changes (old and new values) as a data_order_change event."""
    work = tmp_path / "work"
    distill.train(_cfg(toy_env), work, log=lambda m: None, stop_after_steps=2)
    before = _snapshot(work)
    changed = {"seed": 3, "data.tokens_per_batch": 512, "data.shards.window": 4}
    with pytest.raises(ValueError) as err:
        distill.train(_cfg(toy_env, **changed), work, log=lambda m: None)
    msg = str(err.value)
    for part in ("seed: 0 -> 3", "data.tokens_per_batch: 256 -> 512", "data.shards.window: 8 -> 4",
                 "allow_data_order_change=True"):
        assert part in msg, msg
    assert "budget" not in msg
    assert _snapshot(work) == before                                     # nothing written, config.json kept
    # another budget or evaluation is no change of order
    assert distill.check_resume_config(_cfg(toy_env, budget=900, **{"eval.every": 3}), work) == {}

    distill.train(_cfg(toy_env, allow_data_order_change=True, **changed), work, log=lambda m: None,
                  stop_after_steps=3)
    events = [r for r in _records(work) if r.get("event") == "data_order_change"]
    assert events == [{"kind": "event", "event": "data_order_change", "step": 2, "changes": {
        "data.shards.window": {"old": 8, "new": 4}, "data.tokens_per_batch": {"old": 256, "new": 512},
        "seed": {"old": 0, "new": 3}}}]
    stored = json.loads((work / "config.json").read_text())
    assert stored["seed"] == 3 and stored["data"]["tokens_per_batch"] == 512
    # the new order is now the workdir's: the same config resumes without the override
    assert distill.check_resume_config(_cfg(toy_env, **changed), work) == {}


# ----------------------------------------------------------------------------- 11. OS errors

def test_item11_a_workdir_that_is_a_file_a_loop_or_holds_a_file_for_a_stage_is_one_line(
        toy_env, tmp_path, capsys, no_model_loads):
    """Before: FileExistsError / OSError tracebacks (a --workdir that is a file or a symlink
    loop; a stage directory such as checkpoints/ that is a file). Now one line naming the path,
    before anything is written."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    loop = tmp_path / "loop"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    for command in ("distill", "data"):
        config = str(REPO / "configs" / f"{command}.py")
        assert _dispatch(command, f"--config={config}", f"--workdir={a_file}") == 2
        line = _one_error(capsys)
        assert f"--workdir={a_file}" in line and "is a file" in line, line
        assert _dispatch(command, f"--config={config}", f"--workdir={loop / 'run'}") == 2
        line = _one_error(capsys)
        assert "symlink loop" in line and str(loop) in line, line
    assert a_file.read_text() == "x"
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoints").write_text("not a directory")
    assert _dispatch("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}",
                     *_flags(toy_env)) == 2
    line = _one_error(capsys)
    assert f"{work / 'checkpoints'} is a file, not a directory" in line, line
    assert sorted(p.name for p in work.iterdir()) == ["checkpoints"]


def test_item11_a_read_only_workdir_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys, no_model_loads):
    """Before: EROFS / EACCES tracebacks once the run first wrote. Now one line naming the
    directory. (As root chmod does not stop writes: there `os.access` is made to answer as a
    read-only file system does.)"""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):           # root: simulate the read-only file system's answer
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if pathlib.Path(p) == ro else real(p, mode, **k))
    try:
        for command in ("distill", "data"):
            assert _dispatch(command, f"--config={REPO / 'configs' / f'{command}.py'}", f"--workdir={ro / 'run'}") == 2
            line = _one_error(capsys)
            assert f"{ro} is not writable" in line, line
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_item11_a_full_disk_mid_run_is_one_line_and_the_same_command_resumes(toy_env, tmp_path, monkeypatch, capsys):
    """Before: an ENOSPC from a metrics write was a traceback (OSError was not a user error,
    and the error named no file). Now one line naming metrics.jsonl and the errno text; the
    same command then resumes from the last checkpoint to the end of the budget."""
    work = tmp_path / "work"
    args = ("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}", *_flags(toy_env))
    real_open, writes = open, []

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            writes.append(text)
            if len(writes) >= 3:       # step 3's record: after the step-2 checkpoint
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(text)

    monkeypatch.setattr(_loop, "open", lambda p, *a, **k: Full(real_open(p, *a, **k)), raising=False)
    assert _dispatch(*args) == 2
    line = _one_error(capsys)
    assert f"{work / 'metrics.jsonl'}: No space left on device (ENOSPC)" in line, line
    assert "the same command resumes" in line
    assert (work / "checkpoints" / "2").is_dir()
    monkeypatch.undo()
    assert _dispatch(*args) == 0
    assert json.loads((work / "final.json").read_text())["tokens"] >= 700
    assert any(r.get("event") == "resume" for r in _records(work))


def test_item11_the_file_size_limit_is_one_line_and_the_same_command_resumes(toy_env, tmp_path, capsys):
    """`ulimit -f` (RLIMIT_FSIZE, EFBIG) in a subprocess: Orbax's checkpoint write fails inside
    tensorstore. Before: Orbax's background thread's traceback, dozens of "Event loop is
    closed" tracebacks, then a ValueError. Now one line naming the file with the errno text;
    the same command without the limit resumes to the end."""
    work = tmp_path / "work"
    flags = _flags(toy_env)
    distill.train(_cfg(toy_env), tmp_path / "warm", log=lambda m: None, stop_after_steps=1)   # the data cache

    # bash's `ulimit -f` counts 1024-byte blocks: files stop at 20 KiB (a checkpoint is ~150 KB)
    out = subprocess.run(["bash", "-c", 'ulimit -f 20 && exec "$@"', "limited", sys.executable, "-m", "specjax.cli",
                          "distill", "--config=configs/distill.py", f"--workdir={work}", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false"))
    assert out.returncode == 2, out.stderr[-3000:]
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith(f"specjax: error: {work / 'checkpoints'}") and "File too large (EFBIG)" in lines[0]
    assert _dispatch("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}", *flags) == 0
    assert json.loads((work / "final.json").read_text())["tokens"] >= 700


def test_item11_outputs_are_checked_before_the_long_work(toy_env, tmp_path, capsys, no_model_loads):
    """Before: `eval --config.out=DIR` failed after the whole evaluation; distill's export_dir
    that is a file after the whole training; `bench --config.out` that is a file or a symlink
    loop was a traceback (a loop). Now each is one line naming the setting, before any model
    loads."""
    a_dir, a_file, loop = tmp_path / "a_dir", tmp_path / "a_file", tmp_path / "loop"
    a_dir.mkdir()
    a_file.write_text("x")
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    assert _dispatch("eval", f"--config={REPO / 'configs/eval.py'}", f"--config.out={a_dir}") == 2
    line = _one_error(capsys)
    assert f"out='{a_dir}'" in line and "is a directory" in line, line
    for bad, what in ((a_file, "is a file"), (loop / "x", "symlink loop")):
        assert _dispatch("bench", f"--config={REPO / 'configs/bench.py'}", f"--config.out={bad}") == 2
        line = _one_error(capsys)
        assert f"out='{bad}'" in line and what in line, line
    work = tmp_path / "work"
    assert _dispatch("distill", f"--config={REPO / 'configs/distill.py'}", f"--workdir={work}",
                     *_flags(toy_env), f"--config.export_dir={a_file}") == 2
    line = _one_error(capsys)
    assert f"export_dir='{a_file}'" in line and "is a file" in line, line
    assert not work.exists()


def test_item11_os_errors_are_one_line_naming_the_path():
    """`cli.error_line`: an OSError is 'PATH: errno text (NAME)', a rename's two paths with an
    arrow; Orbax's tensorstore failure text becomes the OSError it reports."""
    from specjax import checkpoint
    assert cli.error_line(OSError(errno.EROFS, os.strerror(errno.EROFS), "/w/metrics.jsonl")) == \
        "/w/metrics.jsonl: Read-only file system (EROFS)"
    assert cli.error_line(OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a", None, "/b")) == \
        "/a -> /b: Invalid cross-device link (EXDEV)"
    e = checkpoint.os_error_of(ValueError(
        'OUT_OF_RANGE: Error writing "key/0" in OCDBT database at local file "/w/ck/2.tmp/": Failed writing: '
        '"/w/ck/2.tmp/d/ab": Failed to write 4884 bytes to file 5: No space left [os_error_code=\'28\']'), "/w/ck")
    assert (e.errno, e.filename) == (errno.ENOSPC, "/w/ck/2.tmp/d/ab")


# ----------------------------------------------------------------------------- 15. EAGLE-3 files

V, D, L = 101, 32, 7


def _eagle3_head(tmp_path, head_ids, include_embedding=False):
    tc = models.ModelConfig(vocab_size=V, hidden_size=D, num_layers=L, num_heads=4, num_kv_heads=2, head_dim=8,
                            ffn_size=64, max_position=256)
    hc = drafters.HeadConfig.make(drafters.EAGLE3_PUBLISHED, tc, head_size=len(head_ids))
    own = drafters.init_head_params(hc, jax.random.key(0), head_ids=np.asarray(head_ids))
    target_params = {"embed": jax.random.normal(jax.random.key(1), (V, D))}
    d = tmp_path / f"head_{include_embedding}"
    drafters.save_eagle3(d, hc, own, target_params, layout="eagle", include_embedding=include_embedding)
    return tc, hc, own, d


def _rewrite(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        elif k == "eagle_config":
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,message", [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2.5, 4]}},
     r"eagle_config.eagle_aux_hidden_state_layer_ids=\[1, 2.5, 4\] must be a list of integers \(2.5 is not one\)"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 3.0, 5], "eagle_config": None},
     r"eagle_aux_hidden_state_layer_ids=\[2, 3.0, 5\] must be a list of integers"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]},
     r"eagle_config.eagle_aux_hidden_state_layer_ids \[1, 2, 3\] \(layer outputs, SGLang\) and "
     r"eagle_aux_hidden_state_layer_ids \[2, 4, 6\] .* name different layers"),
    ({"draft_vocab_size": "abc"}, r"draft_vocab_size='abc' must be an integer >= 1"),
    ({"draft_vocab_size": 0}, r"draft_vocab_size=0 must be an integer >= 1"),
])
def test_item15_eagle3_config_values_are_checked_naming_the_key(tmp_path, changes, message):
    """Before: a capture id 1.5 was truncated to 1; an eagle_config disagreeing with the
    top-level ids was reported as 'must be a list of integers'; draft_vocab_size 'abc' gave
    int()'s message without the key."""
    tc, _, _, d = _eagle3_head(tmp_path, np.arange(20) * 3)
    drafters.read_eagle3(d, tc)                       # the file as written reads
    _rewrite(d, **changes)
    with pytest.raises(CorruptCheckpointError, match=message):
        drafters.read_eagle3(d, tc)


def test_item15_an_unordered_draft_vocabulary_exports_a_monotone_d2t_of_the_same_head(tmp_path):
    """Before: a head built in code with its vocabulary in another order exported that order:
    d2t negative and not monotone, which SpecForge's check rejects. Now rows are written in
    token order with the LM head's rows permuted alike: d2t >= 0 and non-decreasing, and every
    token keeps its row."""
    from safetensors.numpy import load_file
    ids = np.random.default_rng(0).permutation(V)[:24]
    tc, hc, own, d = _eagle3_head(tmp_path, ids)
    t = load_file(str(d / "model.safetensors"))
    assert (t["d2t"] >= 0).all() and (np.diff(t["d2t"]) >= 0).all(), t["d2t"]
    rows = {int(tok): np.asarray(own["lm_head"][i]) for i, tok in enumerate(ids)}
    stored = np.arange(24) + t["d2t"]
    for i, tok in enumerate(stored):
        np.testing.assert_array_equal(t["lm_head.weight"][i], rows[int(tok)])
    _, own2, _ = drafters.read_eagle3(d, tc)
    assert sorted(rows) == np.asarray(own2["head_ids"]).tolist()


def test_item15_no_embedding_means_no_target_hidden_size_in_the_eagle_layout(tmp_path):
    """Before: include_embedding=False still wrote target_hidden_size, so the EAGLE reference
    (which loads the target's embedding only when that key is absent) kept a random embedding.
    Now the key goes with the embedding; both files read back."""
    tc, _, _, without = _eagle3_head(tmp_path, np.arange(20), include_embedding=False)
    _, _, _, with_embed = _eagle3_head(tmp_path, np.arange(20), include_embedding=True)
    from safetensors.numpy import load_file
    cfg = json.loads((without / "config.json").read_text())
    assert "target_hidden_size" not in cfg
    assert "embed_tokens.weight" not in load_file(str(without / "model.safetensors"))
    cfg = json.loads((with_embed / "config.json").read_text())
    assert cfg["target_hidden_size"] == D and "embed_tokens.weight" in load_file(str(with_embed / "model.safetensors"))
    for d in (without, with_embed):
        drafters.read_eagle3(d, tc)


# ----------------------------------------------------------------------------- 19. mesh and seed

@pytest.mark.parametrize("command,args,message", [
    ("generate", ["--config.mesh.model=0"], "mesh.model=0: expected -1"),
    ("generate", ["--config.mesh.data=-1"], "mesh: data=-1, model=-1: at most one axis may be -1"),
    ("generate", ["--config.seed=-1"], "seed=-1: expected an integer >= 0"),
    ("bench", ["--config.mesh.fsdp=-2"], "mesh.fsdp=-2: expected -1"),
    ("bench", ["--config.seed=-5"], "seed=-5: expected an integer >= 0"),
    ("distill", ["--config.mesh.model=0"], "mesh.model=0: expected -1"),
    ("distill", ["--config.seed=-1"], "seed=-1: expected an integer >= 0"),
    ("data", ["--config.seed=-1"], "seed=-1: expected an integer >= 0"),
    ("data", ["--config.generate.mesh.model=0"], "mesh.model=0: expected -1"),
    ("eval", ["--config.seed=-1"], "seed=-1: expected an integer >= 0"),
])
def test_item19_mesh_sizes_and_seeds_are_checked_on_one_device(tmp_path, monkeypatch, capsys, no_model_loads,
                                                                command, args, message):
    """Before: --config.mesh.model=0 was accepted on one device (no mesh is made there) and
    --config.seed=-1 silently. Now one line naming the setting, before anything loads."""
    monkeypatch.chdir(REPO)
    work = [f"--workdir={tmp_path / 'w'}"] if command in ("distill", "data") else []
    assert _dispatch(command, f"--config=configs/{command}.py", *work, *args) == 2
    line = _one_error(capsys)
    assert message in line, line
    assert not (tmp_path / "w").exists()
