"""Sampled-path exactness on the real target (SmolLM2-135M-Instruct), CI size.

The first two committed tokens of speculative sampling (the untrained 4-layer early-exit draft,
gamma 1, block verifier, temperature 1 with top-p 0.9) against the target's exact two-token
distribution, Pearson chi-square with rare cells pooled (`experiments.sampled_exactness.run`):
384 rows, one prompt, seed 0, false-alarm rate 1e-3. The negative control (a draft reporting
q^2 renormalized instead of the q it sampled from) must be rejected at the same level.
The full size (every drafter, both verifiers, adaptive gamma, two prompts) is the experiment's
committed result.

The experiment runs as its command does, in a subprocess with XLA's default code generation
(`build.tune_xla_cpu`'s options only, not the suite's fast-compile ones): its cost is the 384
rows' sampling over the 49,152-token vocabulary, which the suite's unoptimized code runs
slower (the chi-square statistics are the same either way).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from _bench_run import default_xla_env
from experiments.lib import toolkit
from experiments.sampled_exactness import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chi_square_of_exact_counts_is_zero_and_of_wrong_counts_large():
    probs = np.array([0.5, 0.3, 0.2])
    assert run.chi_square(np.array([50, 30, 20]), probs)[2] == pytest.approx(1.0)
    assert run.chi_square(np.array([80, 10, 10]), probs)[2] < 1e-6
    stat, df, p = run.chi_square(np.array([50, 30, 19, 1]), np.array([0.5, 0.3, 0.2, 0.0]))
    assert p == 0.0 and stat == float("inf")          # a count where the target has no mass


def test_speculative_sampling_matches_the_target_and_the_control_fails(tmp_path):
    out = tmp_path / "results.jsonl"
    env = default_xla_env()
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "experiments.sampled_exactness.run",
                        "--config=experiments/sampled_exactness/config.py:ci", f"--config.out={out}"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    tests = [x for x in toolkit.read_jsonl(out) if x["kind"] == "test"]
    assert [t["run"] for t in tests] == ["early_exit:1:block", "early_exit:1:token:misreported"]
    exact, control = tests
    assert not exact["negative_control"] and control["negative_control"]
    assert exact["level"] == pytest.approx(1e-3)        # one exact test in the family
    assert exact["cells"] >= 10 and exact["samples"] == 384
    assert exact["p_value"] >= exact["level"], exact
    assert control["p_value"] < control["level"], control
    for t in tests:                                      # both paths ran: rejections and acceptances
        assert 0 < t["accepted"] < t["proposed"] and t["degenerate_residuals"] == 0
    report = run.report(out)
    assert "| early_exit:1:block |" in report and "All as expected: yes." in report
    assert (tmp_path / "README.md").read_text() == report
