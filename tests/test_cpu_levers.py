"""CI smoke test of experiments/cpu_levers (bfloat16 and the model-parallel CPU mesh): the
tiny variant runs both lever kinds, each in its own process (bfloat16 on one device, float32
on a 2-device mesh; the float32 one-device path is every other test's), writes one record per variant and the table from the JSONL; the
mesh variant really ran on 2 devices with model=2, and its greedy speculative tokens equal its
target-only tokens; the greedy exactness check finds no hard mismatch in any variant. The run
compiles with XLA's backend code generation turned down (`_bench_run.FAST_COMPILE_XLA_FLAGS`, as
the other experiment smoke tests): every comparison is within a variant's own process, and the
timings of a CI run mean nothing."""
import json
import os
import subprocess
import sys

from experiments.lib import toolkit
from experiments.cpu_levers import report

from _bench_run import FAST_COMPILE_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_levers_tiny_runs_each_variant_in_its_process(tmp_path):
    out = tmp_path / "results.jsonl"
    r = subprocess.run([sys.executable, "-m", "experiments.cpu_levers.run",
                        "--config=experiments/cpu_levers/config.py:tiny", f"--config.out={out}"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), FAST_COMPILE_XLA_FLAGS]).strip()))
    assert r.returncode == 0, r.stderr[-4000:]
    recs = [x for x in toolkit.read_jsonl(out) if x["kind"] == "variant"]
    assert [x["variant"] for x in recs] == ["bfloat16 XLA, 1 device", "float32 XLA, mesh model=2"]
    mesh = recs[1]
    assert mesh["devices"] == 2 and mesh["mesh"] == {"data": 1, "fsdp": 1, "model": 2}
    assert mesh["greedy_equal_rows"] == mesh["rows"] == 2
    assert recs[0]["dtype"] == "bfloat16" and recs[0]["mesh"] is None
    for x in recs:
        assert set(x["forward_ms"]) == {"1", "2", "4"} and x["forward_rel"]["1"] == 1.0
        assert x["target_only_tokens"] > 0 and x["ngram_tokens"] > 0
        assert x["hard_mismatches"] == [] and x["greedy_rows_ok"] == 2 and x["tokens_compared"] > 0
    md = (tmp_path / "results.md").read_text()
    assert md == report.render(toolkit.read_jsonl(out)) and "mesh model=2" in md
    json.dumps(recs)
