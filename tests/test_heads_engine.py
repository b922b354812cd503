"""Feature-level draft heads in the engine: bad setups, the packed layout, prefill reuse.

Errors (head configs and engine setups named); the packed CPU layout drafts as the plain
layout; `Engine.prefill` reuse and the scheduler's refill with head rows
(test_prefill_reuse_with_medusa_head: a Medusa engine cannot reuse its own prefill, see its
docstring).
"""

from __future__ import annotations

import dataclasses
import json
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, distill, drafters, sampling, trees
from specjax.drafters import heads
from specjax.models.reduced_head import ReducedHeadLlama
from _heads_common import (CFG, D, GREEDY, PACKED_CFG, PROMPTS, V, _assert_target_tokens, _drafter,
                           _eagle_setup, _eagle_stepped, _gen, _head, _head_config, _medusa_stepped, _own_params, _packed_target,
                           _propose_once, _target, _target_only)


def test_head_config_errors():
    with pytest.raises(ValueError, match="kind"):
        drafters.HeadConfig.make("hydra", CFG)
    for layers in [(4,), (-5,), ()]:
        with pytest.raises(ValueError, match="feature layers"):
            drafters.HeadConfig.make("eagle3", CFG, feature_layers=layers)
    with pytest.raises(ValueError, match="one feature layer"):
        drafters.HeadConfig.make("eagle", CFG, feature_layers=(0, -1))
    with pytest.raises(ValueError, match="num_heads"):
        drafters.HeadConfig.make("medusa", CFG, num_heads=0)
    with pytest.raises(ValueError, match="head_size"):
        drafters.HeadConfig.make("eagle", CFG, head_size=V + 1)
    hc = drafters.HeadConfig.make("eagle", CFG, head_size=10)
    with pytest.raises(ValueError, match="head_ids"):          # (traced only: nothing to compile)
        jax.eval_shape(lambda k: drafters.init_head_params(hc, k), jax.random.key(0))
    with pytest.raises(ValueError, match="head_ids"):
        jax.eval_shape(lambda k: drafters.init_head_params(hc, k, head_ids=[1] * 10), jax.random.key(0))
    with pytest.raises(ValueError, match="lack"):
        drafters.head_params(drafters.HeadConfig.make("eagle3", CFG), {"fc": None}, _target()[1])


def test_engine_rejects_bad_head_setups():
    model, tp = _target()
    med, hp = _head("medusa", "random")            # 3 heads
    # gamma > num_heads: raised when the engine is built (check_gamma), before any prefill
    with pytest.raises(ValueError, match="at most"):
        decoding.Engine(model, med, _gen(4))
    with pytest.raises(ValueError, match="at most"):            # an adaptive candidate too
        decoding.Engine(model, med, _gen(decoding.AdaptiveGamma(gammas=(0, 2, 4))))
    # token trees: Medusa's are refused when the engine is built (EAGLE heads draft trees)
    for tree in (trees.TreeShape.chain(2), trees.TreeShape.from_branching((2, 1))):
        with pytest.raises(ValueError, match="chains"):
            decoding.Engine(model, med, _gen(tree))
    with pytest.raises(ValueError, match="chains"):
        decoding.Engine(model, med, _gen(decoding.AdaptiveGamma(gammas=(0, 2, trees.TreeShape.chain(2)))))
    # a target that cannot return features
    reduced = ReducedHeadLlama(CFG, head_size=10)
    with pytest.raises(ValueError, match="cannot return them"):
        decoding.Engine(reduced, med, _gen(2))
    decoding.Engine(reduced, med, _gen(0))         # fine without drafting (no features read)
    # a feature head called without features
    eagle, ehp = _head("eagle")
    with pytest.raises(ValueError, match="features"):
        eagle.init(ehp, jnp.zeros((1, 3), jnp.int32), jnp.asarray([3]), 8)
    head = eagle.model
    with pytest.raises(ValueError, match="features"):
        head.apply(ehp, jnp.zeros((1, 1), jnp.int32), head.init_cache(1, 8))


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3_reduced", "parallel_reduced"])
def test_packed_head_drafts_as_the_plain_head(kind, tmp_path):
    """Beside a packed target (the CPU kernel's layout) `load_head` runs the head packed too
    (its matrices as kernel panels, its layer unrolled and fused): at T = 1 with top-k its
    proposals and q equal the plain head's on the plain target (q to 2e-5: another summation
    order), and a greedy engine run with the EAGLE-3 one equals target-only decoding (the parallel
    drafter, EAGLE-3's layer with placeholders, runs the same packed layer). The plain-layout
    config is what is stored: save / load round-trips it."""
    hc = _head_config(kind)
    own = _own_params(hc, "good" if kind != "medusa" else "random")
    drafters.save_head(tmp_path / "h", hc, own, dtype="float32")
    pmodel, ptp = _packed_target()
    dr, hp = drafters.load_head(tmp_path / "h", pmodel, ptp)
    got = dr.config if kind == "medusa" else dr.model.config
    assert got == dataclasses.replace(hc, target=PACKED_CFG, linear_op="panels")
    assert json.loads((tmp_path / "h" / "head.json").read_text())["head"] == hc.to_dict()   # no layout stored
    leaves = hp["medusa_w"] if kind == "medusa" else hp["fc"]
    assert leaves.ndim == 3 and leaves.shape[-1] == 32, "the packed head's matrices are kernel panels"
    samp = sampling.SamplingConfig.make(temperature=1.0, top_k=30)
    plain_model, plain_tp = _target()
    plain = _propose_once(_drafter(hc), drafters.head_params(hc, own, plain_tp), plain_model, plain_tp, samp)
    packed = _propose_once(dr, hp, pmodel, ptp, samp)
    np.testing.assert_array_equal(np.asarray(packed[0]), np.asarray(plain[0]))
    np.testing.assert_allclose(np.asarray(packed[1]), np.asarray(plain[1]), rtol=2e-5, atol=2e-5)
    if kind == "eagle3_reduced":       # (one engine compile: the other kinds' rounds are the same code)
        eng = decoding.Engine(pmodel, dr, _gen(2))
        out = eng.run(decoding.EngineParams(target=ptp, draft=hp), GREEDY,
                      decoding.make_batch(PROMPTS, eng.config, jax.random.key(2)))
        _assert_target_tokens(out)
        assert int(np.asarray(out.metrics.accepted_B).sum()) > 0
    with pytest.raises(ValueError, match="target's linear op is 'xla'"):
        dataclasses.replace(hc, linear_op="panels")
    with pytest.raises(ValueError, match="unknown linear op"):
        dataclasses.replace(hc, target=PACKED_CFG, linear_op="int4")


def test_prefill_reuse_with_eagle_head():
    """`Engine.prefill` once, then `run(..., prefill=pre)` (twice: the prefill is not donated)
    gives exactly the tokens and metrics of the same engine without it (its round-by-round
    run from `init`, the same rounds as `run`); the target-only engine takes the same prefill."""
    eng, ep, batch = _eagle_setup("good")
    pre = eng.prefill(ep, batch)
    assert pre.features_BSF is not None and pre.features_BSF.shape == (len(PROMPTS), batch.capacity, D)
    _, final = _eagle_stepped("good")
    ref = decoding.GenerateOutput.from_state(final)
    for _ in range(2):
        out = eng.run(ep, GREEDY, batch, prefill=pre)
        assert out.generated() == ref.generated() == _target_only()[0]
        for x, y in zip(jax.tree.leaves(out.metrics), jax.tree.leaves(ref.metrics)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(np.asarray(out.metrics.accepted_B).sum()) > 0
    only = decoding.Engine(eng.target, None, _gen(0))       # target-only: the cache-free reference
    assert only.run(decoding.EngineParams(target=ep.target), GREEDY, batch, prefill=pre).generated() \
        == _target_only()[0]
    # a prefill without the target features cannot feed a feature head
    with pytest.raises(ValueError, match="features"):
        eng.run(ep, GREEDY, batch, prefill=dataclasses.replace(pre, features_BSF=None))


def test_a_run_consuming_the_eagle_prefill_equals_the_keeping_run():
    """`run(prefill=pre, consume_prefill=True)` with a feature head (the target's features and
    the head's state donated with the cache), at a fixed gamma: the tokens and metrics of the
    run that keeps the prefill (the program of test_prefill_reuse_with_eagle_head), every
    donated buffer taken (deleted, no unusable-donation warning). (Under adaptive gamma with 0
    among its choices, the loop's switch path:
    test_heads_greedy.py::test_a_run_consuming_the_prefill_under_adaptive_gamma_equals_the_run_without_it.)"""
    import warnings
    eng, ep, batch = _eagle_setup("good")
    want = eng.run(ep, GREEDY, batch, prefill=eng.prefill(ep, batch))
    pre = eng.prefill(ep, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = eng.run(ep, GREEDY, batch, prefill=pre, consume_prefill=True)
    assert got.generated() == want.generated() == _target_only()[0]
    for x, y in zip(jax.tree.leaves(got.metrics), jax.tree.leaves(want.metrics)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert pre.features_BSF.is_deleted()
    assert all(x.is_deleted() for x in jax.tree.leaves(pre.target_cache) if np.ndim(x) > 1)


def test_prefill_reuse_with_medusa_head():
    """The same for a Medusa engine (whose drafter keeps no state): its own prefill must be
    reusable and give the tokens and metrics of the run without it. (It was refused once:
    `Engine.prefill` recorded no drafter when the drafter's state was None, as Medusa's is,
    and the CLI's main path, gen.prefill then stream with prefill=, failed for Medusa.)"""
    model, tp = _target()
    dr, hp = _head("medusa", "random")
    eng = decoding.Engine(model, dr, _gen(3))
    ep = decoding.EngineParams(target=tp, draft=hp)
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    pre = eng.prefill(ep, batch)
    assert pre.features_BSF is not None
    out = eng.run(ep, GREEDY, batch, prefill=pre)
    ref = decoding.GenerateOutput.from_state(_medusa_stepped("random")[1])
    assert out.generated() == ref.generated()
    for x, y in zip(jax.tree.leaves(out.metrics), jax.tree.leaves(ref.metrics)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_scheduler_refills_head_rows():
    """The slot-refilling scheduler with the 'good' EAGLE head (gamma 3, greedy), 8 requests
    (PROMPTS twice) through 4 slots: every request gets the target-only tokens and the same
    accepted counts as its prompt's row of the whole-batch run, so a refilled row's target
    features and head cache hold only its own request (a row left with the previous request's
    features drafts otherwise)."""
    from specjax import serving
    eng, ep, batch = _eagle_setup("good")
    # The whole-batch run of this engine round by round (memoised: test_prefill_reuse_with_eagle_head
    # shows `run` gives its tokens and metrics; no run program compiled for this test alone). Its
    # 4 rows and capacity are the scheduler's slots and capacity: the same round program.
    whole = jax.device_get(decoding.GenerateOutput.from_state(_eagle_stepped("good")[1]).metrics)
    requests = [serving.Request(id=i, prompt=p) for i, p in enumerate(PROMPTS * 2)]
    out = serving.Scheduler(eng, ep, slots=len(PROMPTS), pad_multiple=16, capacity=batch.capacity).run(
        requests, GREEDY, jax.random.key(2), warmup=False)
    assert [r.tokens for r in out.results] == _target_only()[0] * 2
    assert [r.counters["accepted"] for r in out.results] == np.asarray(whole.accepted_B).tolist() * 2
    assert [r.counters["proposed"] for r in out.results] == np.asarray(whole.proposed_B).tolist() * 2
    assert sum(r.counters["accepted"] for r in out.results) > 0


SPEC = distill.LossSpec("fkl", 0.5, 1.0)


class HalfFeatureEagle(heads.Eagle):
    """A head kind defined in this test (one class, one registration): EAGLE reading the
    target's features at half their size, trained with EAGLE's feature regression."""
    name = "test_half_feature_eagle"

    def fuse(self, hc, params, f_BTF):
        return (0.5 * f_BTF).astype(f_BTF.dtype)


def test_a_head_kind_defined_here_drafts_exactly_and_trains():
    """A new kind needs no change anywhere else: registered, it is a `HeadConfig` kind, its
    drafter runs in the engine (greedy equal to the target-only reference, with its proposals
    accepted somewhere and rejected somewhere), and the trainer's head loss (divergence and
    the feature regression the kind inherits) has a gradient on every own weight. (On the
    stacked target layout: its loop compiles the layer once.)"""
    kind = drafters.register_head_kind(HalfFeatureEagle())
    try:
        model, tp = _target(scan=True)
        hc = drafters.HeadConfig.make(kind.name, model.config)
        assert hc.spec is kind and kind.name in drafters.head_kinds()
        own = jax.tree.map(jnp.asarray, dict(_own_params(_head_config("eagle"), "good")))
        eng = decoding.Engine(model, hc.spec.drafter(hc), _gen(3))
        batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
        out = eng.run(decoding.EngineParams(target=tp, draft=drafters.head_params(hc, own, tp)), GREEDY, batch)
        _assert_target_tokens(out)
        m = out.metrics
        assert 0 < int(np.sum(m.accepted_B)) < int(np.sum(m.proposed_B))
        obj = distill.HeadObjective(config=hc, target=model, feature_weight=1.0)
        tokens = jnp.asarray(_target_only()[1][0][:16])[None]
        data = {"tokens": tokens, "mask": jnp.ones_like(tokens, jnp.float32)}
        head_UD = tp["embed"]
        # (jitted: op by op, the backward pass dispatched and compiled hundreds of small programs)
        grads, aux = jax.jit(jax.grad(lambda t: distill.head_loss(t, {"target": tp}, head_UD, data, draft=obj,
                                                                  spec=SPEC), has_aux=True))(
            {k: own[k] for k in obj.trainable})
        assert "feature_loss" in aux and np.isfinite(float(aux["loss"]))
        assert all(np.abs(np.asarray(g)).sum() > 0 for g in jax.tree.leaves(grads))
    finally:
        drafters.unregister_head_kind(kind.name)
    with pytest.raises(ValueError, match="head kind must be one of"):
        drafters.HeadConfig.make(kind.name, CFG)
