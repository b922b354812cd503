"""Extension points (issue 40 item 2): a drafter defined here, registered with its own frozen
settings and builder, runs through `specjax generate`'s code path (config check, build, engine,
stats) with greedy output equal to target-only's; the engine reads what a drafter needs from
its declared `Capabilities`, never by probing; verifiers come from one registry by draft kind
and sampling mode."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import _cli_tiny
from specjax import cli, decoding, drafters, sampling, verify


@dataclasses.dataclass(frozen=True)
class LookbackSettings:
    max_ngram: int = 3          # read from the generation config's key of that name: how far back to copy


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
    return LookbackDrafter(ctx.target.vocab_size, settings.max_ngram), None


@pytest.fixture
def registered():
    drafters.register_drafter("test_lookback", LookbackSettings, _build, description="copy from n tokens back")
    yield
    drafters.unregister_drafter("test_lookback")


def test_a_registered_drafter_runs_through_generate(registered, tmp_path, capsys):
    target, _ = _cli_tiny.write_pair(tmp_path / "pair")
    stats = tmp_path / "stats.jsonl"
    assert cli.dispatch(["specjax", "generate", "--config=configs/generate.py", f"--config.target={target}",
                         "--config.drafter=test_lookback", "--config.max_ngram=2", "--config.adaptive_gamma=False",
                         "--config.gamma=2", "--config.max_new_tokens=12", "--config.compilation_cache_dir=",
                         "--config.calibration_cache=", f"--config.metrics_jsonl={stats}"]) == 0
    row = json.loads(stats.read_text())
    assert row["drafter"] == "test_lookback"
    assert row["same_tokens_as_target_only"] is True and row["new_tokens"] == 12
    assert row["proposed"] > 0, row


def test_unknown_drafters_and_verifiers_are_named(capsys):
    with pytest.raises(ValueError, match="drafter='nope': expected one of distilled, head, ngram"):
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
