"""Extension points: a drafter kind is one module. The drafter below, with its settings (its own
config key ``lookback``), its check and what a run says about it, is defined and registered in
this test module alone, and runs through `specjax generate` and `specjax bench` with that key set
from the command line (no other file names it), with greedy output equal to target-only's; the
engine reads what a drafter needs from its declared `Capabilities`, never by probing; verifiers
come from one registry by draft kind and sampling mode."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import _cli_tiny
from specjax import cli, decoding, drafters, sampling, verify


@dataclasses.dataclass(frozen=True)
class LookbackSettings:
    lookback: int = 3           # the config key this kind adds: how far back to copy


@dataclasses.dataclass(frozen=True)
class LookbackDrafter:
    """Proposes the tokens that came ``back`` positions earlier (one-hot q: deterministic)."""
    vocab_size: int
    back: int
    capabilities = drafters.Capabilities()          # no features, no cache, chains only

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return jnp.zeros((prompt_BP.shape[0],), jnp.int32)      # batch-major state: proposals made

    def propose(self, params, state, context, key_B, gamma, cfg):
        idx = context.lengths_B[:, None] - self.back + jnp.arange(gamma)[None]
        tokens_BG = jnp.take_along_axis(context.tokens_BS, jnp.clip(idx, 0, context.tokens_BS.shape[1] - 1), axis=1)
        return tokens_BG.astype(jnp.int32), jax.nn.one_hot(tokens_BG, self.vocab_size), state + gamma

    def commit(self, state, new_lengths_B, accepted=None):
        return state

    def forward_passes(self, gamma):
        return 0

    def check_tree(self, tree):
        raise ValueError("chains only")


def _build(settings: LookbackSettings, ctx: drafters.BuildContext):
    return LookbackDrafter(ctx.target.vocab_size, settings.lookback), None


def _check(settings: LookbackSettings, job: drafters.DraftJob):
    if settings.lookback < 1:
        raise ValueError(f"lookback={settings.lookback}: expected an integer >= 1")


def _describe(settings: LookbackSettings, drafter, record: drafters.RunRecord):
    return f"copied from {drafter.back} tokens back", {"lookback": drafter.back}


@pytest.fixture
def registered():
    drafters.register_drafter("test_lookback", LookbackSettings, _build, check=_check, describe=_describe,
                              description="copy from n tokens back")
    yield
    drafters.unregister_drafter("test_lookback")


def _generate(target, *extra):
    return cli.dispatch(["specjax", "generate", "--config=configs/generate.py", f"--config.target={target}",
                         "--config.drafter=test_lookback", "--config.adaptive_gamma=False", "--config.gamma=2",
                         "--config.max_new_tokens=12", "--config.compilation_cache_dir=", "--config.calibration_cache=",
                         *extra])


def test_a_registered_drafter_runs_through_generate_with_its_own_key(registered, tmp_path, capsys):
    target, _ = _cli_tiny.write_pair(tmp_path / "pair")
    stats = tmp_path / "stats.jsonl"
    assert _generate(target, "--config.lookback=2", f"--config.metrics_jsonl={stats}") == 0
    row = json.loads(stats.read_text())
    assert row["drafter"] == "test_lookback" and row["lookback"] == 2           # its describe's stats
    assert row["same_tokens_as_target_only"] is True and row["new_tokens"] == 12
    assert row["proposed"] > 0, row
    assert "copied from 2 tokens back" in capsys.readouterr().err               # its describe's text
    assert _generate(target, "--config.lookback=0") == 2                        # its check, before loading
    assert "lookback=0: expected an integer >= 1" in capsys.readouterr().err
    assert "--config.lookback=3" in cli.describe_config(cli.COMMANDS["generate"], "configs/generate.py")


def test_a_registered_drafter_runs_through_bench_with_its_own_key(registered, tmp_path, capsys):
    target, _ = _cli_tiny.write_pair(tmp_path / "pair")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count from one to ten.", "category": "alpha"}) + "\n")
    out = tmp_path / "out"
    assert cli.dispatch(["specjax", "bench", "--config=configs/bench.py", f"--config.target={target}",
                         "--config.drafters=('test_lookback','test_lookback@lookback=1')", "--config.lookback=2",
                         "--config.adaptive_gamma=False", "--config.gamma=2", "--config.max_new_tokens=8",
                         f"--config.prompts={prompts}", f"--config.out={out}", "--config.progress=False",
                         "--config.compilation_cache_dir="]) == 0
    runs = [r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()) if r["kind"] == "run"]
    assert sorted(r["method"] for r in runs) == ["target_only", "test_lookback", "test_lookback@lookback=1"]
    assert all(r["same_as_target_only"] for r in runs if r["method"] != "target_only")
    proposed = {r["method"]: r for r in runs}
    assert proposed["test_lookback"]["tested_at"][0] > 0


def test_unknown_drafters_and_verifiers_are_named(capsys):
    with pytest.raises(ValueError, match="drafter='nope': expected one of distilled, early_exit, early_exit_own_cache, model, head, parallel, ngram"):
        drafters.drafter_kind("nope")
    assert cli.dispatch(["specjax", "generate", "--config=configs/generate.py", "--config.drafter=nope"]) == 2
    assert "drafter='nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tree verifier 'flat'"):
        verify.get_verifier("tree", "flat")
    with pytest.raises(ValueError, match="verifier must be one of"):
        decoding.GenerationConfig(8, gamma=2, verifier="flat")
    with pytest.raises(TypeError, match="frozen dataclass"):
        drafters.register_drafter("bad", dict, _build)


def test_verifiers_come_from_the_registry_by_kind_and_mode():
    greedy, t1 = sampling.SamplingConfig.make(0.0), sampling.SamplingConfig.make(1.0)
    c = decoding.GenerationConfig(8, gamma=2, verifier="block", tree_verifier="recursive")
    assert type(c.verifier_for(greedy)) is verify.GreedyVerifier
    assert type(c.verifier_for(t1)) is verify.BlockVerifier
    assert type(c.tree_verifier_for(greedy)) is verify.GreedyTreeVerifier
    assert type(c.tree_verifier_for(t1)) is verify.RecursiveRejectionVerifier

    @dataclasses.dataclass(frozen=True)
    class Flat(verify.TokenVerifier):
        pass

    verify.register_verifier("chain", "test_flat", Flat)
    try:
        assert type(decoding.GenerationConfig(8, gamma=2, verifier="test_flat").verifier_for(t1)) is Flat
    finally:
        verify._registry._VERIFIERS.pop(("chain", "test_flat"))


def test_the_engine_reads_declared_capabilities():
    """A drafter that declares no trees is refused a tree by the engine (before its own
    check_tree runs); one that declares feature layers makes the engine keep features."""
    from _toy import TabularModel
    from specjax import trees
    tm = TabularModel(8)
    with pytest.raises(ValueError, match="chains only \\(capabilities.trees=False\\)"):
        decoding.Engine(tm, LookbackDrafter(8, 2), decoding.GenerationConfig(8, gamma=trees.TreeShape.from_branching((2,))))

    @dataclasses.dataclass(frozen=True)
    class Reads(LookbackDrafter):
        capabilities = drafters.Capabilities(feature_layers=(0,))

    with pytest.raises(ValueError, match="reads the target's hidden features"):
        decoding.Engine(tm, Reads(8, 2), decoding.GenerationConfig(8, gamma=2))
