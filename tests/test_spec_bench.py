"""CI smoke test of experiments/spec_bench (the Spec-Bench table): its tiny variant, on a tiny
random target with SmolLM2's tokenizer, runs `specjax bench` for two drafters on 3 held-out
questions and draws the per-category plot from the JSONL."""
import json
import pathlib

from experiments import toolkit
from experiments.spec_bench import run as spec_run

import _cli_tiny


def test_spec_bench_tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    target, _ = _cli_tiny.write_pair(tmp_path / "pair")
    c = toolkit.load_config("experiments/spec_bench/config.py", "tiny")
    c.target, c.out = str(target), str(tmp_path / "out")
    spec_run.main(c)
    recs = [json.loads(ln) for ln in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    runs = [r for r in recs if r["kind"] == "run"]
    assert sorted({r["method"] for r in runs}) == ["early_exit", "ngram", "target_only"]
    assert len({r["id"] for r in runs}) == 3
    assert all(r["same_as_target_only"] is not False for r in runs)          # greedy
    sums = [r for r in recs if r["kind"] == "summary" and r["category"] == "all"]
    assert {r["method"] for r in sums} == {"early_exit", "ngram", "target_only"}
    assert (tmp_path / "out" / "spec_bench.png").stat().st_size > 10_000
