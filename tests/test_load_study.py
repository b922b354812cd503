"""CI smoke test of experiments/load_study: the tiny variant serves random requests at a Poisson
rate and all at once, for target-only, fixed-gamma prompt lookup and adaptive prompt lookup,
through the slot-refilling scheduler; one record per (mode, rate) with every request, greedy
tokens equal to target-only's for every request, the table and the plot made from the JSONL."""
import os

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
    assert [(x["mode"], x["rate"]) for x in loads] == [
        (m, rate) for m in ("target-only", "prompt lookup, gamma 3", "adaptive prompt lookup") for rate in (20.0, 0.0)]
    for x in loads:
        assert x["requests"] == 6 and len(x["per_request"]) == 6
        assert sorted(q["id"] for q in x["per_request"]) == list(range(6))
        assert x["same_tokens_as_target_only"] == 6
        assert x["tokens"] == sum(q["tokens"] for q in x["per_request"])
        assert 0 < x["mean_active_slots"] <= 2
    burst = [x for x in loads if x["rate"] == 0.0]
    assert all(x["queue_delay_s_p90"] > 0 for x in burst)          # 6 requests, 2 slots: some wait
    spec = next(x for x in loads if x["mode"] == "prompt lookup, gamma 3")
    assert spec["proposed"] > 0 and spec["engine_rounds"] < loads[0]["engine_rounds"]
    assert [x for x in recs if x["kind"] == "calibration"][0]["gammas"] == [0, 1, 3]
    assert (tmp_path / "results.md").read_text() == report.render(recs)
    assert (tmp_path / "load_study.png").stat().st_size > 10_000
