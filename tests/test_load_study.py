"""CI smoke test of experiments/load_study: the tiny variant at 2 slots, target-only,
and load-aware prompt lookup with row budgets (a gamma per row), all at once and at half the saturated
rate with Poisson and bursty arrivals, through the resizing scheduler, and the load-aware mode
on the live scheduler, submitted directly and over HTTP (streamed /v1/completions calls to
`specjax serve`'s application on 127.0.0.1); one record per run with every request, greedy tokens equal to
target-only's for every request, nothing lost live, the table and the plot from the JSONL."""
import os

import numpy as np

from experiments.lib import toolkit
from experiments.load_study import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_load_study_tiny(tmp_path, monkeypatch):
    from experiments.load_study import run as load_run
    monkeypatch.chdir(REPO)
    out = tmp_path / "results.jsonl"
    c = toolkit.load_config("experiments/load_study/config.py", "tiny")
    c.out = str(out)
    load_run.main(c)
    recs = toolkit.read_jsonl(out)
    loads = [x for x in recs if x["kind"] == "load"]
    modes = ("target-only", "load-aware prompt lookup, row budgets")
    assert [(x["slots"], x["mode"], x["arrivals"]) for x in loads] == [
        (s, m, k) for s in (2,) for m in modes for k in ("all at once", "poisson", "bursty")]
    for x in loads:
        n = 6
        assert x["requests"] == n and sorted(q["id"] for q in x["per_request"]) == list(range(n))
        assert x["same_tokens_as_target_only"] == n
        assert x["tokens"] == sum(q["tokens"] for q in x["per_request"])
        assert {int(k) for k in x["rounds_per_size"]} <= {1, 2}
    # below saturation the batch shrinks to one row between requests in some run
    assert any("1" in x["rounds_per_size"] for x in loads if x["arrivals"] != "all at once")
    caps = {x["slots"]: x["requests_per_s"] for x in recs if x["kind"] == "capacity"}
    assert set(caps) == {2} and all(v > 0 for v in caps.values())
    for x in loads:
        if x["arrivals"] != "all at once":
            assert np.isclose(x["rate"], 0.5 * caps[x["slots"]])
    spec = next(x for x in loads if x["mode"] == "load-aware prompt lookup, row budgets")
    assert spec["proposed"] > 0
    cal = [x for x in recs if x["kind"] == "calibration"]
    assert [(x["slots"], sorted(x["round_time_s"])) for x in cal] == [(2, ["1", "2"])]
    live = [x for x in recs if x["kind"] == "live"]
    assert [(x["slots"], x["mode"], x["transport"]) for x in live] == [
        (2, "load-aware prompt lookup, row budgets", "engine"), (2, "load-aware prompt lookup, row budgets", "http")]
    for x in live:     # over HTTP the text is the ids (IdText), so 'same' is token equality there too
        assert x["lost"] == 0 and x["requests"] == 6 and x["same_tokens_as_target_only"] == 6
        assert x["engine_rounds"] > 0 and all(q["inter_token_s"] > 0 for q in x["per_request"])
    md = (tmp_path / "results.md").read_text()
    assert md == report.render(recs) and "## Aims" in md and "within 5% of offline" in md
    assert "live server over HTTP within 5% of offline" in md
    assert (tmp_path / "load_study.png").stat().st_size > 10_000


def test_resume_keeps_finished_groups_and_drops_a_torn_last_line(tmp_path):
    """`--config.resume`: a run cut off mid-write leaves a torn last line, dropped with a note;
    finished (slots, mode) groups are kept, a half-done one runs again; a damaged line inside the
    file is an error naming it; another config's partial is not resumed."""
    import json

    import pytest
    from experiments.load_study import run as load_run
    c = toolkit.load_config("experiments/load_study/config.py", "tiny")
    c.out = str(tmp_path / "results.jsonl")
    setup = {"kind": "setup", "slots": list(c.slots), "num_requests": list(c.num_requests), "loads": list(c.loads),
             "arrivals": list(c.arrivals), "modes": list(c.modes), "burstiness": c.burstiness, "buckets": c.buckets,
             "seed": c.seed, "max_new_tokens": c.max_new_tokens, "temperature": c.temperature,
             "live_slots": c.live_slots, "live_loads": list(c.live_loads), "live_modes": list(c.live_modes),
             "live_transports": list(c.live_transports)}
    load = lambda mode, kind: {"kind": "load", "slots": 2, "mode": mode, "arrivals": kind}     # noqa: E731
    kinds = ["all at once"] + [k for k in c.arrivals for _ in c.loads]
    recs = [setup, {"kind": "capacity", "slots": 2}] + [load("target-only", k) for k in kinds] + \
        [load("load-aware prompt lookup, row budgets", kinds[0])]
    partial = tmp_path / "results.jsonl.partial"
    partial.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "lo')
    keep = load_run._resumable(c)
    assert len(keep) == len(recs)
    assert load_run._done_groups(c, keep, (2,)) == {(2, "target-only")}
    assert [r["kind"] for r in keep].count("load") == len(kinds)          # the half-done group is dropped
    partial.write_text('{"kind": "lo\n' + json.dumps(setup) + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_run._resumable(c)
    partial.write_text(json.dumps({**setup, "seed": c.seed + 1}) + "\n")
    assert load_run._resumable(c) == []
    # a partial from before the live runs went over HTTP (no live_transports: engine only)
    old = {k: v for k, v in setup.items() if k != "live_transports"}
    partial.write_text(json.dumps(old) + "\n")
    assert load_run._resumable(c) == []
    c.live_transports = ("engine",)
    assert load_run._resumable(c) == [old]


def test_calibrate_refuses_bad_arguments_in_one_line_before_loading():
    """`experiments.load_study.calibrate`: a missing or non-positive batch size and a mode without
    adaptive candidates (or unknown) are one line each, raised before any model loads."""
    import pytest
    from experiments.load_study import calibrate
    for argv, says in ((["x"], "BATCH_SIZE a positive integer"), (["x", "0"], "BATCH_SIZE a positive integer"),
                       (["x", "16", "target-only"], "mode 'target-only': expected one of the adaptive modes"),
                       (["x", "16", "bogus"], "mode 'bogus'")):
        with pytest.raises(SystemExit, match=says) as e:
            calibrate.main(argv)
        assert "\n" not in str(e.value)
    assert calibrate.parse(["x", "16"]) == (16, "load-aware hybrid, row budgets")
