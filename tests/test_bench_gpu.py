"""The GPU workload of the speed benchmark: the size presets (random-weight targets with real
checkpoints' shapes) and the `config.py:gpu` variant run end to end on CPU at the tiny size.

The presets are checked against the published parameter counts from their shapes alone
(nothing allocated). The run (one subprocess, batch 2, bfloat16, the oracle drafter and
predictions at assumed acceptance rates) checks the records and that the measured numbers are
finite and positive. No timing assertions: CI machines are noisy.
"""

import math

import jax
import pytest

from experiments.lib import workload

from _bench_run import positive as _positive
from _bench_run import run_module

ARGS = ["--config=experiments/bench_speed/config.py:gpu", "--config.workload=preset:tiny", "--config.batch_sizes=2",
        "--config.num_prompts=2", "--config.prompt_len=8", "--config.max_new_tokens=16", "--config.repeats=1",
        "--config.max_k=3", "--config.cost_iters=2", "--config.bandwidth_gib=0.02", "--config.alphas=0.6,0.8",
        "--config.gamma.early_exit=2", "--config.gamma.oracle=2", "--config.init_std=0.2", "--config.pad_multiple=32"]


@pytest.mark.parametrize("size", ["smollm2", "1b", "3b", "8b"])
def test_preset_param_counts_match_published(size):
    from specjax import models
    cfg = workload.preset_config(size, "bfloat16")
    shapes = models.param_shapes(cfg)
    count = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    assert count == cfg.num_params() == workload.KNOWN_PARAMS[size]       # two counts and the published one


def test_preset_shapes():
    c1, c8 = workload.preset_config("1b"), workload.preset_config("8b")
    assert (c1.num_layers, c1.hidden_size, c1.num_heads, c1.num_kv_heads, c1.head_dim, c1.ffn_size) == \
        (16, 2048, 32, 8, 64, 8192)
    assert (c8.num_layers, c8.hidden_size, c8.num_heads, c8.num_kv_heads, c8.head_dim, c8.ffn_size) == \
        (32, 4096, 32, 8, 128, 14336)
    assert c1.vocab_size == c8.vocab_size == 128256 and c1.tie_embeddings and not c8.tie_embeddings
    assert c1.rope_type == c8.rope_type == "llama3"
    assert c1.rope_scaling_dict["factor"] == 32.0 and c8.rope_scaling_dict["factor"] == 8.0


def test_random_params_dtype_and_shapes():
    import jax.numpy as jnp
    from specjax import models
    cfg = workload.preset_config("tiny", "bfloat16")
    params = workload.random_params(cfg, jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(
        tuple, models.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    assert 0.015 < float(jnp.std(params["layers"]["wq"].astype(jnp.float32))) < 0.025
    assert float(params["final_norm"].astype(jnp.float32).min()) == 1.0


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return run_module("experiments.bench_speed.run", ARGS, tmp_path_factory.mktemp("bench_gpu"))


def test_gpu_variant_records(bench):
    _, records, _ = bench
    prov = records[0]["provenance"]
    assert prov["config"]["dtype"] == "bfloat16" and prov["config"]["layers"] == "fused" and prov["random_weights"]
    assert prov["config"]["cost_layers"] == ["scan"]            # the old layout's k-token costs beside it
    assert prov["model_sha256"] is None                     # random weights, no file (no transformers here)
    assert {r["kind"] for r in records} >= {"setup", "bandwidth", "forward_cost", "draft_cost", "generation", "run"}
    assert not any(r["kind"] == "memory" for r in records)
    gen = [r for r in records if r["kind"] == "generation"]
    assert sorted((r["method"], r["batch"]) for r in gen) == [("early_exit", 2), ("oracle", 2), ("target_only", 2)]
    for r in gen:
        assert r["new_tokens_per_row"] == [16, 16] and r["question_ids"] == [84, 92] and r["category"] == "mixed"
        assert all(_positive(r[k]) for k in ("total_s", "prefill_s", "decode_s", "tokens_per_s", "compile_s"))
        assert r["compiles_during_timing"] == 0
    oracle = next(r for r in gen if r["method"] == "oracle")
    assert oracle["accepted"] > 0.5 * oracle["proposed"]                 # it proposes the target's own tokens
    assert oracle["rounds"] < sum(oracle["new_tokens_per_row"])         # so a round commits more than one token
    fc = [r for r in records if r["kind"] == "forward_cost"]
    assert {(r["model"], r["batch"], r["k"]) for r in fc} == {(m, 2, k) for m in ("target", "target_scan")
                                                              for k in (1, 2, 3)} | {("early_exit_1_layers", 2, 1)}
    assert {(r["drafter"], r["batch"]) for r in records if r["kind"] == "draft_cost"} == {("early_exit", 2),
                                                                                           ("oracle", 2)}


def test_gpu_variant_report(bench):
    out, _, stdout = bench
    md = (out / "README.md").read_text()
    assert "Random weights" in md and "## 7. Predicted speedup at assumed acceptance rates" in md
    assert "| 2 | early_exit | 2 | 0.60 |" in md and "| 2 | oracle | 2 | 0.80 |" in md
    assert "## 5. Speedup per Spec-Bench category" not in md            # batch 2 mixes categories
    assert "roofline (batch 2)" in stdout
