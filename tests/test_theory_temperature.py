"""CI smoke test of the token-tree benchmark's study variants: experiments/theory (theory vs
measurement and the gamma sweep), experiments/temperature and experiments/verifiers, on the
benchmark's tiny random target. One run of `experiments.theory.run` with every setting the
three use (two sampling settings, one with top-p; a chain under the token and the block
verifier; a tree under traversal and recursive rejection; adaptive drafting; draft costs)
writes the records, and each study's tables and plots are made from that JSONL alone (the
three `run` entry points are the same benchmark call with their own config)."""
import os
import subprocess
import sys

from experiments import toolkit
from experiments.bench_trees import run as trees_run
from experiments.temperature import config as temperature_config
from experiments.temperature import plot as temperature_plot
from experiments.theory import plot as theory_plot
from experiments.verifiers import config as verifiers_config
from experiments.verifiers import plot as verifiers_plot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_study_configs_load():
    for mod in (temperature_config, verifiers_config):
        for variant in ("", "tiny"):
            c = mod.get_config(variant)
            assert c.out.endswith("results.jsonl")
    assert trees_run.samplings(temperature_config.get_config()) == [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.5, 1.0),
                                                                    (1.0, 0.9)]
    v = verifiers_config.get_config()
    labels = [label for label, _ in trees_run.with_verifiers(v, trees_run.proposals(v, "distilled"))]
    assert labels == ["chain:3@token", "chain:3@block", "branching:2,2,1@traversal", "branching:2,2,1@recursive"]
    assert [trees_run.verifiers_of(v, x) for x in labels] == [("token", "traversal"), ("block", "traversal"),
                                                              ("token", "traversal"), ("token", "recursive")]


def test_studies_tiny(tmp_path):
    out = tmp_path / "results.jsonl"
    r = subprocess.run([sys.executable, "-m", "experiments.theory.run", "--config=experiments/theory/config.py:tiny",
                        f"--config.out={out}", "--config.samplings=('0','1:0.9')", "--config.chains=(2,)",
                        "--config.ngram_trees=('branching:2,1',)", "--config.verifiers=('token','block')",
                        "--config.tree_verifiers=('traversal','recursive')"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr[-4000:]
    recs = toolkit.read_jsonl(out)
    gens = [x for x in recs if x["kind"] == "generation"]
    settings = ["target_only", "chain:2@token", "chain:2@block", "branching:2,1@traversal", "branching:2,1@recursive",
                "adaptive"]
    assert [(x["temperature"], x["top_p"], x["setting"]) for x in gens] == [
        (t, p, s) for t, p in ((0.0, 1.0), (1.0, 0.9)) for s in settings]
    assert {(x["drafter"], x["gamma"]) for x in recs if x["kind"] == "draft_cost"} == {("ngram", 2)}
    for x in gens:
        assert len(x["per_prompt"]) == x["prompts"]
        assert sum(p["new_tokens"] for p in x["per_prompt"]) == x["new_tokens"]
        if x["setting"] == "adaptive":
            assert x["gammas"] == [0, 2] and len(x["round_time_s"]) == 2
            assert sum(x["rounds_per_gamma"]) == x["target_passes"]
        if x["temperature"] == 0 and x["drafter"] != "none":
            assert x["greedy_rows_matching"] == x["prompts"]
    # theory: measured / predicted speedup is the product of its three factors
    priced = [x for x in theory_plot.rows(recs) if "cost_model_speedup" in x]
    assert len(priced) == 4                      # chain 2 under 2 verifiers, 2 sampling settings
    for x in priced:
        ratio = x["measured_speedup"] / x["cost_model_speedup"]
        assert abs(ratio / (x["factor_acceptance"] * x["factor_step"] * x["factor_round"]) - 1) < 1e-9
    for name in ("theory_T0.png", "theory_T1.png", "gamma_sweep_T0.png", "bench_trees.md"):
        assert (tmp_path / name).stat().st_size > 1_000
    assert (tmp_path / "theory.md").read_text() == theory_plot.markdown(recs) + "\n"
    # temperature and verifiers from the same records
    t_rows = temperature_plot.rows(recs)
    assert {(x["temperature"], x["top_p"]) for x in t_rows} == {(0.0, 1.0), (1.0, 0.9)}
    v_rows = verifiers_plot.rows(recs)
    assert {x["verifier"] for x in v_rows} == {"token", "block", "traversal", "recursive"}
    for written in temperature_plot.plot(out) + verifiers_plot.plot(out):
        assert written.stat().st_size > 1_000
    assert (tmp_path / "temperature.md").read_text() == temperature_plot.markdown(recs)
    assert (tmp_path / "verifiers.md").read_text() == verifiers_plot.markdown(recs)
