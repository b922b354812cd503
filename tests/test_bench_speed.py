"""The speed benchmark (experiments/bench_speed) end to end on the tiny random model.

One subprocess runs the command as a user would (`config.py:tiny`) into a temp dir; the tests
check the JSONL (record kinds, provenance, that every measured number is finite and positive,
that greedy speculative tokens equal target-only's), and that the report is a function of the
JSONL alone (re-rendered in-process it gives the same Markdown). No timing assertions: CI
machines are noisy.
"""

import json

import pytest

from _bench_run import positive as _positive
from _bench_run import run_module

ARGS = ["--config=experiments/bench_speed/config.py:tiny"]
METHODS = {"target_only", "ngram", "early_exit", "adaptive_ngram"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return run_module("experiments.bench_speed.run", ARGS, tmp_path_factory.mktemp("bench_speed"))


def _kind(records, kind):
    return [r for r in records if r["kind"] == kind]


def test_jsonl_kinds_and_provenance(bench):
    _, records, _ = bench
    assert {"setup", "memory", "bandwidth", "forward_cost", "prefill_cost", "draft_cost", "calibration", "generation", "map_count",
            "run"} == {r["kind"] for r in records}
    prov = records[0]["provenance"]
    assert all(r["provenance"] == prov for r in records)
    assert prov["git_commit"] is None or len(prov["git_commit"]) == 40
    assert prov["git_dirty"] in (True, False, None)
    assert len(prov["model_sha256"]) == 64 and prov["random_weights"] is True
    assert prov["prompt_ids"] == [84, 92] and all(q % 4 == 0 for q in prov["prompt_ids"])   # held-out split
    assert prov["command"].startswith("python -m experiments.bench_speed.run --config=")
    assert prov["config"]["workload"] == "preset:tiny" and prov["config"]["max_new_tokens"] == 24
    m = prov["machine"]
    assert m["cpu_model"] and m["cpu_count"] >= 1 and isinstance(m["cpu_flags"], list) and m["mem_total_gib"] > 0
    assert all(m["versions"][lib] for lib in ("jax", "jaxlib", "flax", "numpy"))


def test_generation_records(bench):
    _, records, _ = bench
    gen = [r for r in _kind(records, "generation") if r["framework"] == "specjax"]
    assert {r["method"] for r in gen} == METHODS and len(gen) == 2 * len(METHODS)
    for r in gen:
        assert r["batch"] == 1 and r["new_tokens_per_row"] == [24] and r["status"] == ["max_new_tokens"]
        for key in ("total_s", "prefill_s", "decode_s", "tokens_per_s", "e2e_tokens_per_s"):
            assert _positive(r[key]), (r["method"], key, r[key])
        assert r["compiles_during_timing"] == 0, "a timed run recompiled"
        assert r["committed"] == r["new_tokens"] and r["loop_rounds"] == r["rounds"] >= 1
        assert all(a <= t for a, t in zip(r["accepted_at"], r["tested_at"]))
        assert r["accepted"] == sum(r["accepted_at"]) and r["proposed"] >= r["accepted"]
        assert sum(r["gamma_rounds"].values()) == r["rounds"]
    for m in METHODS:                              # each method's first prompt paid its compile in the warm-up
        assert _positive(gen[[r["method"] for r in gen].index(m)]["compile_s"])
    # greedy speculative decoding reproduces target-only greedy token for token
    ref = {r["question_ids"][0]: r["generated_ids"] for r in gen if r["method"] == "target_only"}
    assert all(len(set(ids[0])) > 3 for ids in ref.values())          # the tiny target does not just repeat
    for r in gen:
        if r["method"] != "target_only":
            assert r["greedy_matches_target_only"] is True and r["generated_ids"] == ref[r["question_ids"][0]]
    assert any(r["accepted"] < r["proposed"] for r in gen)                # rejections were exercised
    hf = [r for r in _kind(records, "generation") if r["framework"] == "transformers"]
    if hf:   # torch + transformers installed: the same tiny weights through transformers
        assert {r["method"] for r in hf} == {"target_only", "prompt_lookup"}
        assert all(r["new_tokens"] == 24 and _positive(r["tokens_per_s"]) for r in hf)


def test_adaptive_gamma_is_calibrated_by_the_engine(bench):
    """Adaptive gamma's round times are `Engine.round_times` (as `Generator.calibrate` and the
    CLI measure them), taken before the timed runs and fed to every run of the method."""
    _, records, _ = bench
    (cal,) = _kind(records, "calibration")
    assert (cal["method"], cal["temperature"], cal["batch"], cal["gammas"]) == ("adaptive_ngram", 0.0, 1, [0, 2])
    assert len(cal["round_time_s"]) == 2 and all(_positive(t) for t in cal["round_time_s"])
    assert _positive(cal["compile_s"])
    for r in _kind(records, "generation"):
        if r["framework"] == "specjax":
            assert r["round_time_s"] == (cal["round_time_s"] if r["method"] == "adaptive_ngram" else None)


def test_costs_bandwidth_memory(bench):
    _, records, _ = bench
    fc = _kind(records, "forward_cost")
    assert sorted(r["k"] for r in fc if r["model"] == "target") == [1, 2, 3]
    # the same k-token curve of the target in the comparison layout (cost_layers), in the same run
    assert sorted(r["k"] for r in fc if r["model"] == "target_fused") == [1, 2, 3]
    assert {r["layers"] for r in fc if r["model"].startswith("target")} == {"packed", "fused"}
    assert [r["model"] for r in fc if not r["model"].startswith("target")] == ["early_exit_3_layers"]
    pc = _kind(records, "prefill_cost")
    assert sorted((r["layers"], r["k"]) for r in pc) == [("fused", 32), ("packed", 32)]
    assert all(_positive(r["median_s"]) for r in pc)
    assert all(_positive(r["median_s"]) and _positive(r["compile_s"]) for r in fc)
    assert {(r["drafter"], r["gamma"]) for r in _kind(records, "draft_cost")} == {("ngram", 2), ("early_exit", 2)}
    (bw,) = _kind(records, "bandwidth")
    assert bw["probes"] and all(_positive(v) for v in bw["probes"].values()) and bw["gb_per_s"] == max(
        bw["probes"].values())
    (setup,) = _kind(records, "setup")
    assert setup["num_layers"] == 4 and setup["weight_bytes"] == 4 * setup["param_count"]
    (mem,) = _kind(records, "memory")
    assert mem["peak_rss"] > mem["rss_after_import"] > 0 and _positive(mem["ratio"])
    assert mem["reference_bytes"] == (mem["target_param_bytes"] + mem["draft_param_bytes"] + mem["target_kv_bytes"]
                                      + mem["draft_state_bytes"])
    assert mem["ratio"] == pytest.approx(mem["peak_above_import"] / mem["reference_bytes"])
    # no distilled draft for the tiny model: early exit, which reuses the target's arrays and cache
    assert mem["drafter"] == "early_exit" and mem["draft_param_bytes"] == 0 == mem["draft_state_bytes"]
    # resident: the packed layout keeps the head twice (embedding for lookups, panels for the product)
    assert mem["target_param_bytes"] == setup["resident_param_bytes"] > setup["weight_bytes"]
    assert mem["target_kv_bytes"] == 2 * 4 * 2 * 16 * mem["capacity"] * 4 + 4     # K and V of 4 layers, lengths
    assert [s["stage"] for s in mem["stages"]] == ["import", "backend", "load", "drafter", "target_only", "speculative"]
    assert all(s["new_tokens"] == [24] for s in mem["stages"][-2:])


def test_summaries_from_the_jsonl(bench):
    from experiments.bench_speed import report
    _, records, _ = bench
    gens = _kind(records, "generation")
    verify = {(r["batch"], r["k"]): r["median_s"] for r in records if r["kind"] == "forward_cost"
              and r["model"] == "target"}
    propose = {(r["drafter"], r["gamma"], r["temperature"], r["batch"]): r["median_s"]
               for r in _kind(records, "draft_cost")}
    sums = report.summarize(gens, verify, propose)
    assert {k[4] for k in sums} == {"writing", "roleplay", "all"}       # 2 prompts: the first two categories
    for m in METHODS - {"target_only"}:
        s = sums["specjax", m, 0.0, 1, "all"]
        for key in ("tokens_per_s", "speedup", "tokens_per_target_pass", "predicted_speedup_iid",
                    "predicted_speedup_per_position", "predicted_speedup_measured_tokens"):
            assert _positive(s[key]), (m, key, s[key])
        assert s["greedy_matches"] == s["n_prompts"] == 2 and s["new_tokens"] == 48
        assert 0 <= s["alpha_hat"] <= 1 and len(s["per_position_acceptance"]) == 2
    base = sums["specjax", "target_only", 0.0, 1, "all"]
    decode_s = sum(r["decode_s"] for r in gens if r["method"] == "target_only" and r["framework"] == "specjax")
    assert base["tokens_per_s"] == pytest.approx(48 / decode_s)


def test_report_is_rendered_from_the_jsonl_alone(bench, tmp_path):
    from experiments.bench_speed import report
    out, records, stdout = bench
    md = (out / "README.md").read_text()
    report.write(out / "results.jsonl", out=tmp_path)
    assert (tmp_path / "README.md").read_text() == md                     # the same Markdown, from the JSONL
    prov = records[0]["provenance"]
    assert prov["model_sha256"] in md and (prov["git_commit"] is None or prov["git_commit"] in md)
    for heading in ("## 0. Issue 6 targets", "## 1. Target-only", "## 2. Memory roofline",
                    "## 3. Cost of a k-token forward", "## 4. Speculative decoding", "## 5. Speedup per Spec-Bench",
                    "## 6. Peak resident memory"):
        assert heading in md
    for method in METHODS - {"target_only"}:
        assert f"| {method} | 0.0 | 1 |" in md
    assert "tokens/s" in stdout and "README.md" in stdout


def test_targets_are_data(bench, tmp_path):
    """The pass/fail table comes from the targets file: other bounds, other verdicts."""
    from experiments.bench_speed import report
    out, _, _ = bench
    spec = {"title": "Made-up targets", "targets": [
        {"what": "roofline at least 0", "metric": "roofline_fraction", "min": 0.0},
        {"what": "roofline at most 0", "metric": "roofline_fraction", "max": 0.0},
        {"what": "memory ratio at most 1e9", "metric": "memory_ratio", "max": 1e9}]}
    (tmp_path / "t.json").write_text(json.dumps(spec))
    report.write(out / "results.jsonl", targets=tmp_path / "t.json", out=tmp_path)
    md = (tmp_path / "README.md").read_text()
    assert "## 0. Made-up targets in this run" in md and "Issue 6" not in md
    rows = [line for line in md.splitlines() if line.startswith(("| roofline at", "| memory ratio"))]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == ["yes", "**no**", "yes"]


# ----------------------------------------------------------------------------- in-process checks (no run)

def _tiny(**overrides):
    from experiments.bench_speed import config
    c = config.get_config("tiny")
    c.update(overrides)
    return c


@pytest.mark.parametrize("overrides, says", [
    (dict(methods=("ngram", "medusa")), ["config.methods", "'medusa'", "adaptive_early_exit"]),
    (dict(workload="preset:70b"), ["config.workload", "'preset:70b'", "preset:8b"]),
    (dict(layers="scanned"), ["config.layers", "'scanned'", "unrolled"]),
    (dict(dtype="float16"), ["config.dtype", "bfloat16"]),
    (dict(memory_drafter="oracle"), ["config.memory_drafter", "early_exit"]),
    (dict(batch_sizes=(0,)), ["config.batch_sizes"]),
    (dict(draft_model="/nonexistent/draft"), ["config.draft_model", "/nonexistent/draft", "draft.json"]),
    (dict(head_model="/nonexistent/head"), ["config.head_model", "/nonexistent/head", "head.json"]),
])
def test_bad_settings_fail_first_with_the_key_and_allowed_values(overrides, says, monkeypatch, tmp_path):
    """A bad setting stops the run before anything (the memory process included) with a
    message naming the setting and what is allowed."""
    from experiments.bench_speed import memory, run
    monkeypatch.setattr(memory, "measure", lambda *a, **k: pytest.fail("ran before the settings were checked"))
    with pytest.raises(ValueError) as e:
        run.run(_tiny(out=str(tmp_path / "out"), **overrides))
    assert all(s in str(e.value) for s in says), str(e.value)
    assert not (tmp_path / "out").exists()


def test_provenance_is_taken_before_anything_runs(monkeypatch, tmp_path):
    """The git state (commit, dirty flag) is read at the start, not after the minute-long memory
    process: an edit made while the benchmark runs must not mark its results dirty."""
    from experiments.lib import toolkit
    from experiments.bench_speed import memory, run
    calls = []

    def git_state(exclude=()):
        calls.append("git_state")
        return {"git_commit": "0" * 40, "git_dirty": False, "git_changed_files": []}

    def measure(*args, **kwargs):
        calls.append("memory")
        raise RuntimeError("stop here")

    monkeypatch.setattr(toolkit, "git_state", git_state)
    monkeypatch.setattr(memory, "measure", measure)
    with pytest.raises(RuntimeError, match="stop here"):
        run.run(_tiny(out=str(tmp_path)))
    assert calls == ["git_state", "memory"]


def test_a_results_file_holds_one_complete_run(tmp_path, capsys):
    """Records go to a .partial file; closing moves it over the results (saying so when that
    replaces an earlier run), so a run that dies leaves the earlier results whole, and no file
    mixes two runs."""
    from experiments.lib import toolkit
    path = tmp_path / "results.jsonl"
    first = toolkit.Jsonl(path, {"git_commit": "a" * 40, "date_utc": "earlier"})
    first.write("x", i=1)
    first.write("x", i=2)
    assert not path.exists()                                        # nothing complete yet
    first.close()
    assert [r["i"] for r in toolkit.read_jsonl(path)] == [1, 2] and "replaced" not in capsys.readouterr().err
    second = toolkit.Jsonl(path, {"git_commit": "b" * 40})
    second.write("x", i=3)
    assert [r["i"] for r in toolkit.read_jsonl(path)] == [1, 2]    # the earlier run, intact while this one runs
    second.close()
    assert [r["i"] for r in toolkit.read_jsonl(path)] == [3] and not (tmp_path / "results.jsonl.partial").exists()
    err = capsys.readouterr().err
    assert "replaced an earlier run (2 records" in err and "a" * 40 in err


def test_git_state_excludes_output_files_not_their_folder(monkeypatch):
    """Excluding a run's output file leaves the code beside it counted (greedy_exactness writes
    its results.jsonl next to its run.py)."""
    import subprocess
    from experiments.lib import toolkit

    def fake_run(args, **kwargs):
        out = "f" * 40 + "\n" if "rev-parse" in args else (
            " M experiments/greedy_exactness/run.py\n M experiments/greedy_exactness/results.jsonl\n"
            "?? experiments/greedy_exactness/_work/x.json\n")
        return subprocess.CompletedProcess(args, 0, out, "")

    monkeypatch.setattr(toolkit.subprocess, "run", fake_run)
    d = toolkit.REPO / "experiments" / "greedy_exactness"
    s = toolkit.git_state(exclude=[d / "results.jsonl", d / "_work"])
    assert s["git_dirty"] is True and s["git_changed_files"] == ["experiments/greedy_exactness/run.py"]
    assert toolkit.git_state(exclude=[d / "results.json"])["git_changed_files"][1:] == [
        "experiments/greedy_exactness/results.jsonl", "experiments/greedy_exactness/_work/x.json"]   # no prefix match


def test_greedy_exactness_and_distill_settings_are_checked():
    import ml_collections
    from experiments.distill import config as distill_config
    from experiments.greedy_exactness import config as greedy_config
    c = greedy_config.get_config("tiny")
    assert greedy_config.drafter_specs(c) == [("ngram", 4), ("early_exit", 4), ("distilled", 4)]
    for bad in ("ngram", "ngram:0", "ngram:x", "medusa:4"):
        with pytest.raises(ValueError, match=r"config\.drafters: .*early_exit_own_cache"):
            greedy_config.drafter_specs(ml_collections.ConfigDict({"drafters": (bad,)}))
    assert distill_config.stages(ml_collections.ConfigDict({"stage": "evaluate"})) == ("evaluate", "report")
    with pytest.raises(ValueError, match=r"config\.stage: 'eval' .*'compare', 'recipe'"):
        distill_config.stages(ml_collections.ConfigDict({"stage": "eval"}))


def test_jsonl_output_faults_are_one_line_and_lose_nothing(tmp_path, monkeypatch):
    """The experiments' JSONL writer on a path it cannot use: empty, a directory, under a file
    (one line each, nothing created); a second writer on the same file stops at once while the
    first goes on; a full disk mid-run names the file and keeps the records before it and the
    earlier complete run; a new run moves an unfinished one's records aside; a resumed run's
    kept records are on disk before the old partial file goes."""
    import errno

    import pytest
    from experiments.lib import toolkit
    path = tmp_path / "r.jsonl"
    for bad, words in (("", "empty"), (str(tmp_path), "is a directory"),
                       (str(path) + "/x.jsonl", "not a directory")):
        if words == "not a directory":
            path.write_text("")
        with pytest.raises(toolkit.OutputError, match=words) as e:
            toolkit.Jsonl(bad, {})
        assert "\n" not in str(e.value)
        path.unlink(missing_ok=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    done = toolkit.Jsonl(path, {"git_commit": "a"})
    done.write("x", i=0)
    done.close()
    first = toolkit.Jsonl(path, {})
    first.write("x", i=1)
    with pytest.raises(toolkit.OutputError, match=r"pid \d+ .* is writing this file"):
        toolkit.Jsonl(path, {})
    first.write("x", i=2)                                   # the first writer is undisturbed

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(first, "_f", Full(first._f))
    with pytest.raises(toolkit.OutputError, match=r"record 3 failed \(No space left on device\); the 2 before") as e:
        first.write("x", i=3)
    assert "\n" not in str(e.value)
    assert [r["i"] for r in toolkit.read_jsonl(path)] == [0]                 # the earlier run, intact
    assert [r["i"] for r in toolkit.read_jsonl(first.partial)] == [1, 2]      # this run's records so far
    first._f = first._f.f
    first._release()                                       # the process died here: its lock goes with it
    second = toolkit.Jsonl(path, {})                         # a fresh run keeps the unfinished one aside
    prev = tmp_path / "r.jsonl.partial.prev"
    assert [r["i"] for r in toolkit.read_jsonl(prev)] == [1, 2]
    second.close()
    kept = toolkit.read_jsonl(prev)
    third = toolkit.Jsonl(path, {}, keep=kept)               # a resumed run
    assert [r["i"] for r in toolkit.read_jsonl(third.partial)] == [1, 2]
    third.write("x", i=3)
    third.close()
    assert [r["i"] for r in toolkit.read_jsonl(path)] == [1, 2, 3]
    assert not (tmp_path / "r.jsonl.lock").exists() and not (tmp_path / "r.jsonl.partial").exists()
