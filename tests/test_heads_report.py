"""The heads' training table (`experiments/heads/training_report.py`) reads each run's data
composition from its config and its data size from its summary; a summary that predates that
record gets the size of a run with the same data settings (named), or none: never a guess."""
import json

import pytest

from experiments.heads import training_report


def _run(tmp_path, name, sampled, noise, data_tokens, seed=0, shards=()):
    summary = {"tokens": 1000, "draft": {"kind": "eagle", "input_norm": True, "feature_noise": noise},
               "eval": {"alpha_t1": 0.3, "greedy_agreement_step1": 0.4, "greedy_agreement_step2": 0.3,
                        "greedy_tokens_per_pass_g1": 1.4, "greedy_tokens_per_pass_g2": 1.5, "eval_tokens": 10}}
    if data_tokens is not None:
        summary["data_loss_tokens"] = {"shards" if shards else "target": data_tokens}
    data = {"greedy_samples": 1, "sampled_samples": sampled, "temperature": 1.0, "second_turns": sampled > 0,
            "max_new_tokens": 256, "widths": [256, 512]}          # max_prompt_tokens, per_category: defaults
    if shards:      # the data engine's shards only
        data.update(target_weight=0.0, shards={"weight": 1.0, "dirs": list(shards)})
    prov = {"command": f"train {name}", "git_commit": "0" * 40, "date_utc": "2026-12-04T00:00:00Z",
            "machine": {"cpu_model": "test CPU", "cpus_usable": 2, "loadavg_at_start": [0, 0, 0]},
            "config": {"target": "t", "dtype": "float32", "seed": seed, "data": data}}
    (tmp_path / f"train-{name}.json").write_text(json.dumps({"summary": summary, "provenance": prov}))


def _rows(md):
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| run") and " | eagle | " in line}


def test_training_table_names_each_runs_data_and_noise(tmp_path):
    _run(tmp_path, "new", sampled=2, noise=0.5, data_tokens=146703)
    _run(tmp_path, "old", sampled=2, noise=0.0, data_tokens=None)              # same data settings as "new"
    _run(tmp_path, "other-seed", sampled=2, noise=0.0, data_tokens=None, seed=1)   # other samples: unknown
    _run(tmp_path, "small", sampled=0, noise=0.0, data_tokens=53894)
    _run(tmp_path, "engine", sampled=2, noise=0.0, data_tokens=3158956,
         shards=("corpus/responses_greedy", "corpus/responses_sampled"))
    rows = _rows(training_report.render(tmp_path))
    assert rows["engine"][3:6] == ["0.0", "shards: responses_greedy, responses_sampled", "3158956"]
    assert rows["new"][3:6] == ["0.5", "1/2/yes", "146703"]
    assert rows["old"][3:6] == ["0.0", "1/2/yes", "146703 (new)"]
    assert rows["other-seed"][3:6] == ["0.0", "1/2/yes", "–"]
    assert rows["small"][3:6] == ["0.0", "1/0/no", "53894"]
    assert rows["new"][-1] == "1.50 (γ = 2) |"                       # the best simulated chain of the evaluation


def test_a_broken_summary_is_named(tmp_path):
    _run(tmp_path, "good", sampled=2, noise=0.0, data_tokens=1)
    (tmp_path / "train-cut.json").write_text('{"summary": {')
    with pytest.raises(ValueError, match="train-cut.json: not valid JSON"):
        training_report.render(tmp_path)
    (tmp_path / "train-cut.json").write_text('{"summary": {}}')
    with pytest.raises(ValueError, match="train-cut.json: not a training summary"):
        training_report.render(tmp_path)
