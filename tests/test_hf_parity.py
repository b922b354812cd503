"""Hugging Face checkpoints: specjax vs transformers on tiny random models, and the exporter."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_tiny import VOCAB, hf_logits, hf_model, rel_and_kl  # noqa: E402
from specjax.models import Llama, ModelConfig, export_hf, load  # noqa: E402

REL_TOL, KL_TOL = 1e-4, 1e-5
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 40))   # positions past 32 exercise
                                                                # the llama3 long-wavelength band


def _check(ref, got):
    rel, kl = rel_and_kl(ref, got)
    assert rel.max() <= REL_TOL, rel.max()
    assert kl.max() <= KL_TOL, kl.max()


@pytest.mark.parametrize("kind,shard", [("llama3", False), ("qwen2", False),
                                        ("llama_linear", True)])
def test_hf_checkpoint_matches_transformers(tmp_path, kind, shard):
    ref_model = hf_model(kind)
    kwargs = {"max_shard_size": "40KB"} if shard else {}
    ref_model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # transformers reloads its own files: compare against what is on disk.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    ref = hf_logits(reloaded, TOKENS)

    model, params = load(str(tmp_path))
    c = model.config
    assert c.arch == ("qwen2" if kind == "qwen2" else "llama")
    assert c.attention_bias == (kind == "qwen2")
    assert c.tie_embeddings == (kind == "llama3")
    assert c.rope_type == {"llama3": "llama3", "qwen2": "default", "llama_linear": "linear"}[kind]
    got, _ = jax.jit(model.apply)(params, jnp.asarray(TOKENS), None)
    _check(ref, np.asarray(got))
    # Through the cache: prefill 25, then 15 single-token steps.
    step = jax.jit(model.apply)
    cache = model.init_cache(2, 48)
    outs = []
    lg, cache = step(params, jnp.asarray(TOKENS[:, :25]), cache)
    outs.append(np.asarray(lg))
    for t in range(25, 40):
        lg, cache = step(params, jnp.asarray(TOKENS[:, t:t + 1]), cache)
        outs.append(np.asarray(lg))
    _check(ref, np.concatenate(outs, axis=1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_round_trip(tmp_path, arch):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, ffn_size=96, rope_theta=10000.0,
                         rms_eps=1e-6, arch=arch, attention_bias=arch == "qwen2",
                         tie_embeddings=arch == "llama", bos_token_id=1, eos_token_id=2,
                         rope_scaling=({"rope_type": "llama3", "factor": 4.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16}
                                       if arch == "llama" else None))
    model = Llama(config)
    params = jax.tree.map(lambda x: x * 5.0, model.init_params(jax.random.key(1)))
    mine, _ = jax.jit(model.apply)(params, jnp.asarray(TOKENS), None)
    export_hf(model, params, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == cfg["architectures"][0]
    _check(hf_logits(hf, TOKENS), np.asarray(mine))
    # and specjax reads its own export back bit-exactly
    model2, params2 = load(str(tmp_path))
    assert model2.config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_bfloat16_loads_in_transformers(tmp_path):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, ffn_size=96, dtype="bfloat16")
    model = Llama(config)
    params = model.init_params(jax.random.key(2))
    export_hf(model, params, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert next(hf.parameters()).dtype == torch.bfloat16
    model2, params2 = load(str(tmp_path), dtype="bfloat16")
    assert params2["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32),
                                  np.asarray(params2["embed"], np.float32))
