"""CI smoke tests of experiments/theory (theory vs measurement and the gamma sweep) and
experiments/temperature, both variants of the token-tree benchmark, on its tiny random target:
each run writes its records (node and draft costs, one generation record per drafter and
setting with per-prompt rows, adaptive drafting with its calibrated round times and gamma
counts), and its tables and plots from the JSONL alone."""
import os
import subprocess
import sys

from experiments import toolkit
from experiments.temperature import plot as temperature_plot
from experiments.theory import plot as theory_plot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, variant_config, out):
    r = subprocess.run([sys.executable, "-m", module, f"--config={variant_config}:tiny", f"--config.out={out}"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr[-4000:]
    return toolkit.read_jsonl(out)


def test_theory_tiny(tmp_path):
    out = tmp_path / "results.jsonl"
    recs = _run("experiments.theory.run", "experiments/theory/config.py", out)
    gens = [r for r in recs if r["kind"] == "generation"]
    assert [(r["temperature"], r["drafter"], r["setting"]) for r in gens] == [
        (t, d, s) for t in (0.0, 1.0) for d, s in (("none", "target_only"), ("ngram", "chain:1"), ("ngram", "chain:2"),
                                                  ("ngram", "adaptive"))]
    assert {(r["drafter"], r["gamma"]) for r in recs if r["kind"] == "draft_cost"} == {("ngram", 1), ("ngram", 2)}
    adaptive = [r for r in gens if r["setting"] == "adaptive"]
    for r in adaptive:
        assert r["gammas"] == [0, 1, 2] and len(r["round_time_s"]) == 3
        assert sum(r["rounds_per_gamma"]) == r["target_passes"]
    for r in gens:
        assert len(r["per_prompt"]) == r["prompts"]
        assert sum(p["new_tokens"] for p in r["per_prompt"]) == r["new_tokens"]
    rows = theory_plot.rows(recs)
    priced = [r for r in rows if "cost_model_speedup" in r]
    assert len(priced) == 4                      # 2 chains x 2 temperatures
    for r in priced:                             # measured / predicted = the product of its factors
        ratio = r["measured_speedup"] / r["cost_model_speedup"]
        assert abs(ratio / (r["factor_acceptance"] * r["factor_step"] * r["factor_round"]) - 1) < 1e-9
    for name in ("theory_T0.png", "theory_T1.png", "gamma_sweep_T0.png", "gamma_sweep_T1.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert (tmp_path / "theory.md").read_text() == theory_plot.markdown(recs) + "\n"


def test_temperature_tiny(tmp_path):
    out = tmp_path / "results.jsonl"
    recs = _run("experiments.temperature.run", "experiments/temperature/config.py", out)
    gens = [r for r in recs if r["kind"] == "generation"]
    assert [(r["temperature"], r["top_p"], r["drafter"]) for r in gens] == [
        (0.0, 1.0, "none"), (0.0, 1.0, "early_exit"), (1.0, 0.9, "none"), (1.0, 0.9, "early_exit")]
    rows = temperature_plot.rows(recs)
    assert len(rows) == 2 and rows[0]["greedy_rows_matching"] == rows[0]["prompts"]
    assert (tmp_path / "temperature.png").stat().st_size > 10_000
    assert (tmp_path / "temperature.md").read_text() == temperature_plot.markdown(recs)
