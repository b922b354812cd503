"""End to end run of the speed benchmark (experiments/bench_speed) on the tiny random model.

One subprocess runs the command as a user would, with tiny settings, into a temp dir; the test
checks the JSONL records (kinds, fields, provenance) and the Markdown summary, and that every
measured number is finite and positive. No timing assertions: CI machines are noisy.
XLA's backend optimisation is turned down in the subprocess so compilation stays cheap (the
numbers of this run mean nothing anyway).
"""

import math
import pathlib

import pytest

from _bench_run import run_module

REPO = pathlib.Path(__file__).resolve().parents[1]

ARGS = ["--model", "tiny", "--num_prompts", "2", "--max_new_tokens", "24", "--repeats", "3",
        "--temperatures", "0", "--drafters", "ngram,early_exit,adaptive_ngram", "--ngram_gamma", "2",
        "--early_exit_gamma", "2", "--adaptive_gammas", "0,2", "--max_k", "3", "--cost_iters", "3",
        "--bandwidth_gib", "0.03", "--pad_multiple", "32", "--torch_threads", "1", "--memory_prompts", "1"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return run_module("experiments.bench_speed.run", ARGS, tmp_path_factory.mktemp("bench_speed"))


def test_jsonl_provenance(bench):
    _, records, _ = bench
    assert records
    for r in records:
        prov = r["provenance"]
        assert prov["git_commit"] is None or len(prov["git_commit"]) == 40
        assert "git_dirty" in prov
        assert len(prov["model_sha256"]) == 64
        assert prov["prompt_ids"] and all(q % 4 == 0 for q in prov["prompt_ids"])   # held-out split only
        assert prov["machine"]["cpu_model"] and prov["machine"]["cpu_count"] >= 1
        for lib in ("jax", "flax", "numpy"):
            assert prov["machine"][lib]
    kinds = {r["kind"] for r in records}
    assert {"setup", "memory", "bandwidth", "forward_cost", "draft_cost", "generation", "roofline", "summary"} <= kinds


def test_generation_records(bench):
    _, records, _ = bench
    gen = [r for r in records if r["kind"] == "generation" and r["framework"] == "specjax"]
    methods = {r["method"] for r in gen}
    assert methods == {"target_only", "ngram", "early_exit", "adaptive_ngram"}
    for r in gen:
        assert r["new_tokens"] == 24                       # the tiny model has no EOS
        for key in ("total_s", "prefill_s", "decode_s", "tokens_per_s", "e2e_tokens_per_s"):
            assert _positive(r[key]), (r["method"], key, r[key])
        assert r["compiles_during_timing"] == 0, "a timed run recompiled"
        assert r["rounds"] >= 1 and r["committed"] == r["new_tokens"]
        assert len(r["accepted_at"]) == len(r["tested_at"])
        assert all(a <= t for a, t in zip(r["accepted_at"], r["tested_at"]))
        if r["method"] != "target_only":
            assert r["greedy_matches_target_only"] is True, r["method"]
    # the first configuration run of each kind paid its compile in the warm-up
    for m in methods:
        assert _positive(sum(r["compile_s"] for r in gen if r["method"] == m))
    hf = [r for r in records if r["kind"] == "generation" and r["framework"] == "transformers"]
    if hf:   # torch + transformers installed: the same tiny model through transformers
        assert {r["method"] for r in hf} == {"target_only", "prompt_lookup"}
        for r in hf:
            assert r["new_tokens"] == 24 and _positive(r["e2e_tokens_per_s"]) and _positive(r["tokens_per_s"])


def test_costs_and_roofline(bench):
    _, records, _ = bench
    fc = [r for r in records if r["kind"] == "forward_cost" and r["model"] == "target"]
    assert sorted(r["k"] for r in fc) == [1, 2, 3]
    assert all(_positive(r["median_s"]) and _positive(r["relative_to_k1"]) for r in fc)
    assert any(r["kind"] == "forward_cost" and r["model"].startswith("early_exit") for r in records)
    dc = [r for r in records if r["kind"] == "draft_cost"]
    assert {(r["drafter"], r["gamma"]) for r in dc} == {("ngram", 2), ("early_exit", 2)}
    assert all(_positive(r["median_s"]) for r in dc)
    bw = next(r for r in records if r["kind"] == "bandwidth")
    assert all(_positive(v["gb_per_s"]) for v in bw["threads"].values())
    rf = next(r for r in records if r["kind"] == "roofline")
    for key in ("weight_bytes", "bytes_per_decode_step", "bandwidth_gb_per_s", "roofline_tokens_per_s",
                "specjax_tokens_per_s", "specjax_fraction", "mean_context_tokens"):
        assert _positive(rf[key]), key
    setup = next(r for r in records if r["kind"] == "setup")
    assert rf["weight_bytes"] > 0 and setup["num_layers"] == 6


def test_memory_record(bench):
    _, records, _ = bench
    (mem,) = [r for r in records if r["kind"] == "memory"]
    for key in ("rss_after_import", "peak_rss", "peak_above_import", "target_param_bytes", "target_kv_bytes",
                "reference_bytes", "ratio", "live_array_bytes"):
        assert _positive(mem[key]), (key, mem[key])
    assert mem["peak_rss"] > mem["rss_after_import"]
    assert mem["reference_bytes"] == (mem["target_param_bytes"] + mem["draft_param_bytes"] + mem["target_kv_bytes"]
                                      + mem["draft_state_bytes"])
    assert mem["ratio"] == pytest.approx(mem["peak_above_import"] / mem["reference_bytes"])
    assert mem["holds"] == (mem["ratio"] <= mem["target_ratio"] == 1.5)
    # tiny has no distilled draft: the early-exit draft, which reuses the target's arrays and cache
    assert mem["drafter"] == "early_exit" and mem["draft_param_bytes"] == 0 and mem["draft_state_bytes"] == 0
    setup = next(r for r in records if r["kind"] == "setup")
    layers, kv_heads, head_dim = setup["num_layers"], 2, 16                    # workload.TINY_CONFIG
    assert mem["target_kv_bytes"] == 2 * layers * kv_heads * head_dim * mem["capacity"] * 4 + 4   # K, V + lengths
    assert [s["stage"] for s in mem["stages"]] == ["import", "backend", "load", "drafter", "target_only",
                                                   "speculative"]
    assert all(s["new_tokens"] == [24] for s in mem["stages"][-2:])


def test_summaries(bench):
    _, records, _ = bench
    sums = {(r["framework"], r["method"], r["category"]): r for r in records if r["kind"] == "summary"}
    for method in ("ngram", "early_exit", "adaptive_ngram"):
        s = sums[("specjax", method, "all")]
        for key in ("tokens_per_s", "speedup", "tokens_per_target_pass", "predicted_speedup_iid",
                    "predicted_speedup_per_position"):
            assert _positive(s[key]), (method, key, s[key])
        assert s["greedy_matches"] == s["n_prompts"] == 2
    for method in ("ngram", "early_exit"):
        s = sums[("specjax", method, "all")]
        assert 0 <= s["alpha_hat"] <= 1
        assert len(s["per_position_acceptance"]) == 2
    cats = {k[2] for k in sums if k[0] == "specjax"}
    assert {"writing", "roleplay", "all"} <= cats          # 2 prompts: the first two categories
    hf = sums.get(("transformers", "prompt_lookup", "all"))
    if hf is not None:   # specjax's fastest speculative method over transformers' assisted generation
        best = max((sums[("specjax", m, "all")] for m in ("ngram", "early_exit", "adaptive_ngram")),
                   key=lambda s: s["tokens_per_s"])
        assert hf["specjax_best_speculative_method"] == best["method"]
        assert hf["specjax_best_speculative_over_this"] == pytest.approx(best["tokens_per_s"] / hf["tokens_per_s"])


def test_markdown(bench):
    out, records, stdout = bench
    md = (out / "README.md").read_text()
    commit = records[0]["provenance"]["git_commit"]
    sha = records[0]["provenance"]["model_sha256"]
    assert sha in md and (commit is None or commit in md)
    for heading in ("## 1. Target-only", "## 2. Memory roofline", "## 3. Cost of a k-token forward",
                    "## 4. Speculative decoding", "## 5. Speedup per Spec-Bench category",
                    "## 7. Peak resident memory"):
        assert heading in md
    for method in ("ngram", "early_exit", "adaptive_ngram"):
        assert f"| {method} |" in md
    if any(r["kind"] == "generation" and r["framework"] == "transformers" for r in records):
        assert "## 6. specjax speculative decoding vs transformers assisted generation" in md
    assert "tokens/s" in stdout and "README.md" in stdout


def test_round_profile_runs_on_the_tiny_model(tmp_path):
    """profile_round.py end to end (ngram, greedy): every piece of a round is reported and finite."""
    _, records, _ = run_module("experiments.bench_speed.profile_round",
                               ["--model", "tiny", "--drafters", "ngram", "--temperatures", "0", "--iters", "2",
                                "--max_new_tokens", "12", "--gamma", "2"], tmp_path, records_file="profile_round.jsonl")
    kinds = {r["what"] for r in records}
    assert kinds == {"target_only", "adaptive_pinned_at_0", "round"}
    (rnd,) = [r for r in records if r["what"] == "round"]
    for key in ("round_ms", "draft_ms", "verify_forward_ms", "target_step_1_ms", "target_only_per_token_ms"):
        assert _positive(rnd[key]), key
    assert math.isfinite(rnd["unattributed_ms"]) and rnd["tokens_per_round"] >= 1.0
    assert records[0]["provenance"]["args"]["layers"] == "fused"


def test_op_profile_runs_on_the_tiny_model(tmp_path):
    """op_profile.py end to end: the decode loop's operations are attributed per extra token
    (matrix products included) and the generation loop itself is kept apart from the
    operations it contains."""
    _, records, _ = run_module("experiments.bench_speed.op_profile",
                               ["--model", "tiny", "--contexts", "20", "--short", "4", "--long", "12",
                                "--forward_k", "1,3"], tmp_path, records_file="op_profile.jsonl")
    rec, fwd1, fwd3 = records
    assert (fwd1["forward_k"], fwd3["forward_k"]) == (1, 3) and fwd3["context"] == 20
    assert fwd1["profiled_ms_per_call"] > 0 and fwd3["profiled_ms_per_call"] > 0
    assert rec["context"] == 20 and rec["tokens"] == [4, 12]
    assert "while" not in rec["ops"] and "while" in rec["control_flow_ms_per_token"]
    assert rec["provenance"]["args"]["layers"] == "fused"
    matmul_calls = sum(v["calls_per_token"] for k, v in rec["ops"].items() if k in ("dot", "ynn_fusion"))
    assert matmul_calls >= 1 and rec["profiled_ms_per_token"] > 0
    assert all(math.isfinite(v["ms_per_token"]) for v in rec["ops"].values())
