"""The heads' training table (`experiments/heads/training_report.py`) reads each run's data
composition from its config and its data size from its summary, and says when a summary
predates that record instead of inventing a figure."""
import json

from experiments.heads import training_report


def _run(tmp_path, name, sampled, noise, data_tokens):
    summary = {"tokens": 1000, "draft": {"kind": "eagle", "input_norm": True, "feature_noise": noise},
               "eval": {"alpha_t1": 0.3, "greedy_agreement_step1": 0.4, "greedy_agreement_step2": 0.3,
                        "greedy_tokens_per_pass_g1": 1.4, "greedy_tokens_per_pass_g2": 1.5, "eval_tokens": 10}}
    if data_tokens is not None:
        summary["data_loss_tokens"] = {"target": data_tokens}
    prov = {"command": f"train {name}", "git_commit": "0" * 40, "date_utc": "2026-12-04T00:00:00Z",
            "machine": {"cpu_model": "test CPU", "cpus_usable": 2, "loadavg_at_start": [0, 0, 0]},
            "config": {"data": {"greedy_samples": 1, "sampled_samples": sampled, "second_turns": sampled > 0}}}
    (tmp_path / f"train-{name}.json").write_text(json.dumps({"summary": summary, "provenance": prov}))


def test_training_table_names_each_runs_data_and_noise(tmp_path):
    _run(tmp_path, "old", sampled=2, noise=0.0, data_tokens=None)
    _run(tmp_path, "small", sampled=0, noise=0.5, data_tokens=53894)
    md = training_report.render(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines()
            if line.startswith("| old") or line.startswith("| small")}
    assert rows["old"][3:6] == ["0.0", "1/2/yes", "–"]
    assert rows["small"][3:6] == ["0.5", "1/0/no", "53894"]
    assert "predates that record" in md
    assert "1.50 (γ = 2)" in md                      # the best simulated chain of the evaluation
