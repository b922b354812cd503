"""CI smoke test of experiments/distill_study: the tiny variant (FKL x 3 data sources x 2 seeds
on a tiny random target with SmolLM2's tokenizer, Spec-Bench prompts): every run
trains on exactly its sources, ends at the budget with a held-out evaluation, on-policy runs
redraw their data during training, a run repeated with its seed gives the same figures, a
finished run is read back rather than retrained, and the table and the plot are made from the
JSONL alone."""
import json
import os
import shutil

import pytest

from experiments.lib import toolkit
from specjax import distill
from experiments.distill_study import report

import _cli_tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_distill_study_tiny(tmp_path, monkeypatch):
    from experiments.distill_study import run as study
    monkeypatch.chdir(REPO)
    target_dir, _ = _cli_tiny.write_pair(tmp_path / "pair")
    c = toolkit.load_config("experiments/distill_study/config.py", "tiny")
    c.update(target=str(target_dir), runs=str(tmp_path / "runs"), data_root=str(tmp_path / "data"),
             out=str(tmp_path / "results" / "results.jsonl"))
    study.main(c)
    recs = toolkit.read_jsonl(c.out)
    runs = [r for r in recs if r["kind"] == "run"]
    assert [(r["seed"], r["source"], r["divergence"]) for r in runs] == [
        (s, src, "fkl") for s in (0, 1) for src in ("target", "on-policy", "mixed")]
    for r in runs:
        assert r["tokens"] >= 600 and not r["reused"] and r["eval_tokens"] > 0
        assert 0.0 <= r["alpha_after"] <= 1.0
        want = {"target": {"target"}, "on-policy": {"draft"}, "mixed": {"target", "draft"}}[r["source"]]
        assert set(r["loss_tokens_by_source"]) == want, r
        assert sum(r["loss_tokens_by_source"].values()) == r["tokens"]
        # On-policy data is redrawn from the current draft during the run (600 tokens, refreshes
        # every 4 steps of ~64 loss tokens): several times wherever the draft's data is used.
        assert (r["onpolicy_refreshes"] >= 2) == (r["source"] != "target")
        assert r["train_loss_last"] < r["train_loss_first"] or r["source"] != "target"
    start = next(r for r in recs if r["kind"] == "start")
    # Training moved the draft: its held-out greedy agreement changed. (The tiny random
    # target's p is nearly uniform over 49,152 tokens, so alpha, ~ p's mass on the 256-token
    # head, hardly moves with q; the train loss and the agreement do.)
    assert any(r["agreement_after"] != start["agreement"] for r in runs)
    # The seed matters (batch order, the mixture's draws, the samples).
    by = {(r["seed"], r["source"]): r for r in runs}
    assert by[(0, "mixed")]["loss_tokens_by_source"] != by[(1, "mixed")]["loss_tokens_by_source"] or \
        by[(0, "mixed")]["train_loss_last"] != by[(1, "mixed")]["train_loss_last"]
    # A run's training config differs from the study's only in the source's weights, the
    # divergence and the seed (and the study's common overrides).
    tc = study.training_config(c, "mixed", "tvd", 1)
    assert (tc.loss.divergence, tc.seed, tc.data.target_weight, tc.data.draft_weight) == ("tvd", 1, 0.5, 0.5)
    assert tc.budget_tokens == 600 and tc.draft.layers == (0,) and tc.target == str(target_dir)
    base = distill.flatten(study.training_config(c, "target", "fkl", 0).to_dict())
    other = distill.flatten(tc.to_dict())
    assert {k for k in base if base[k] != other[k]} == {"loss.divergence", "seed", "data.target_weight",
                                                          "data.draft_weight"}
    # Every run directory keeps its metrics and summary, not its checkpoints.
    for r in runs:
        d = tmp_path / "runs" / r["name"]
        assert (d / "final.json").is_file() and not (d / "checkpoints").exists()
    assert (tmp_path / "results" / "results.md").read_text() == report.render(recs)
    assert (tmp_path / "results" / "distill_study.png").stat().st_size > 10_000

    # Same seed again (a fresh workdir): the same figures. Finished runs are read back.
    shutil.rmtree(tmp_path / "runs" / "mixed-fkl-seed0")
    c.update(out=str(tmp_path / "again" / "results.jsonl"))
    study.main(c)
    again = [r for r in toolkit.read_jsonl(c.out) if r["kind"] == "run"]
    for a, b in zip(runs, again):
        assert a["alpha_after"] == b["alpha_after"] and a["agreement_after"] == b["agreement_after"], a["name"]
        assert b["reused"] == (b["name"] != "mixed-fkl-seed0")
    json.loads((tmp_path / "runs" / "mixed-fkl-seed0" / "final.json").read_text())

    # A finished run is never read back under another training config: refused before anything
    # trains, naming the run and the key (a smaller budget would otherwise report the larger one's).
    c.overrides.budget_tokens = 300
    with pytest.raises(ValueError, match=r"target-fkl-seed0 holds a run finished under another.*budget_tokens: 600 -> 300"):
        study.main(c)
