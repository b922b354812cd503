"""The calibration cache (specjax.calibration): adaptive gamma's round times per machine and
setting, stored once and reused; and the main command reading and writing it."""

import json
import math

import pytest

from specjax import calibration
from specjax.calibration import CalibrationCache


def test_put_get_round_trip_and_median(tmp_path):
    cache = CalibrationCache(tmp_path / "sub" / "cal.json")     # the directory is created
    key = calibration.setting_key(target="t", gammas=["0", "1"])
    assert cache.get(key) is None
    cache.put(key, {"target": "t"}, (0.02, 0.03))
    assert cache.get(key) == (0.02, 0.03)
    cache.put(key, {"target": "t"}, [0.04, 0.01])
    cache.put(key, {"target": "t"}, [0.03, 0.02])
    assert cache.get(key) == pytest.approx((0.03, 0.02))        # per-gamma median of three runs
    assert CalibrationCache(cache.path).get(key) == pytest.approx((0.03, 0.02))   # read back by another
    other = calibration.setting_key(target="u", gammas=["0", "1"])
    cache.put(other, {"target": "u"}, [1.0, 2.0])
    assert cache.get(other) == (1.0, 2.0) and cache.get(key) == pytest.approx((0.03, 0.02))
    stored = json.loads(cache.path.read_text())
    assert stored[key]["fields"] == {"target": "t"} and len(stored[key]["runs"]) == 3


def test_only_the_last_runs_are_kept(tmp_path):
    cache = CalibrationCache(tmp_path / "cal.json")
    for i in range(1, 9):
        cache.put("k", {}, [float(i)])
    runs = json.loads(cache.path.read_text())["k"]["runs"]
    assert runs == [[4.0], [5.0], [6.0], [7.0], [8.0]] and calibration.KEEP_RUNS == 5
    assert cache.get("k") == (6.0,)


def test_keys_follow_the_fields_and_the_machine(monkeypatch):
    a = calibration.setting_key(target="t", gammas=["0", "1"], capacity=64)
    assert a == calibration.setting_key(capacity=64, gammas=["0", "1"], target="t")   # order-free
    assert len(a) == 64 and int(a, 16) >= 0
    assert a != calibration.setting_key(target="t", gammas=["0", "1"], capacity=128)
    assert a != calibration.setting_key(target="t", gammas=["0", "1", "2"], capacity=64)
    machine = calibration.machine_key()
    assert {"cpu", "cpu_flags", "cores", "backend", "jax", "jaxlib", "kernel_isa"} <= set(machine)
    assert machine["cores"] >= 1 and machine["backend"] == "cpu"
    monkeypatch.setattr(calibration, "machine_key", lambda: {**machine, "cores": machine["cores"] + 1})
    assert a != calibration.setting_key(target="t", gammas=["0", "1"], capacity=64)


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    cache = CalibrationCache(tmp_path / "cal.json")
    cache.put("k", {}, [0.5])
    cache.put("k", {}, [0.7])
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]
    # A write that fails half-way leaves the old file whole and no temporary file behind.
    monkeypatch.setattr(calibration.json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    cache.put("k", {}, [0.9])
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]
    assert cache.get("k") == (0.6,)


@pytest.mark.parametrize("content", [
    b"\x00\xff\xfe garbage", b'{"k": {"fields": {}, "runs": [[0.1', b"[1, 2, 3]",
    b'{"k": {"fields": {}, "runs": []}}', b'{"k": {"fields": {}, "runs": [[0.1], [0.1, 0.2]]}}',
    b'{"k": {"fields": {}, "runs": [[NaN, 0.1]]}}', b'{"k": {"fields": {}, "runs": [[-0.1, 0.1]]}}',
    b'{"k": {"fields": {}, "runs": [[0.0]]}}', b'{"k": {"fields": {}, "runs": [["0.1"]]}}',
    b'{"k": {"fields": {}, "runs": [[Infinity]]}}', b'{"k": {"runs": [[0.1]]}}'])
def test_a_corrupt_file_is_set_aside_and_the_cache_works(tmp_path, capsys, content):
    path = tmp_path / "cal.json"
    path.write_bytes(content)
    cache = CalibrationCache(path)
    assert cache.get("k") is None
    assert (tmp_path / "cal.json.corrupt").read_bytes() == content and not path.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cal.json.corrupt" in err
    cache.put("k", {}, [0.1, 0.2])
    assert cache.get("k") == (0.1, 0.2) and capsys.readouterr().err == ""


def test_an_empty_path_disables_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = CalibrationCache("")
    cache.put("k", {}, [0.1])
    assert cache.get("k") is None and cache.path is None and list(tmp_path.iterdir()) == []


def test_put_refuses_times_that_are_not_finite_and_positive(tmp_path):
    cache = CalibrationCache(tmp_path / "cal.json")
    for bad in ([math.nan], [0.0], [-1.0], []):
        with pytest.raises(ValueError, match="finite"):
            cache.put("k", {}, bad)
    assert not cache.path.exists()


def test_main_command_measures_once_then_reuses_the_round_times(tmp_path, capsys, monkeypatch):
    """The main command on a tiny random Llama target (a Hugging Face directory with the default
    target's tokenizer): the first run calibrates and stores, the second reads the cache (no
    calibration), recalibrate=True measures again and adds a run."""
    import jax

    from configs import generate
    from specjax import build, cli, models
    from specjax import generate as generate_command

    tok = models.load_tokenizer("smollm2-135m-instruct")
    config = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=16, ffn_size=32, max_position=256)
    target = tmp_path / "tiny"
    models.export_hf(models.Llama(config), models.Llama(config).init_params(jax.random.key(0)), target)
    tok.save(target)

    c = generate.get_config()
    c.update(dict(target=str(target), drafter="ngram", adaptive_gamma=True, adaptive_gammas=(0, 1), max_new_tokens=2,
                  compare_target_only=False, calibration_cache=str(tmp_path / "cal.json")))
    gen = build.load_generator(build.generate_settings(c))
    monkeypatch.setattr(build, "load_generator", lambda c, **k: gen)     # one load for the three runs
    calls = []
    real_calibrate = gen.calibrate
    monkeypatch.setattr(gen, "calibrate", lambda *a, **k: calls.append(1) or real_calibrate(*a, **k))

    assert generate_command.run(generate_command.generate_job(c))["calibration"] == "measured" and len(calls) == 1
    measured = gen.round_time_s
    gen.round_time_s = None
    stats = generate_command.run(generate_command.generate_job(c))
    assert stats["calibration"] == "cached" and len(calls) == 1
    assert gen.round_time_s == pytest.approx(measured)
    assert "round times (ms) per gamma from the calibration cache" in capsys.readouterr().err
    c.recalibrate = True
    assert generate_command.run(generate_command.generate_job(c))["calibration"] == "measured" and len(calls) == 2
    (entry,) = json.loads((tmp_path / "cal.json").read_text()).values()
    assert len(entry["runs"]) == 2 and entry["fields"]["gammas"] == ["0", "1"]
    assert entry["fields"]["target"] == str(target) and entry["fields"]["drafter"] == "ngram"
