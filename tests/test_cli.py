"""The README's main command, shortened: real generation with the default target end to end."""

import json
import os

import pytest

from configs import generate
from specjax import cli
from specjax import generate as generate_command


def test_main_job_runs_and_matches_target_only_greedy(tmp_path, capsys, monkeypatch):
    import jax

    from specjax import models

    # The target's prefill is traced into one program and run once per request (issue 18
    # item 10): calibration, the speculative run and the target-only run share it.
    traced = []
    real_prefill = models.prefill
    monkeypatch.setattr(models, "prefill", lambda *a, **k: traced.append(a[2].shape) or real_prefill(*a, **k))
    jax.clear_caches()
    c = generate.get_config()
    c.max_new_tokens = 12
    c.metrics_jsonl = str(tmp_path / "stats.jsonl")
    c.calibration_cache = str(tmp_path / "calibration.json")   # (adaptive gamma only: tests/test_calibration.py)
    # The default: prompt lookup + the shipped head at a fixed gamma; the speculative and the
    # target-only run share one prefill.
    assert c.drafter == "hybrid" and not c.adaptive_gamma and c.compare_target_only
    stats = generate_command.run(generate_command.generate_job(c))
    assert stats["calibration"] == "none" and not (tmp_path / "calibration.json").exists()
    assert 0 <= stats["lookup_rounds"] <= stats["target_passes"]
    assert len(traced) == 1, traced
    assert stats["prefill_s_incl_compile"] > 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "speedup" in out and "mean accepted tokens" in out
    assert stats["new_tokens"] == 12 and stats["status"] == "max_new_tokens"
    assert stats["same_tokens_as_target_only"] is True     # greedy: speculative == target-only
    assert stats["target_passes"] <= 12 and stats["degenerate_residuals"] == 0
    assert json.loads((tmp_path / "stats.jsonl").read_text())["new_tokens"] == 12


def test_tune_xla_cpu_adds_missing_flags_before_the_backend_starts():
    import subprocess
    import sys
    code = ("import os, jax.numpy as jnp\n"
            "from specjax import build\n"
            "print(build.tune_xla_cpu(('--xla_cpu_copy_insertion_use_region_analysis=true', "
            "'--xla_cpu_enable_fast_math=false')))\n"
            "print(os.environ['XLA_FLAGS'])\n"
            "jnp.ones(2).block_until_ready()\n"
            "print(build.tune_xla_cpu())\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_copy_insertion_use_region_analysis=false",
           "JAX_PLATFORMS": "cpu"}
    env.pop("SPECJAX_XLA_DEFAULTS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    applied, flags, after_start = out.stdout.split("\n")[:3]
    assert applied == "True" and after_start == "False"
    # a flag the user set keeps the user's value; the missing one is added
    assert flags == "--xla_cpu_copy_insertion_use_region_analysis=false --xla_cpu_enable_fast_math=false"


def test_importing_specjax_starts_no_backend():
    """XLA reads its flags when the first backend starts: `tune_xla_cpu` works only if importing
    the package (every floor, the CLI included) creates no device array."""
    import subprocess
    import sys
    code = ("import specjax, specjax.build, specjax.cli, specjax.distill\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_experiments_start_with_the_main_commands_xla_options_and_no_tpu_errors():
    """An experiment's entry point (`experiments.lib.toolkit.main_with_config`) sets what every
    specjax entry point sets before the backend starts (`build.tune_xla_cpu`): the main command's
    XLA CPU options, and, where libtpu is installed (the test extra brings it) on a machine
    without a TPU, a backend list without the TPU, so libtpu logs nothing. Started as a user
    starts it: no JAX_PLATFORMS, no XLA_FLAGS."""
    import subprocess
    import sys

    from specjax.build import XLA_CPU_FLAGS
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import os, sys\n"
            "from experiments.lib import toolkit\n"
            "def main(c):\n"
            "    import jax\n"
            "    print(jax.default_backend()); print(os.environ.get('XLA_FLAGS', ''))\n"
            "sys.argv = ['x', '--config=experiments/load_study/config.py:tiny']\n"
            "toolkit.main_with_config(main, 'experiments/load_study/config.py', 'settings')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "SPECJAX_XLA_DEFAULTS")}
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    backend, flags = out.stdout.split("\n")[:2]
    assert backend == "cpu" and all(f in flags.split() for f in XLA_CPU_FLAGS), out.stdout
    assert "TPU" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("override,message", [
    ({"drafter": "bogus"}, "drafter='bogus'"), ({"drafter": "model"}, "draft_model"),
    ({"adaptive_gamma": False, "gamma": -1}, "gamma"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"min_match": 5}, r"min_match=5: expected an integer in \[min_ngram, max_ngram\]"),
    ({"hybrid_model": "early_exit"}, "hybrid_model='early_exit'"),
    ({"target": "/nowhere/other.gguf"}, "none ships for target '/nowhere/other.gguf'.*drafter='ngram'"),
    ({"tree": "branching:2,1"}, "tree='branching:2,1': drafter='hybrid' .* drafts chains only"),
    ({"adaptive_gamma": True, "adaptive_trees": ("branching:2,1",)}, "adaptive_trees=.*drafts chains only")])
def test_bad_settings_fail_before_the_model_loads(monkeypatch, override, message):
    from specjax import build, models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(models, "load_with_tokenizer", no_load)
    c = generate.get_config()
    c.update(override)
    with pytest.raises(ValueError, match=message):
        build.load_generator(build.generate_settings(c))


def test_entry_modules_import_side_by_side():
    """No program defines its absl flags at import: the CLI and every experiment can be imported
    into one process (as the test suite does)."""
    import subprocess
    import sys
    code = ("import specjax.cli, experiments.bench_speed.run, experiments.greedy_exactness.run, "
            "experiments.distill.run\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
