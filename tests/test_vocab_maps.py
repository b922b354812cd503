"""Vocabulary maps a draft scores through (issue 39, defect 1): a reduced head's ``head_ids`` in a
draft-head or draft directory are checked when loaded (the sha256 in head.json / draft.json
guards against damage, not against an edited or foreign file whose hash was recomputed), and
the engine discards any round whose draft q is not a distribution over the vocabulary.

Before: repeated ids loaded and gave a q summing to 0.5 (the acceptance ratio doubled at T > 0,
the output no longer the target's distribution); ids >= the vocabulary gave NaN q (every round
silently gamma = 0); negative ids were accepted."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from specjax import decoding, distill, drafters, models, sampling
from specjax.models.draft_artifact import load_draft, save_draft, write_tensors
from specjax.models.reduced_head import check_vocab_map

import _distill_toy as toy
from _toy import TabularModel, random_table


@pytest.mark.parametrize("ids,size,match", [
    ([0, 3, 3, 7], 4, "1 repeated vocabulary-map ids .e.g. 3."),
    ([0, 3, 64, 7], 4, "outside \\[0, 64\\) .e.g. 64."),
    ([0, -1, 5, 7], 4, "outside \\[0, 64\\) .e.g. -1."),
    ([0, 1, 2], 4, "shape \\(3,\\), the draft declares 4"),
    ([[0, 1], [2, 3]], 4, "shape \\(2, 2\\)"),
    ([0.0, 1.5, 2.0, 3.0], 4, "non-integer"),
])
def test_bad_vocab_maps_are_named(ids, size, match):
    with pytest.raises(models.CorruptCheckpointError, match="where.txt: .*" + match):
        check_vocab_map(np.asarray(ids), 64, size, "where.txt")


def test_good_vocab_map_passes():
    np.testing.assert_array_equal(check_vocab_map(np.asarray([5, 1, 63], np.int32), 64, 3, "w"), [5, 1, 63])


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory):
    d = toy.write_target(tmp_path_factory.mktemp("vm") / "target")
    target, params = models.load(str(d))
    return target, params


def _rewrite_ids(path, desc_path, new_ids):
    """Edit a safetensors file's head_ids and record the new file's sha256 (a foreign or edited
    file that passes the hash check)."""
    tensors = dict(load_file(str(path)))
    tensors["head_ids"] = np.asarray(new_ids, np.int32)
    sha = write_tensors(path, tensors, "float32")
    desc = json.loads(desc_path.read_text())
    desc["sha256"] = sha
    desc_path.write_text(json.dumps(desc))


@pytest.mark.parametrize("edit,match", [(lambda ids: np.r_[ids[:-1], ids[0]], "repeated"),
                                        (lambda ids: np.r_[ids[:-1], 64], "outside"),
                                        (lambda ids: np.r_[-1, ids[1:]], "outside")])
def test_a_head_with_a_bad_vocabulary_map_is_refused(toy_target, tmp_path, edit, match):
    target, tparams = toy_target
    hc = drafters.HeadConfig.make("eagle", target.config, head_size=20)
    own = drafters.init_head_params(hc, jax.random.key(0), head_ids=np.arange(20) * 3)
    drafters.save_head(tmp_path / "h", hc, own, dtype="float32")
    drafters.load_head(tmp_path / "h", target, tparams)                      # as written: fine
    ids = np.asarray(load_file(str(tmp_path / "h" / "head.safetensors"))["head_ids"])
    _rewrite_ids(tmp_path / "h" / "head.safetensors", tmp_path / "h" / "head.json", edit(ids))
    with pytest.raises(models.CorruptCheckpointError, match=f"head.safetensors 'head_ids'.*{match}"):
        drafters.load_head(tmp_path / "h", target, tparams)


def test_a_draft_with_a_bad_vocabulary_map_or_config_is_refused(toy_target, tmp_path):
    target, tparams = toy_target
    choice = distill.DraftChoice(layers=(1,), head_vocab=24)
    draft, params = distill.build_draft(choice, target, tparams, key=jax.random.key(0), head_ids=np.arange(24) * 2)
    save_draft(tmp_path / "d", draft, params, shared=choice.shared, dtype="float32")
    load_draft(tmp_path / "d", target, tparams)
    ids = np.asarray(load_file(str(tmp_path / "d" / "draft.safetensors"))["head_ids"])
    _rewrite_ids(tmp_path / "d" / "draft.safetensors", tmp_path / "d" / "draft.json", np.r_[ids[:-1], ids[3]])
    with pytest.raises(models.CorruptCheckpointError, match="draft.safetensors 'head_ids'.*repeated"):
        load_draft(tmp_path / "d", target, tparams)
    # draft.json's model config with a key ModelConfig does not know: one line, not a TypeError
    desc = json.loads((tmp_path / "d" / "draft.json").read_text())
    desc["config"]["colour"] = "blue"
    (tmp_path / "d" / "draft.json").write_text(json.dumps(desc))
    with pytest.raises(models.CorruptCheckpointError, match="draft.json: its 'config' is not a model config.*colour"):
        load_draft(tmp_path / "d", target, tparams)


@dataclasses.dataclass(frozen=True)
class HalfMassDrafter(drafters.ModelDrafter):
    """Row 0's q carries half the probability mass (what a repeated vocabulary-map id does)."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, q, state = super().propose(params, state, context, key_B, gamma, cfg)
        return toks, q.at[0].multiply(0.5), state


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_never_verifies_a_q_that_is_not_a_distribution(temperature):
    V = 5
    model = TabularModel(V)
    target = random_table(jax.random.key(0), V)
    draft = target + 0.5 * random_table(jax.random.key(1), V)
    prompts, key = [[1, 2, 3], [4, 0], [2]], jax.random.key(2)
    config = decoding.GenerationConfig(24, gamma=3)
    batch = decoding.make_batch(prompts, config, key)
    out = decoding.Engine(model, HalfMassDrafter(model), config).run(
        decoding.EngineParams(target=target, draft=draft), sampling.SamplingConfig.make(temperature), batch)
    m = jax.device_get(out.metrics)
    assert m.invalid_draft_rounds_B[0] == m.rounds_B[0] == 24          # every round of row 0: gamma = 0
    assert m.accepted_B[0] == 0 and m.proposed_B[0] == 0
    assert m.invalid_draft_rounds_B[1:].sum() == 0 and m.accepted_B[1:].sum() > 0
    assert out.metrics.summary()["invalid_draft_rounds"] == 24
