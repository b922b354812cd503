"""Feature-level draft heads, their weights and forwards on tiny random Llamas.

0. Head weights and scoring: the hand-made weights have `init_head_params`' structure; heads
   score through the target's final norm and LM head (tied or not; reduced heads: -inf off
   their tokens).
1. `Llama.apply_with_features`: logits bit-identical to `apply`'s, features equal to the
   residual stream after the listed layers recomputed layer by layer with `llama._layer`
   (independent of `trunk`'s collection), both parameter layouts, with and without a cache;
   bad layer indices raise.
2. `prefill(..., feature_layers=)` in chunks (3, 5) equals one call on the valid positions.
3. `eagle_train_forward` (training-time test) equals what the inference head computes.

The tiny target, the hand-made head weights and the memoised runs: `_heads_common`.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafters, models
from specjax.models import llama as llama_lib
from _heads_common import (CACHED_LAYERS, CFG, D, LAYER_SETS, TOL, V, _feature_forwards, _head_config, _head_ids,
                           _jit_features, _np_params, _own_params, _prefill_variants, _target, _to_device, _want)


def test_init_head_params_structure():
    """The hand-made head weights used here have exactly `init_head_params`' structure, shapes
    and dtypes; Medusa's init is W = 0, b = 0 (what test_zero_medusa_* relies on)."""
    for kind in ("medusa", "eagle", "eagle_reduced", "eagle3", "eagle3_reduced", "eagle3_norm"):
        hc = _head_config(kind)
        ids = _head_ids(hc, 1) if hc.head_size else None
        want = jax.eval_shape(lambda k: drafters.init_head_params(hc, k, head_ids=ids), jax.random.key(0))
        got = _own_params(hc, "random")
        assert jax.tree.structure(got) == jax.tree.structure(want), kind
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert (g.shape, g.dtype) == (w.shape, w.dtype), kind
        assert set(got) == set(hc.own_param_names)
    own = drafters.init_head_params(_head_config("medusa"), jax.random.key(0))
    assert not np.asarray(own["medusa_w"]).any() and not np.asarray(own["medusa_b"]).any()
    hc = _head_config("eagle_reduced")
    ids = jax.jit(lambda k: drafters.init_head_params(hc, k, head_ids=_head_ids(hc, 1)[::-1])["head_ids"])
    np.testing.assert_array_equal(np.asarray(ids(jax.random.key(0))), _head_ids(hc, 1))      # sorted


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_head_logits_are_the_target_head(tie):
    """Heads score through the target's final norm and LM head (tied or not); a reduced head
    gives the target's logits on its tokens and -inf elsewhere; a zero Medusa block is the
    identity, so every Medusa head is the target's head on the feature."""
    cfg = CFG.replace(tie_embeddings=tie)
    model = models.Llama(cfg)
    tp = _to_device(model.prepare_params(_np_params(llama_lib.param_specs(cfg), np.random.default_rng(2))))
    h = np.random.default_rng(3).standard_normal((2, 3, D)).astype(np.float32)
    hcs = [drafters.HeadConfig.make(kind, cfg, num_heads=2, head_size=hs) for kind in ("eagle", "medusa")
           for hs in (None, 40)]
    ids = _head_ids(hcs[1], 1)
    owns = []
    for hc in hcs:
        own = dict(_own_params(dataclasses.replace(hc, head_size=None), "zero" if hc.kind == "medusa" else "random"))
        owns.append(own if hc.head_size is None else dict(own, head_ids=jnp.asarray(ids)))

    @jax.jit
    def run(tp, owns, h):
        want = model.logits_from_hidden(tp, llama_lib.rms_norm(h, tp["final_norm"], cfg.rms_eps))
        got = []
        for hc, own in zip(hcs, owns):
            hp = drafters.head_params(hc, own, tp)
            got.append(drafters.head_logits(hc, hp, h) if hc.kind != "medusa" else drafters.medusa_logits(hc, hp, h))
        return want, got

    want, got = jax.device_get(run(tp, owns, h))
    reduced = np.full_like(want, -np.inf)
    reduced[..., ids] = want[..., ids]
    for hc, g in zip(hcs, got):
        w = want if hc.head_size is None else reduced
        if hc.kind == "medusa":
            assert g.shape == (2, 3, 2, V)
            for k in range(2):
                np.testing.assert_allclose(g[:, :, k], w, **TOL)
        else:
            np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_apply_with_features_matches_apply_and_layer_outputs(scan):
    model, params = _target(scan)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, V, (3, 9)).astype(np.int32)
    tok2 = rng.integers(0, V, (3, 5)).astype(np.int32)
    nv = np.array([4, 2, 3], np.int32)
    # each row's actual sequence in the cached calls: its nv first tokens, then tok2 (padded)
    seqs = np.stack([np.concatenate([tok[b, :nv[b]], tok2[b], np.zeros(4 - nv[b], np.int32)]) for b in range(3)])
    out = jax.device_get(_feature_forwards(model, params, tok, tok2, nv, seqs))
    manual = out["manual"]
    assert not np.allclose(manual[0], manual[3], atol=1e-2), "layers must differ for the check to mean anything"
    for layers in LAYER_SETS:
        logits, f = out[str(layers)]
        np.testing.assert_array_equal(logits, out["apply"])
        assert f.shape == (3, 9, len(layers) * D) and f.dtype == np.float32
        np.testing.assert_allclose(f, _want(manual, layers), **TOL)
    # -1 is the last layer's output BEFORE the final norm: final norm + LM head of it = logits
    np.testing.assert_allclose(out["head_on_last"], out["apply"], **TOL)
    assert not np.allclose(out["head_on_last"], model.logits_from_hidden(params, out[str((-1,))][1]), atol=1e-2)

    # cached: logits, cache entries and lengths equal `apply`'s exactly; the features equal the
    # cache-free ones of each row's actual sequence
    c = out["cached"]
    for x, y in list(zip(c["lf"], c["la"])) + [(c["cf"].lengths_B, c["ca"].lengths_B)] + list(zip(
            jax.tree.leaves((c["cf"].k, c["cf"].v)), jax.tree.leaves((c["ca"].k, c["ca"].v)))):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(c["cf"].lengths_B, nv + 5)
    want = _want(out["manual_seqs"], CACHED_LAYERS)
    f1, f2 = c["f"]
    for b in range(3):
        n = nv[b]
        np.testing.assert_allclose(f1[b, :n], want[b, :n], **TOL)
        np.testing.assert_allclose(f2[b], want[b, n:n + 5], **TOL)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_apply_with_features_rejects_bad_layers(scan):
    model, params = _target(scan)
    tok = jnp.zeros((1, 3), jnp.int32)
    for layers in [(4,), (-5,), (0, 9)]:
        with pytest.raises(ValueError, match="feature layers"):
            model.apply_with_features(params, tok, None, layers=layers)
        with pytest.raises(ValueError, match="feature layers"):
            model.apply_with_features(params, tok, model.init_cache(1, 8), layers=layers)


def test_prefill_features_chunked_equals_one_call():
    """Chunks of 3 (bounded attention, start_bound=0) and 5 (whole-capacity attention) give the
    one-call features, lengths and K/V on every row's valid positions (ragged num_valid, one
    row of a single token); one call is `apply_with_features` itself (test 1, both layouts;
    prefill only calls it, so one layout here)."""
    model, params = _target(True)
    prompt = np.random.default_rng(1).integers(0, V, (4, 11)).astype(np.int32)
    nv = np.array([11, 4, 1, 7], np.int32)
    variants = jax.device_get(_prefill_variants(model, params, prompt, nv))
    (ref_cache, ref_f), rest = variants[0], variants[1:]
    assert ref_f.shape == (4, 11, 2 * D)
    k_ref, v_ref = ref_cache.layer(CFG.num_layers - 1)
    for cache, f in rest:
        assert f.shape == ref_f.shape
        np.testing.assert_array_equal(cache.lengths_B, nv)
        k, v = cache.layer(CFG.num_layers - 1)
        for b in range(4):
            n = nv[b]
            np.testing.assert_allclose(f[b, :n], ref_f[b, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(k[b, :, :n], k_ref[b, :, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(v[b, ..., :n], v_ref[b, ..., :n], rtol=1e-5, atol=1e-5)
    assert not np.allclose(ref_f[0, 1:], ref_f[0, :-1], atol=1e-3)        # positions differ


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_published"])
def test_eagle_train_forward_structured_equals_dense(kind):
    """The training-time test through `TrainingTimeTest` (a causal block and diagonal entries)
    gives the outputs and gradients of the same rule as dense masks, over 4 steps (so steps 3
    and 4 read diagonal blocks of earlier steps) and for the published layout (first slot hidden)."""
    model, tp = _target()
    if kind == "eagle3":
        hc = _head_config(kind)
        own = _own_params(hc, "random")
    else:           # the initial weights, matrices scaled up so that attention is far from uniform
        hc = drafters.HeadConfig.make(kind, CFG, feature_layers=(0, 2, 3))
        own = jax.tree.map(lambda x: x * 15 if x.ndim == 2 else x, drafters.init_head_params(hc, jax.random.key(3)))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, V, (2, 10)), jnp.int32)
    feats = _jit_features(model)(tp, tokens, None, layers=hc.feature_layers)[1]

    floats = {k for k, v in own.items() if all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(v))}

    def loss(weights, dense):
        hp = drafters.head_params(hc, {**own, **weights}, tp)
        outs = drafters.eagle_train_forward(hc, hp, tokens, feats, steps=4, with_logits=False,
                                            dense_visibility=dense)
        return sum(jnp.sum(jnp.sin(h)) for h, _ in outs), [h for h, _ in outs]

    weights = {k: own[k] for k in floats}
    value_and_grad = jax.value_and_grad(loss, has_aux=True)
    if kind == "eagle3":
        # jitted: one program per rule (op by op, the forward and backward compile every
        # operation). The published layout's gradients (weights x 15, of order 1e3) stay op by
        # op: compiled, the two rules' float32 rounding differs by more than the tolerance below.
        value_and_grad = jax.jit(value_and_grad, static_argnums=1)
    (_, h_fast), g_fast = value_and_grad(weights, False)
    (_, h_dense), g_dense = value_and_grad(weights, True)
    for a, b in zip(h_fast, h_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_dense)):    # gradients of order 1e2-1e3:
        b = np.asarray(b)                                                  # float32 rounding relative to each
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-5 * np.abs(b).max(), rtol=0)   # leaf's scale
    assert not np.allclose(np.asarray(h_fast[2]), np.asarray(h_fast[3]), atol=1e-3)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_train_forward_matches_inference(kind):
    """Step 1 at position s == the inference head with the true features (one call over all
    slots); step j at origin o == the inference rollout's (j-1)-th draft step after a prefix
    of o + 1 committed tokens (teacher tokens fed instead of drafts): the training-time-test
    attention mask sees exactly what drafting sees."""
    model, tp = _target()
    hc = _head_config(kind)
    hp = drafters.head_params(hc, _own_params(hc, "random"), tp)
    T, steps, cap = 9, 3, 16
    tokens = np.random.default_rng(5).integers(0, V, (1, T)).astype(np.int32)
    origins = np.arange(T - steps + 1)            # steps 2..: one row per origin o
    R = len(origins)
    head = drafters.EagleHead(hc)

    @jax.jit
    def both(tp, hp, tokens):
        feats = model.apply_with_features(tp, tokens, None, layers=hc.feature_layers)[1]
        train = drafters.eagle_train_forward(hc, hp, tokens, feats, steps=steps)

        def cache_with(rows, true_len):
            f = jnp.zeros((rows, cap, hc.feature_size)).at[:, :T].set(jnp.tile(feats, (rows, 1, 1)))
            return head.init_cache(rows, cap).replace(true_BSF=f, true_len_B=jnp.asarray(true_len, jnp.int32))

        # step 1: one call over all T tokens, every previous feature the target's
        logits1, c1 = head.apply(hp, tokens, cache_with(1, [T]))
        inference = [(c1.pred_BSD[:, :T], logits1)]
        # o + 1 committed tokens (target features f_0..f_{o-1}), then teacher tokens one by one
        rows = jnp.tile(tokens, (R, 1))
        _, cache = head.apply(hp, rows, cache_with(R, origins), num_valid_B=jnp.asarray(origins + 1, jnp.int32))
        for j in range(2, steps + 1):
            logits_j, cache = head.apply(hp, rows[jnp.arange(R), origins + j - 1][:, None], cache)
            inference.append((cache.pred_BSD[jnp.arange(R), origins + j - 1], logits_j[:, 0]))
        return train, inference

    out, inference = jax.device_get(both(tp, hp, tokens))
    assert len(out) == steps and out[0][1].shape == (1, T, V)
    np.testing.assert_allclose(out[0][1], inference[0][1], **TOL)
    np.testing.assert_allclose(out[0][0], inference[0][0], **TOL)
    for j in range(2, steps + 1):
        np.testing.assert_allclose(inference[j - 1][1], out[j - 1][1][0, origins], **TOL)
        np.testing.assert_allclose(inference[j - 1][0], out[j - 1][0][0, origins], **TOL)
    # the steps really differ (a mask or input mix-up could otherwise go unseen)
    assert not np.allclose(out[0][1][0, 1:T - 1], out[1][1][0, :T - 2], atol=1e-3)
