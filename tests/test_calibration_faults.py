"""Faults of the calibration cache (specjax.calibration), issue 39 items 2 and 3.

* A cache path that exists and is not a regular file (a device node such as /dev/null, a FIFO,
  a directory) turns the cache off with one line on stderr naming it: nothing is read from it,
  renamed or written in its place, and a FIFO never blocks the run.
* Round times that fit float64 but not float32, the engine's dtype (an overflow to inf, an
  underflow to 0), are refused by one check (`calibration.valid_round_time`) that the cache and
  the engine share: a cache file holding one is set aside and the times measured again, with a
  line naming the file.

The real /dev/null is never opened for writing, renamed or replaced here: the device-node case
goes through a symlink to it inside tmp_path.
"""

from __future__ import annotations

import json
import os
import stat
import threading

import jax
import numpy as np
import pytest

from specjax import calibration, decoding, drafters
from specjax.calibration import CalibrationCache

from _toy import TabularModel, random_table

DEV_NULL = "/dev/null"


def _entries(directory):
    return sorted(p.name for p in directory.iterdir())


# ----------------------------------------------------------------------------- item 2: not a regular file

def test_a_path_to_a_device_node_turns_the_cache_off_and_is_never_replaced(tmp_path, capsys):
    """``calibration_cache`` naming a character device (here through a symlink to /dev/null):
    get and put do nothing, nothing is renamed or written, one line on stderr names the path."""
    assert stat.S_ISCHR(os.stat(DEV_NULL).st_mode)
    path = tmp_path / "cal.json"
    path.symlink_to(DEV_NULL)
    cache = CalibrationCache(path)
    assert cache.get("k") is None
    cache.put("k", {}, [0.1, 0.2])
    assert cache.get("k") is None
    assert _entries(tmp_path) == ["cal.json"] and path.is_symlink() and os.readlink(path) == DEV_NULL
    assert stat.S_ISCHR(os.stat(DEV_NULL).st_mode) and stat.S_ISCHR(os.stat(path).st_mode)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert str(path) in err and "character device" in err and "cache off" in err


def test_the_issues_command_calibration_cache_dev_null_touches_nothing(monkeypatch, capsys):
    """``--config.calibration_cache=/dev/null`` itself (as root, a common way to turn a cache off):
    with every call that could open, rename or replace a path made to fail the test, get and put
    only say the cache is off."""
    touched = []

    def refuse(name):
        def call(*args, **kwargs):
            touched.append((name, args))
            raise AssertionError(f"{name}{args} on the calibration cache path")
        return call

    for name in ("replace", "rename", "open", "unlink"):
        monkeypatch.setattr(calibration.os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(calibration.tempfile, "NamedTemporaryFile", refuse("tempfile.NamedTemporaryFile"))
    monkeypatch.setattr(calibration.pathlib.Path, "read_bytes", refuse("Path.read_bytes"))
    cache = CalibrationCache(DEV_NULL)
    assert cache.get("k") is None
    cache.put("k", {}, [0.1])
    assert cache.get("k") is None and touched == []
    monkeypatch.undo()
    assert stat.S_ISCHR(os.stat(DEV_NULL).st_mode)
    err = capsys.readouterr().err
    assert err == f"[specjax] calibration cache {DEV_NULL}: a character device, not a regular file: cache off " \
                  "(nothing read, written or renamed there)\n", err


def test_a_path_to_a_directory_turns_the_cache_off_and_is_never_renamed(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.mkdir()
    (path / "inside").write_text("kept")
    cache = CalibrationCache(path)
    assert cache.get("k") is None
    cache.put("k", {}, [0.1])
    assert _entries(tmp_path) == ["cal.json"] and path.is_dir() and _entries(path) == ["inside"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "directory" in err, err


def _in_thread(fn, timeout_s=20.0):
    """fn() in a daemon thread: (finished within timeout_s, its result or exception)."""
    out = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:          # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive(), out


def _unblock_reader(fifo):
    """Let a reader blocked on opening `fifo` go (a writer opens and closes it)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_at_the_path_does_not_hang_the_run(tmp_path, capsys):
    """A FIFO never blocks `get` or `put` (no writer would ever come) and stays a FIFO."""
    path = tmp_path / "cal.json"
    os.mkfifo(path)
    cache = CalibrationCache(path)
    try:
        done, out = _in_thread(lambda: (cache.get("k"), cache.put("k", {}, [0.1]), cache.get("k")))
    finally:
        _unblock_reader(path)
    assert done, "reading the calibration cache blocked on a FIFO"
    assert "error" not in out and out["result"] == (None, None, None)
    assert _entries(tmp_path) == ["cal.json"] and stat.S_ISFIFO(os.lstat(path).st_mode)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "FIFO" in err, err


def test_a_regular_file_and_an_absent_path_still_work(tmp_path, capsys):
    """The check lets through what the cache is for: an absent path (created by the first put),
    a regular file, and a symlink to a regular file."""
    real = tmp_path / "real.json"
    cache = CalibrationCache(real)
    cache.put("k", {}, [0.25])
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert cache.get("k") == (0.25,) and CalibrationCache(link).get("k") == (0.25,)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- item 3: float32 range

@pytest.mark.parametrize("t, ok", [
    (0.5, True), (3.0e38, True), (1e-45, True),        # the largest and smallest float32 scale
    (1e39, False), (-1e39, False), (1e-50, False), (1e-46, False), (0.0, False), (-0.5, False),
    (float("nan"), False), (float("inf"), False), (10 ** 400, False),
    (True, False), ("0.5", False), (None, False), (np.float32(0.5), True), (np.float64(1e39), False)],
    ids=lambda v: repr(v)[:24])
def test_valid_round_time_checks_in_the_engines_dtype(t, ok):
    assert calibration.valid_round_time(t) is ok


@pytest.mark.parametrize("bad", ["1e39", "1e-50", "-1e39", "1e400", "1" + "0" * 400],
                         ids=["1e39", "1e-50", "-1e39", "1e400", "int_401_digits"])
def test_a_cached_time_outside_float32_is_set_aside_naming_the_file(tmp_path, capsys, bad):
    """A time that fits float64 (or is a huge integer) but not float32 makes the file unusable:
    set aside as <name>.corrupt with one line naming the file, then the cache works again."""
    path = tmp_path / "cal.json"
    content = ('{"k": {"fields": {}, "runs": [[0.1, %s]]}}' % bad).encode()
    path.write_bytes(content)
    cache = CalibrationCache(path)
    assert cache.get("k") is None
    assert (tmp_path / "cal.json.corrupt").read_bytes() == content and not path.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "cal.json.corrupt" in err and "float32" in err, err
    cache.put("k", {}, [0.1, 0.2])
    assert cache.get("k") == (0.1, 0.2) and capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", [1e39, 1e-50])
def test_put_refuses_a_time_outside_float32(tmp_path, bad):
    cache = CalibrationCache(tmp_path / "cal.json")
    with pytest.raises(ValueError, match="float32"):
        cache.put("k", {}, [0.1, bad])
    assert not cache.path.exists()


def test_the_engine_accepts_exactly_what_the_cache_accepts():
    """The engine's check of ``round_time_s`` is the cache's: every time the cache would store
    and hand back, the engine takes; every one it refuses, the engine refuses, naming float32."""
    V = 8
    config = decoding.GenerationConfig(6, gamma=decoding.AdaptiveGamma(gammas=(0, 2)))
    engine = decoding.Engine(TabularModel(V), drafters.ModelDrafter(TabularModel(V)), config)
    params = decoding.EngineParams(target=random_table(jax.random.key(0), V),
                                   draft=random_table(jax.random.key(1), V))
    batch = decoding.make_batch([[1, 2]], config, jax.random.key(2))
    for t in (1e39, 1e-50, 1e-46, 0.0, float("nan"), 10 ** 400):
        assert not calibration.valid_round_time(t)
        with pytest.raises(ValueError, match="float32"):
            engine.init(params, batch, round_time_s=(0.5, t))
    for t in (3.0e38, 1e-45, 0.5):
        assert calibration.valid_round_time(t)
        state = engine.init(params, batch, round_time_s=(0.5, t))
        assert np.all(np.isfinite(np.asarray(state.policy.round_time_RZ)))
        assert np.all(np.asarray(state.policy.round_time_RZ) > 0)


def test_main_command_measures_again_after_a_time_outside_float32(tmp_path, capsys, monkeypatch):
    """The issue's case end to end: the main command finds a cached time that overflows float32
    under its own key; it no longer exits with the engine's error but sets the file aside (a line
    naming it), measures, and stores the new times."""
    from configs import generate
    from specjax import cli
    from specjax import generate as generate_command

    from _cli_tiny import write_pair

    target, _ = write_pair(tmp_path / "models")
    monkeypatch.setattr(calibration, "setting_key", lambda **fields: "k")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"k": {"fields": {}, "runs": [[1e39, 1e-50]]}}))
    c = generate.get_config()
    c.update(dict(target=str(target), drafter="ngram", adaptive_gamma=True, adaptive_gammas=(0, 1), max_new_tokens=2,
                  compare_target_only=False, calibration_cache=str(path)))
    assert generate_command.run(generate_command.generate_job(c))["calibration"] == "measured"
    assert (tmp_path / "cal.json.corrupt").exists()
    err = capsys.readouterr().err
    assert f"calibration cache {path}" in err and "cal.json.corrupt" in err
    (entry,) = json.loads(path.read_text()).values()
    assert len(entry["runs"]) == 1 and all(calibration.valid_round_time(t) for t in entry["runs"][0])
