"""The README's main command, shortened: real generation with the default target end to end."""

import json

from configs import generate
from specjax import cli


def test_main_job_runs_and_matches_target_only_greedy(tmp_path, capsys):
    c = generate.get_config()
    c.max_new_tokens = 12
    c.metrics_jsonl = str(tmp_path / "stats.jsonl")
    stats = cli.generate_main(c)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "speedup" in out and "mean accepted tokens" in out
    assert stats["new_tokens"] == 12 and stats["status"] == "max_new_tokens"
    assert stats["same_tokens_as_target_only"] is True     # greedy: speculative == target-only
    assert stats["target_passes"] <= 12 and stats["degenerate_residuals"] == 0
    assert json.loads((tmp_path / "stats.jsonl").read_text())["new_tokens"] == 12
