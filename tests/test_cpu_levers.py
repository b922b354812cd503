"""CI smoke test of experiments/cpu_levers (bfloat16 and the model-parallel CPU mesh): the
tiny variant runs both lever kinds, each in its own process (bfloat16 on one device, float32
on a 2-device mesh; the float32 one-device path is every other test's), writes one record per variant and the table from the JSONL; the
mesh variant really ran on 2 devices with model=2, and its greedy speculative tokens equal its
target-only tokens; the greedy exactness check finds no hard mismatch in any variant. The
parent (`run.run`: it starts the variants' processes and writes the JSONL and the table) runs in
this process, as the other experiment smoke tests do (one interpreter start fewer; the child
branch of the entry point is what each variant's process runs). The variants compile with XLA's
backend code generation turned down (`_bench_run.FAST_COMPILE_XLA_FLAGS`, as the other experiment
smoke tests): every comparison is within a variant's own process, and the timings of a CI run
mean nothing."""
import functools
import json
import os
import subprocess

from experiments.lib import toolkit
from experiments.cpu_levers import report

from _bench_run import FAST_COMPILE_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_levers_tiny_runs_each_variant_in_its_process(tmp_path, monkeypatch):
    from experiments.cpu_levers import run as levers
    out = tmp_path / "results.jsonl"
    # What the variants' processes inherit (run.run starts them with this process's environment).
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("XLA_FLAGS", " ".join([os.environ.get("XLA_FLAGS", ""), FAST_COMPILE_XLA_FLAGS]).strip())
    monkeypatch.setattr(subprocess, "run", functools.partial(subprocess.run, timeout=600))    # a hung variant fails
    c = toolkit.load_config("experiments/cpu_levers/config.py", "tiny")
    c.out = str(out)
    assert levers.run(c) == tmp_path / "results.md"
    recs = [x for x in toolkit.read_jsonl(out) if x["kind"] == "variant"]
    assert [x["variant"] for x in recs] == ["bfloat16 XLA, 1 device", "float32 XLA, mesh model=2"]
    mesh = recs[1]
    assert mesh["devices"] == 2 and mesh["mesh"] == {"data": 1, "fsdp": 1, "model": 2}
    assert mesh["greedy_equal_rows"] == mesh["rows"] == 2
    assert recs[0]["dtype"] == "bfloat16" and recs[0]["mesh"] is None
    for x in recs:
        assert set(x["forward_ms"]) == {"1", "2"} and x["forward_rel"]["1"] == 1.0
        assert x["target_only_tokens"] > 0 and x["ngram_tokens"] > 0
        assert x["hard_mismatches"] == [] and x["greedy_rows_ok"] == 2 and x["tokens_compared"] > 0
    md = (tmp_path / "results.md").read_text()
    assert md == report.render(toolkit.read_jsonl(out)) and "mesh model=2" in md
    json.dumps(recs)
