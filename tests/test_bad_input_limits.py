"""Bad inputs caught early with one clear error: max_new_tokens against the context length
(issue 18 item 11), and the CLI's presentation of user errors (item 12)."""
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from configs import generate

REPO = pathlib.Path(__file__).resolve().parents[1]


def _tiny_hf(directory, max_position):
    from specjax import models
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, max_position=max_position)
    model = models.Llama(cfg)
    params = model.init_params(jax.random.key(0))
    models.export_hf(model, params, directory)
    return model, params


def test_max_new_tokens_is_checked_against_the_context_length(tmp_path, monkeypatch):
    from specjax import build, decoding, models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before max_new_tokens was checked")

    monkeypatch.setattr(models, "load_with_tokenizer", no_load)
    # From the config alone: an absurd max_new_tokens (it used to die in XLA after 35 s).
    c = generate.get_config()
    c.max_new_tokens = 10 ** 9
    with pytest.raises(ValueError, match="max_new_tokens=1000000000"):
        build.check_config(build.generate_settings(c))
    # From the target's header, before its weights load: a 16-position model, 40 new tokens.
    model, params = _tiny_hf(tmp_path / "ckpt", max_position=16)
    c = generate.get_config()
    c.update({"target": str(tmp_path / "ckpt"), "drafter": "ngram", "max_new_tokens": 40})
    with pytest.raises(ValueError, match="max_new_tokens=40.*context length 16"):
        build.load_generator(build.generate_settings(c))
    # Per batch, in the engine, with the numbers: 5 prompt tokens + 12 new > 16 positions.
    engine = decoding.Engine(model, None, decoding.GenerationConfig(max_new_tokens=12, gamma=0))
    key = jax.random.key(0)
    batch = decoding.make_batch([[1, 2, 3, 4, 5]], engine.config, key)
    with pytest.raises(ValueError, match=r"5 tokens and max_new_tokens=12: 17 positions exceed .*context length 16"):
        engine.run(decoding.EngineParams(target=params, draft=None), build.sampling_config(build.generate_settings(generate.get_config())), batch)
    engine._check(decoding.make_batch([[1, 2, 3, 4]], engine.config, key))   # 4 + 12 = 16 fits


def _cli(args, code=None):
    code = code or "from specjax import cli; cli.run()"
    env = dict(os.environ, JAX_PLATFORMS="")
    return subprocess.run([sys.executable, "-c", code, "generate", "--config=configs/generate.py", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_cli_prints_one_line_per_user_error_and_exits_2(tmp_path):
    _tiny_hf(tmp_path / "ckpt", max_position=16)
    bad = [f"--config.target={tmp_path / 'ckpt'}", "--config.drafter=ngram", "--config.max_new_tokens=40"]
    out = _cli(bad)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("specjax: error: max_new_tokens=40") and "context length 16" in lines[-1]
    out = _cli(bad + ["--verbose"])
    assert out.returncode == 2 and "Traceback" in out.stderr and "specjax: error:" in out.stderr
    # An error after the backend started (e.g. a prompt too long for the cache): still one
    # line, and no INFO line about a missing TPU backend.
    code = ("import jax\nfrom specjax import cli, models\n"
            "def fake_main(c):\n    jax.devices()\n"
            "    raise models.CacheCapacityError('cache capacity 8 is too small')\n"
            "cli.main = fake_main\ncli.run()\n")
    out = _cli([], code)
    assert out.returncode == 2, out.stderr
    assert "tpu" not in out.stderr.lower() and "Traceback" not in out.stderr
    assert out.stderr.strip() == "specjax: error: cache capacity 8 is too small (--verbose for the traceback)"
