"""CI smoke test of the token-tree benchmark's study variants: experiments/theory (theory vs
measurement and the gamma sweep), experiments/temperature and experiments/verifiers, on the
benchmark's tiny random target. One run of `experiments.theory.run` with the settings the
three use (T = 1 with top-p; a chain under the token and the block verifier; adaptive
drafting; draft costs)
writes the records, and each study's tables and plots are made from that JSONL alone (the
three `run` entry points are the same benchmark call with their own config)."""
import os

from experiments.lib import toolkit
from experiments.lib import tree_study as trees_run
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


def test_studies_tiny(tmp_path, monkeypatch):
    """In-process (the suite's time budget): `experiments.theory.run.main` with the tiny config
    and the settings the other two studies use, then every study's tables and plots. (Target
    passes timed for N = 1 and 3 tokens only: the cost model prices chain 2 with those two.)"""
    from experiments.theory import run as theory_run
    monkeypatch.chdir(REPO)
    out = tmp_path / "results.jsonl"
    c = toolkit.load_config("experiments/theory/config.py", "tiny")
    c.out, c.samplings, c.chains, c.verifiers = str(out), ("1:0.9",), (2,), ("token", "block")
    c.node_counts = (1, 3)
    theory_run.main(c)
    recs = toolkit.read_jsonl(out)
    gens = [x for x in recs if x["kind"] == "generation"]
    settings = ["target_only", "chain:2@token", "chain:2@block", "adaptive"]
    assert [(x["temperature"], x["top_p"], x["setting"]) for x in gens] == [(1.0, 0.9, s) for s in settings]
    assert {(x["drafter"], x["gamma"]) for x in recs if x["kind"] == "draft_cost"} == {("ngram", 2)}
    for x in gens:
        assert len(x["per_prompt"]) == x["prompts"]
        assert sum(p["new_tokens"] for p in x["per_prompt"]) == x["new_tokens"]
        if x["setting"] == "adaptive":
            assert x["gammas"] == [0, 2] and len(x["round_time_s"]) == 2
            assert sum(x["rounds_per_gamma"]) == x["target_passes"]
    # theory: measured / predicted speedup is the product of its three factors
    priced = [x for x in theory_plot.rows(recs) if "cost_model_speedup" in x]
    assert len(priced) == 2                      # chain 2 under 2 verifiers
    for x in priced:
        ratio = x["measured_speedup"] / x["cost_model_speedup"]
        assert abs(ratio / (x["factor_acceptance"] * x["factor_step"] * x["factor_round"]) - 1) < 1e-9
    for name in ("theory_T1.png", "gamma_sweep_T1.png", "bench_trees.md"):
        assert (tmp_path / name).stat().st_size > 1_000
    assert (tmp_path / "theory.md").read_text() == theory_plot.markdown(recs) + "\n"
    # temperature and verifiers from the same records
    assert {(x["temperature"], x["top_p"]) for x in temperature_plot.rows(recs)} == {(1.0, 0.9)}
    assert {x["verifier"] for x in verifiers_plot.rows(recs)} == {"token", "block"}
    for written in temperature_plot.plot(out) + verifiers_plot.plot(out):
        assert written.stat().st_size > 1_000
    assert (tmp_path / "temperature.md").read_text() == temperature_plot.markdown(recs)
    assert (tmp_path / "verifiers.md").read_text() == verifiers_plot.markdown(recs)
