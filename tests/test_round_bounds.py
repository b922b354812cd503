"""Issue 39 item 5: gamma and tree sizes are bounded, and a round's memory is estimated from the
settings and the target's header and refused with the numbers, all before any weights load
(``gamma=20000`` and ``tree=branching:9000`` used to load the model and die in XLA with
RESOURCE_EXHAUSTED; ``branching:64,64`` gave no token in 300 s). Also from the issue's minor
list: a tree the n-gram drafter cannot draft is refused before the model loads."""
import math
import os
import pathlib
import subprocess
import sys

import pytest

from configs import generate
from specjax import build, decoding, models, trees
from specjax.models import registry

REPO = pathlib.Path(__file__).resolve().parents[1]
SMOLLM = "smollm2-135m-instruct"


@pytest.fixture
def no_load(monkeypatch):
    """Make every model loader fail the test if called: a refusal must come first."""
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were refused")

    for name in ("load", "load_with_tokenizer"):
        monkeypatch.setattr(models, name, fail)


def _config(**overrides):
    return build.generate_settings(generate.get_config(), **overrides)


@pytest.mark.parametrize("overrides,message", [
    (dict(gamma=20000), r"^gamma=20000: expected at most 64 "),
    (dict(adaptive_gamma=True, adaptive_gammas=(0, 1, 20000)), r"^adaptive_gammas=\(0, 1, 20000\): expected integers <= 64"),
    (dict(drafter="distilled", tree="branching:9000"), r"^tree='branching:9000': .*9,000 nodes, expected at most 1024"),
    (dict(drafter="distilled", tree="branching:64,64"), r"^tree='branching:64,64': .*4,160 nodes, expected at most 1024"),
    (dict(drafter="distilled", tree="chain:65"), r"^tree='chain:65': .*depth 65, expected at most 64"),
    (dict(drafter="distilled", tree="dynamic:9,40,60"), r"^tree='dynamic:9,40,60': .*12,840 candidates.*at most 4096"),
    (dict(drafter="distilled", adaptive_gamma=True, adaptive_trees=("branching:9000",)),
     r"^adaptive_trees=\('branching:9000',\): .*9,000 nodes"),
])
def test_gamma_and_trees_above_the_maxima_are_refused_before_the_model_loads(no_load, overrides, message):
    with pytest.raises(ValueError, match=message):
        build.load_generator(_config(**overrides))


def test_a_huge_branching_is_refused_without_building_it(monkeypatch):
    """The node count is counted, not built: a 10^18-node tree string is refused at once."""
    for branching in ((2, 2, 1), (3, 1, 1, 1), (5,), (4, 3, 2, 1)):
        assert trees.branching_nodes(branching) == trees.TreeShape.from_branching(branching).num_nodes

    def no_build(*args, **kwargs):
        raise AssertionError("the tree was built before its size was checked")

    monkeypatch.setattr(trees.TreeShape, "from_branching", no_build)
    with pytest.raises(ValueError, match=r"1,000,001,000,001,000,000 nodes, expected at most 1024"):
        trees.parse_tree("branching:1000000,1000000,1000000")


def test_the_maxima_themselves_are_accepted(monkeypatch, no_load):
    monkeypatch.setattr(build, "available_memory", lambda: 64 * 10 ** 9, raising=False)
    assert trees.parse_tree("chain:64").num_nodes == 64
    assert trees.parse_tree(f"branching:{trees.MAX_TREE_NODES}").num_nodes == trees.MAX_TREE_NODES
    build.check_config(_config(gamma=build.MAX_GAMMA))
    build.check_config(_config(drafter="distilled", tree=f"branching:{trees.MAX_TREE_NODES}"))
    build.check_config(_config(drafter="distilled", tree="dynamic:8,10,60"))      # EAGLE-2-sized


@pytest.mark.parametrize("overrides", [
    dict(gamma=4), dict(gamma=3, adaptive_gamma=True), dict(drafter="distilled", tree="branching:2,2,1"),
    dict(drafter="ngram", tree="branching:3,1,1,1"), dict(drafter="head", tree="dynamic:4,3,12"),
    dict(drafter="none")])
def test_normal_settings_are_accepted(monkeypatch, no_load, overrides):
    monkeypatch.setattr(build, "available_memory", lambda: 64 * 10 ** 9, raising=False)
    build.check_config(_config(**overrides))


def test_param_count_is_the_parameter_shapes():
    """`param_count` against a hand count and against the model's own parameter shapes."""
    cfg = models.ModelConfig(vocab_size=100, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=4, ffn_size=32)
    # embed 100 x 16; per layer: q|k|v 16 x (16 + 8 + 8), o 16 x 16, gate/up/down 3 x 16 x 32,
    # two norms of 16; the final norm.
    assert build.param_count(cfg) == 1600 + 2 * (512 + 256 + 1536 + 32) + 16 == 6288
    from specjax.models import llama
    for c in (cfg, cfg.replace(tie_embeddings=False), cfg.replace(attention_bias=True)):
        leaves = [spec[0] for spec in llama.param_specs(c)["layers"].values()] + [
            spec[0] for name, spec in llama.param_specs(c).items() if name != "layers"]
        assert build.param_count(c) == sum(math.prod(shape) for shape in leaves)


def test_round_memory_matches_a_hand_computation():
    cfg = models.ModelConfig(vocab_size=100, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=4, ffn_size=32)
    got = build.round_memory(cfg, block=5, capacity=64, draft_rows=4, batch=2)
    assert got == {
        "weights": 6288 * 4,
        "kv_cache": 2 * 2 * 2 * (2 * 4) * 64 * 4,       # layers x (k, v) x batch x kv heads x head_dim x slots x 4 B
        "attention_scores": 3 * 2 * 4 * 5 * (64 + 5) * 4,   # 3 x batch x heads x block x (slots + block) x 4 B
        "tree_mask": 0,
        "logits": 2 * 2 * 5 * 100 * 4,                  # logits and p: batch x block x vocab x 4 B
        "draft_q": 2 * 4 * 100 * 4,                     # batch x drafted x vocab x 4 B
    }
    tree = build.round_memory(cfg, block=5, capacity=64, draft_rows=5, batch=2, tree=True, dtype="bfloat16")
    assert tree["tree_mask"] == 2 * 5 * (64 + 5)
    assert tree["weights"] == 6288 * 2 and tree["kv_cache"] == got["kv_cache"] // 2


def test_round_memory_reproduces_the_issues_out_of_memory_requests():
    """The attention scores of SmolLM2-135M's round (a prompt of 30 tokens, max_new_tokens 128)
    are the two allocations XLA refused in the issue: 86.8 GB at gamma 20000 and 17.7 GB for
    branching:9000."""
    smollm = registry.known_config(SMOLLM)
    for gamma, requested in ((20000, 86.8e9), (trees.TreeShape.from_branching((9000,)), 17.7e9)):
        config = decoding.GenerationConfig(max_new_tokens=128, gamma=gamma)
        est = build.round_memory(smollm, block=config.max_block + 1, capacity=build.round_capacity(config, 30),
                                 draft_rows=build.draft_rows(gamma), tree=config.has_trees)
        assert round(est["attention_scores"] / 1e8) == round(requested / 1e8), est


@pytest.mark.parametrize("overrides,setting", [
    (dict(gamma=4), "gamma=4"), (dict(drafter="distilled", tree="branching:2,2,1"), "tree='branching:2,2,1'"),
    (dict(drafter="none"), "max_new_tokens=128"),
    (dict(adaptive_gamma=True, adaptive_gammas=(0, 2, 4)), r"adaptive_gammas=\(0, 2, 4\)")])
def test_a_round_that_does_not_fit_is_refused_with_the_numbers(monkeypatch, no_load, overrides, setting):
    monkeypatch.setattr(build, "available_memory", lambda: 10 ** 8)
    c = _config(**overrides)
    with pytest.raises(ValueError, match=rf"^{setting}: a round needs an estimated 0\.5\d GB \(weights 0\.54 GB, .*"
                                         rf"but 0\.10 GB of memory is available"):
        build.load_generator(c)


def test_the_estimate_reads_a_local_targets_header(tmp_path, monkeypatch, no_load):
    """A Hugging Face directory's config.json gives the estimate (no weights read)."""
    import jax
    cfg = models.ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=8, ffn_size=32, max_position=4096)
    model = models.Llama(cfg)
    models.export_hf(model, model.init_params(jax.random.key(0)), tmp_path / "ckpt")
    c = _config(target=str(tmp_path / "ckpt"), drafter="ngram", gamma=8, max_new_tokens=4000)
    want = build.round_memory(cfg, block=9, capacity=4032, draft_rows=8)
    monkeypatch.setattr(build, "available_memory", lambda: sum(want.values()))
    build.check_config(c)                                      # exactly fits
    monkeypatch.setattr(build, "available_memory", lambda: sum(want.values()) - 1)
    with pytest.raises(ValueError, match=r"^gamma=8: a round needs .*a block of 9 tokens over a cache of 4,032 slots"):
        build.check_config(c)


@pytest.mark.parametrize("overrides,message", [
    (dict(drafter="ngram", tree="branching:2,2,1"), r"^tree='branching:2,2,1': the n-gram drafter drafts k chains"),
    (dict(drafter="ngram", adaptive_gamma=True, adaptive_trees=("branching:2,2",)),
     r"^adaptive_trees=\('branching:2,2',\): the n-gram drafter drafts k chains"),
    (dict(drafter="ngram", tree="dynamic:4,3,12"), r"^tree='dynamic:4,3,12': the n-gram drafter")])
def test_a_tree_the_ngram_drafter_cannot_draft_is_refused_before_the_model_loads(no_load, overrides, message):
    with pytest.raises(ValueError, match=message):
        build.load_generator(_config(**overrides))


def test_the_recorded_header_of_a_known_model_is_its_files():
    path = registry.resolve(SMOLLM)         # fetched into the cache when absent, as the GGUF parity tests do
    from specjax.models import gguf_loader
    assert registry.known_config(SMOLLM) == gguf_loader.config_from_gguf(gguf_loader.open_gguf(path), path=path)


def test_a_known_targets_context_is_checked_from_its_recorded_header(no_load):
    """max_new_tokens against a registry name's context length, before anything is fetched."""
    with pytest.raises(ValueError, match="max_new_tokens=8192: .*context length 8192"):
        build.check_config(_config(max_new_tokens=8192))


def test_cli_refuses_gamma_20000_in_one_line():
    env = dict(os.environ, JAX_PLATFORMS="")
    out = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--config=configs/generate.py",
                          "--config.gamma=20000"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("specjax: error: gamma=20000: expected at most 64")
