"""experiments/bench_gpu: the size presets' shapes, and an end-to-end run of the tiny size on CPU.

The presets are checked against the published parameter counts from their shapes alone
(nothing allocated). The smoke run is one subprocess with tiny settings; the test checks the
JSONL record kinds, provenance and that the measured numbers are finite and positive. No timing
assertions: CI machines are noisy. XLA's backend optimisation is turned down in the subprocess
so compilation stays cheap (the numbers of this run mean nothing anyway).
"""

import math
import pathlib

import pytest

from experiments.bench_gpu import presets

from _bench_run import run_module

REPO = pathlib.Path(__file__).resolve().parents[1]

ARGS = ["--size", "tiny", "--dtype", "float32", "--batch", "1,2", "--gamma", "2", "--max_new_tokens", "32",
        "--prompt_len", "8", "--repeats", "2", "--max_k", "3", "--cost_iters", "3", "--alphas", "0.6,0.8",
        "--bandwidth_gib", "0.02", "--bandwidth_repeats", "3", "--pad_multiple", "16"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------------------- presets

@pytest.mark.parametrize("size", ["smollm2", "1b", "3b", "8b"])
def test_preset_param_counts_match_published(size):
    cfg = presets.preset_config(size, "bfloat16")
    n = presets.param_count(cfg)
    assert n == cfg.num_params()                                       # two independent counts agree
    assert abs(n - presets.KNOWN_PARAMS[size]) / presets.KNOWN_PARAMS[size] < 0.03, (size, n)


def test_preset_shapes():
    c1, c8 = presets.preset_config("1b"), presets.preset_config("8b")
    assert (c1.num_layers, c1.hidden_size, c1.num_heads, c1.num_kv_heads, c1.head_dim, c1.ffn_size) == \
        (16, 2048, 32, 8, 64, 8192)
    assert (c8.num_layers, c8.hidden_size, c8.num_heads, c8.num_kv_heads, c8.head_dim, c8.ffn_size) == \
        (32, 4096, 32, 8, 128, 14336)
    assert c1.vocab_size == c8.vocab_size == 128256
    assert c1.tie_embeddings and not c8.tie_embeddings
    assert c1.rope_type == c8.rope_type == "llama3"
    assert c1.rope_scaling_dict["factor"] == 32.0 and c8.rope_scaling_dict["factor"] == 8.0
    assert presets.param_bytes(presets.preset_config("8b", "bfloat16")) == 2 * presets.KNOWN_PARAMS["8b"]


def test_random_params_dtype_and_shapes():
    import jax
    import jax.numpy as jnp
    from specjax.models import param_shapes
    cfg = presets.preset_config("tiny", "bfloat16")
    params = presets.random_params(cfg, jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    w = params["layers"]["wq"].astype(jnp.float32)
    assert 0.015 < float(jnp.std(w)) < 0.025
    assert float(params["final_norm"].astype(jnp.float32).min()) == 1.0


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return run_module("experiments.bench_gpu.run", ARGS, tmp_path_factory.mktemp("bench_gpu"))


def test_record_kinds_and_provenance(bench):
    _, records, _ = bench
    kinds = {r["kind"] for r in records}
    assert {"setup", "bandwidth", "generation", "roofline", "forward_cost", "draft_cost", "prediction",
            "run"} <= kinds
    for r in records:
        prov = r["provenance"]
        assert prov["size_preset"] == "tiny" and prov["dtype"] == "float32" and prov["random_weights"] is True
        assert prov["device"]["platform"] == "cpu" and prov["device"]["devices"]
        assert prov["jax_version"]
        assert "git_commit" in prov and (prov["git_commit"] is None or len(prov["git_commit"]) == 40)
    setup = next(r for r in records if r["kind"] == "setup")
    assert setup["param_count"] == presets.param_count(presets.preset_config("tiny"))
    assert setup["config"]["dtype"] == "float32"


def test_measurements_finite_positive(bench):
    _, records, _ = bench
    bw = next(r for r in records if r["kind"] == "bandwidth")
    for probe in ("copy", "read"):
        assert _positive(bw[probe]["gb_per_s"]) and _positive(bw[probe]["best_gb_per_s"])

    gen = [r for r in records if r["kind"] == "generation"]
    assert {(r["method"], r["batch"]) for r in gen} == {(m, b) for m in ("target_only", "early_exit", "oracle")
                                                        for b in (1, 2)}
    for r in gen:
        assert r["new_tokens"] == 32 * r["batch"]                      # no EOS in the random target
        for key in ("total_s", "prefill_s", "decode_s", "tokens_per_s", "e2e_tokens_per_s", "seconds_per_round",
                    "compile_s"):
            assert _positive(r[key]), (r["method"], r["batch"], key, r[key])
        assert r["compiles_during_timing"] == 0, "a timed run recompiled"
        if r["method"] != "target_only":
            assert _positive(r["speedup_vs_target_only"])
            assert 0 <= r["alpha_hat"] <= 1
            # greedy speculative decoding reproduces target-only greedy (tiny float32: no near-ties expected)
            assert r["greedy_rows_matching_target_only"] == r["batch"]
    oracle = [r for r in gen if r["method"] == "oracle"]
    assert all(r["alpha_hat"] > 0.5 for r in oracle)                   # proposes the target's own tokens

    rf = [r for r in records if r["kind"] == "roofline"]
    assert {r["batch"] for r in rf} == {1, 2}
    for r in rf:
        for key in ("weight_bytes", "bytes_per_decode_step", "roofline_tokens_per_s", "fraction_of_roofline",
                    "roofline_tokens_per_s_full_cache"):
            assert _positive(r[key]), (key, r[key])

    fc = [r for r in records if r["kind"] == "forward_cost"]
    assert {(r["batch"], r["k"]) for r in fc} == {(b, k) for b in (1, 2) for k in (1, 2, 3)}
    for r in fc:
        assert _positive(r["median_s"]) and _positive(r["relative_to_k1"])
        if r["k"] == 1:
            assert r["relative_to_k1"] == 1.0

    dc = [r for r in records if r["kind"] == "draft_cost"]
    assert {r["batch"] for r in dc} == {1, 2}
    for r in dc:
        for key in ("forward_1_s", "forward_1_relative_to_target", "propose_s", "propose_per_token_relative_to_target"):
            assert _positive(r[key]), (key, r[key])

    preds = [r for r in records if r["kind"] == "prediction"]
    assert {(r["batch"], r["alpha"]) for r in preds if not r["alpha_is_measured"]} == \
        {(b, a) for b in (1, 2) for a in (0.6, 0.8)}
    for r in preds:
        for key in ("expected_tokens_per_round", "speedup_cost_model", "round_time_cost_model_s",
                    "speedup_early_exit_round", "speedup_oracle_round_plus_draft"):
            assert _positive(r[key]), (key, r[key])
        assert 0 <= r["best_gamma_cost_model"] <= 2


def test_markdown_report(bench):
    out, _, stdout = bench
    md = (out / "README.md").read_text()
    for heading in ("Memory bandwidth", "Target-only decoding and the roofline", "k-token forward cost",
                    "Draft cost", "Speculative decoding (measured)", "Predicted speedup from the measured costs"):
        assert f"## {heading}" in md
    assert "Random weights" in md
    assert "tokens/s" in stdout and "predicted speedup" in stdout
