"""Feature-level draft heads (Medusa-1, EAGLE, EAGLE-3 style) on tiny random Llamas.

What is checked (every check has a way to fail; broken variants below show some do):

0. Head weights and scoring: the hand-made weights have `init_head_params`' structure; heads
   score through the target's final norm and LM head (tied or not; reduced heads: -inf off
   their tokens).
1. `Llama.apply_with_features`: logits bit-identical to `apply`'s, features equal to the
   residual stream after the listed layers recomputed layer by layer with `llama._layer`
   (independent of `trunk`'s collection), both parameter layouts, with and without a cache;
   bad layer indices raise.
2. `prefill(..., feature_layers=)` in chunks (3, 5) equals one call on the valid positions.
3. Greedy exactness against a cache-free target-only reference, ragged batch (prompt lengths
   1, 2, 5, 9; chunked prefill): Medusa and EAGLE at gamma 3 round by round, and Medusa and a
   reduced-vocabulary EAGLE-3 head (stacked target layout) under `AdaptiveGamma` (0, 1, 3),
   mixed and pinned to gamma 1 or 3 through the round-time table (the same compiled program).
   A zero-initialised Medusa head drafts the target's own greedy choice at ``L - 2``: its
   rounds and accepted counts are predicted exactly.
4. Feature rollback: after every round the features a head can read (positions < L - 1)
   equal a fresh cache-free forward over the committed tokens; the EAGLE head's cache after
   every commit equals a fresh head prefill over the committed tokens with their true
   features; a head whose commit keeps slots made from its own predictions fails that check.
5. Distribution exactness at T = 1 (Medusa with top-k + top-p; a reduced EAGLE head) by
   chi-square against the exact target law, with a negative control that must fail.
6. `eagle_train_forward` (training-time test) equals what the inference head computes.
7. Errors; 8. `Engine.prefill` reuse (test_prefill_reuse_with_medusa_head fails: a Medusa
   engine cannot reuse its own prefill, see its docstring).

Compile budget (the file must stay near 90 s on 2 CPU cores): weights are made in numpy,
every helper that runs a model is jitted (eager dispatch of the tiny ops costs more than
compiling), engine programs are shared between weights / round-time tables / keys (all
arguments), and runs are memoised per module.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specjax import decoding, drafters, models, sampling, trees
from specjax.models import llama as llama_lib
from specjax.models.reduced_head import ReducedHeadLlama

V = 97
CFG = models.ModelConfig(vocab_size=V, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_size=48, max_position=512, scan_layers=False)
D = CFG.hidden_size
# Layer weights are scaled up from the init's 0.02 so that the random target's greedy sequence
# depends on its context (with the raw init, a tied-embedding model mostly repeats its input).
LAYER_SCALE = 10.0
GREEDY = sampling.SamplingConfig.make(0.0)
PROMPTS = [[5], [3, 4], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_NEW = 16
EXTRA = 4                      # the target-only reference runs MAX_NEW + EXTRA tokens
CHUNK = 3                      # prefill chunk: the 5- and 9-token prompts are chunked
ADAPTIVE = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=2)
# round times per gamma (0, 1, 3): MIXED makes a low-acceptance head fall back to gamma 0 and
# probe; the others pin the policy to one gamma (the largest-index start switches at round 1)
MIXED, PIN_G1, PIN_G3 = (1.0, 1.4, 2.0), (100.0, 1.0, 100.0), (100.0, 100.0, 1.0)
TOL = dict(rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- models and heads

def _np_params(specs: dict, rng, layer_scale: float = 1.0, std: float = 0.02) -> dict:
    """Random canonical params in numpy (normal(std) weights, unit norms), layer projections
    times ``layer_scale``; numpy, not jax.random: nothing to compile."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, dict):
            out[name] = _np_params(spec, rng, layer_scale, std)
            continue
        shape, _, kind = spec
        scale = layer_scale if name.startswith("w") else 1.0
        out[name] = (np.ones(shape) if kind == "ones" else std * scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def _to_device(tree):
    return jax.tree.map(jnp.asarray, tree)


@functools.cache
def _target(scan: bool = False):
    """(model, params) of the random target in the given layout (the same weights in both).
    Layer weights are scaled up from the init's 0.02 so that the greedy sequence depends on
    its context (with the raw init, a tied-embedding model mostly repeats its input)."""
    model = models.Llama(CFG.replace(scan_layers=scan))
    canonical = _np_params(llama_lib.param_specs(CFG), np.random.default_rng(0), LAYER_SCALE)
    return model, _to_device(model.prepare_params(canonical))


@functools.cache
def _jit_apply(model):
    return jax.jit(model.apply)


@functools.cache
def _jit_features(model):
    return jax.jit(model.apply_with_features, static_argnames="layers")


def _head_config(kind: str, cfg=CFG) -> drafters.HeadConfig:
    if kind == "medusa":
        return drafters.HeadConfig.make("medusa", cfg, num_heads=3)
    if kind == "eagle_reduced":
        return drafters.HeadConfig.make("eagle", cfg, head_size=40)
    if kind == "eagle3":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1))
    if kind == "eagle3_reduced":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1), head_size=40)
    if kind == "eagle3_norm":
        return drafters.HeadConfig.make("eagle3", cfg, feature_layers=(0, 2, -1), head_size=40, input_norm=True)
    return drafters.HeadConfig.make(kind, cfg)


def _drafter(hc: drafters.HeadConfig):
    return drafters.MedusaDrafter(hc) if hc.kind == "medusa" else drafters.FeatureHeadDrafter(drafters.EagleHead(hc))


def _head_ids(hc: drafters.HeadConfig, seed: int):
    """A reduced head's tokens: the 12 the prompts use, and random others."""
    rest = np.random.default_rng(seed).permutation(np.arange(12, hc.target.vocab_size))[:hc.head_size - 12]
    return np.sort(np.concatenate([np.arange(12), rest])).astype(np.int32)


@functools.cache
def _own_params(hc: drafters.HeadConfig, mode: str, seed: int = 1, layer_scale: float = LAYER_SCALE) -> dict:
    """The head's own weights (the structure of `init_head_params`, checked in
    test_init_head_params_structure). 'zero': Medusa's init (W = 0, b = 0). 'random': random
    everywhere (the EAGLE layer's projections scaled like the target's). 'good' (EAGLE kinds):
    random, but fc (and fuse) pass the previous feature through and the layer's output
    projections are damped, so h_s is close to ``f_{s-1}`` and the head drafts like the
    target's own head one position late (accepted wherever the target repeats a token), still
    depending on every weight."""
    rng = np.random.default_rng(seed)
    Dh, F = hc.hidden_size, hc.feature_size
    if hc.kind == "medusa":
        own = {"medusa_w": np.zeros((hc.num_heads, Dh, Dh), np.float32),
               "medusa_b": np.zeros((hc.num_heads, Dh), np.float32)}
        if mode == "random":
            own = {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in own.items()}
    else:
        own = {"fc": (0.02 * rng.standard_normal((2 * Dh, Dh))).astype(np.float32),
               "layers": _np_params(llama_lib.param_specs(hc.layer_config)["layers"], rng, layer_scale)}
        if hc.kind == "eagle3":
            own["fuse"] = (0.02 * rng.standard_normal((F, Dh))).astype(np.float32)
        if hc.input_norm:
            own["input_norm"] = (1.0 + 0.1 * rng.standard_normal((2, Dh))).astype(np.float32)
        if mode == "good":
            eye = np.eye(Dh, dtype=np.float32)
            own["fc"][Dh:] += eye
            own["layers"]["wo"] *= 0.05
            own["layers"]["w_down"] *= 0.05
            if hc.kind == "eagle3":            # fuse picks the last listed layer's block
                own["fuse"][F - Dh:] += eye
    if hc.head_size is not None:
        own["head_ids"] = _head_ids(hc, seed)
    return _to_device(own)


def _head(kind: str, mode: str = "random", scan: bool = False):
    """(drafter, head params) on the target."""
    _, tp = _target(scan)
    hc = _head_config(kind, CFG.replace(scan_layers=scan))
    return _drafter(hc), drafters.head_params(hc, _own_params(hc, mode), tp)


def _manual_layers(model, params, tokens_BT):
    """Outputs of every layer of a cache-free forward, run by hand with `llama._layer`."""
    c = model.config.replace(scan_layers=True)
    canon = models.canonical_params(params, model.config)
    B, T = tokens_BT.shape
    h = jnp.take(canon["embed"], tokens_BT, axis=0).astype(c.jnp_dtype)
    cos, sin = llama_lib.rope_cos_sin(c, jnp.broadcast_to(jnp.arange(T)[None], (B, T)))
    outs = []
    for i in range(c.num_layers):
        h, _ = llama_lib._layer(c, jax.tree.map(lambda x: x[i], canon["layers"]), h, cos, sin, None)
        outs.append(h)
    return outs


def _want(manual, layers):
    return np.concatenate([np.asarray(manual[i % CFG.num_layers]) for i in layers], axis=-1)


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


# ----------------------------------------------------------------------------- 1. apply_with_features

LAYER_SETS = ((-1,), (0, 2, -1), (3, 1))
CACHED_LAYERS = (0, 2, -1)


@functools.partial(jax.jit, static_argnums=0)
def _feature_forwards(model, params, tok, tok2, nv, seqs):
    """Everything test 1 compares, in one program (one compile per layout)."""
    out = {"manual": _manual_layers(model, params, tok), "manual_seqs": _manual_layers(model, params, seqs),
           "apply": model.apply(params, tok, None)[0]}
    for layers in LAYER_SETS:
        logits, f, none = model.apply_with_features(params, tok, None, layers=layers)
        assert none is None
        out[str(layers)] = (logits, f)
    f_last = out[str((-1,))][1]
    out["head_on_last"] = model.logits_from_hidden(params, llama_lib.rms_norm(f_last, params["final_norm"],
                                                                              CFG.rms_eps))
    # with a cache: a ragged first call (num_valid), then a second block
    c_f, c_a = model.init_cache(3, 16), model.init_cache(3, 16)
    lf1, f1, c_f = model.apply_with_features(params, tok[:, :4], c_f, num_valid_B=nv, layers=CACHED_LAYERS)
    la1, c_a = model.apply(params, tok[:, :4], c_a, num_valid_B=nv)
    lf2, f2, c_f = model.apply_with_features(params, tok2, c_f, layers=CACHED_LAYERS)
    la2, c_a = model.apply(params, tok2, c_a)
    out["cached"] = dict(lf=(lf1, lf2), la=(la1, la2), f=(f1, f2), cf=c_f, ca=c_a)
    return out


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


# ----------------------------------------------------------------------------- 2. prefill with features

PREFILL_VARIANTS = ((None, 0), (3, 0), (5, None))     # (chunk, start_bound); the first: one call


@functools.partial(jax.jit, static_argnums=0)
def _prefill_variants(model, params, prompt, nv):
    return [models.prefill(model, params, prompt, model.init_cache(4, 20), nv, chunk, start_bound=sb,
                           feature_layers=(1, -1)) for chunk, sb in PREFILL_VARIANTS]


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


# ----------------------------------------------------------------------------- 3. greedy exactness

def _gen(gamma, max_new=MAX_NEW, chunk=CHUNK):
    return decoding.GenerationConfig(max_new_tokens=max_new, gamma=gamma, prefill_chunk=chunk)


@functools.cache
def _target_only(prompts=tuple(map(tuple, PROMPTS))):
    """The target's greedy continuations of the prompts (PROMPTS), MAX_NEW + EXTRA tokens,
    computed cache-free (a full forward per token, independent of the engine and of any cache):
    (first MAX_NEW, all). Every chosen token beats the runner-up by > 1e-5 (the logits are ~0.1
    in size; rounding differences between cached and cache-free forwards are ~1e-7), so the
    engine cannot pick another token by rounding."""
    model, tp = _target()
    n = MAX_NEW + EXTRA
    lens = np.array([len(p) for p in prompts])
    toks = np.zeros((len(prompts), lens.max() + n), np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
    rows = np.arange(len(prompts))
    for _ in range(n):
        last = np.asarray(_jit_apply(model)(tp, toks, None)[0])[rows, lens - 1]
        top2 = np.sort(last, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-5).all(), "near-tie in the reference: pick other weights"
        toks[rows, lens] = last.argmax(-1)
        lens += 1
    full = [toks[b, len(p):len(p) + n].tolist() for b, p in enumerate(prompts)]
    return [g[:MAX_NEW] for g in full], full


def _assert_target_tokens(out):
    assert out.generated() == _target_only()[0]
    assert out.statuses() == ["max_new_tokens"] * len(PROMPTS)
    m = out.metrics
    np.testing.assert_array_equal(np.asarray(m.committed_B), MAX_NEW)
    assert (np.asarray(m.accepted_B) <= np.asarray(m.proposed_B)).all()


@functools.cache
def _run_head(kind, mode, gamma, scan=False, round_times=None):
    """Greedy `Engine.run` of a head drafter on PROMPTS (memoised)."""
    model, tp = _target(scan)
    dr, hp = _head(kind, mode, scan)
    eng = decoding.Engine(model, dr, _gen(ADAPTIVE if gamma == "adaptive" else gamma))
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    return eng.run(decoding.EngineParams(target=tp, draft=hp), GREEDY, batch, round_time_s=round_times)


def test_target_sequences_are_not_trivial():
    """Guards the greedy tests: the target's continuations vary (not one repeated token) but
    repeat sometimes (so a head drafting the last token is accepted now and then)."""
    gen = _target_only()[0]
    for g in gen:
        assert len(set(g)) >= 4, gen
    repeats = sum(a == b for g in gen for a, b in zip(g, g[1:]))
    assert 3 <= repeats <= 0.6 * sum(len(g) - 1 for g in gen), gen


# (kind, target layout scan?, gamma, head params, adaptive round times)
GREEDY_CASES = [
    ("medusa", False, "adaptive", "random", MIXED),
    ("medusa", False, "adaptive", "random", PIN_G1),
    ("eagle3_reduced", True, "adaptive", "random", MIXED),
    ("eagle3_reduced", True, "adaptive", "random", PIN_G1),
    ("eagle3_reduced", True, "adaptive", "good", PIN_G1),
    ("eagle3_reduced", True, "adaptive", "good", PIN_G3),
    ("eagle3_norm", False, "adaptive", "random", PIN_G1),
]


@pytest.mark.parametrize("kind,scan,gamma,mode,round_times", GREEDY_CASES,
                         ids=[f"{k}-{'scan' if s else 'unrolled'}-g{g}-{m}" + ("" if r is None else f"-rt{r}")
                              for k, s, g, m, r in GREEDY_CASES])
def test_greedy_head_matches_target_only(kind, scan, gamma, mode, round_times):
    """(Medusa and the plain EAGLE head at gamma 3 are checked round by round in
    test_medusa_greedy_and_features_after_every_round and
    test_eagle_greedy_and_head_cache_after_every_commit.) Gamma 1 runs as the adaptive policy
    pinned to it (PIN_G1): the gamma-1 branch of the same compiled loop. The EAGLE-3 head here
    has a 40-token reduced vocabulary and runs on the stacked (lax.scan) target layout, whose
    feature collection is a separate code path; the reference is the cache-free greedy of the
    unrolled target (same weights)."""
    out = _run_head(kind, mode, gamma, scan, round_times)
    _assert_target_tokens(out)
    m = out.metrics
    rounds = np.asarray(m.rounds_B)
    if gamma == "adaptive":
        k = np.asarray(m.gamma_rounds_K)
        assert k.sum() == rounds.max()
        if round_times == MIXED:
            assert k[0] > 0 and k[1:].sum() > 0, f"the adaptive run must mix gamma 0 and drafting rounds: {k}"
        else:
            assert k[ADAPTIVE.gammas.index(1 if round_times == PIN_G1 else 3)] == k.sum(), k
    else:
        np.testing.assert_array_equal(np.asarray(m.proposed_B), gamma * rounds)
    if mode == "good":
        assert int(np.asarray(m.accepted_B).sum()) > 0, "a 'good' head must get drafts accepted"


def test_zero_medusa_acceptance_is_exactly_predicted():
    """Medusa with W = 0, b = 0: every head is the target's own head on ``f_{L-2}``, so each
    round drafts the target's greedy choice at position L - 2, gamma times: the last committed
    token once it was generated, the target's argmax there while it is a prompt token, and
    token 0 when L = 1 (the zero feature gives all-equal logits). Simulating the rounds on the
    target's greedy sequence predicts every row's rounds and accepted counts exactly (accepted
    counts drafts the max_new_tokens limit then cuts: hence the EXTRA reference tokens). A
    head reading any other position than L - 2 fails this."""
    gamma = 3
    _, final = _medusa_stepped("zero")
    out = decoding.GenerateOutput.from_state(final)
    _assert_target_tokens(out)
    model, tp = _target()
    seqs = [list(p) + g for p, g in zip(PROMPTS, _target_only()[1])]
    width = max(map(len, seqs))
    padded = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    argmax_BT = np.asarray(_jit_apply(model)(tp, padded, None)[0]).argmax(-1)
    rounds, accepted = [], []
    for prompt, seq, argmax in zip(PROMPTS, seqs, argmax_BT):
        np.testing.assert_array_equal(argmax[len(prompt) - 1:len(seq) - 1], seq[len(prompt):])   # greedy
        L, r, a = len(prompt), 0, 0
        while L - len(prompt) < MAX_NEW:
            draft = argmax[L - 2] if L >= 2 else 0
            n = 0
            while n < gamma and seq[L + n] == draft:
                n += 1
            r, a, L = r + 1, a + n, L + n + 1
        rounds.append(r)
        accepted.append(a)
    m = out.metrics
    np.testing.assert_array_equal(np.asarray(m.rounds_B), rounds)
    np.testing.assert_array_equal(np.asarray(m.accepted_B), accepted)
    assert 0 < sum(accepted) < gamma * sum(rounds)


# ----------------------------------------------------------------------------- 4. feature rollback

@dataclasses.dataclass(frozen=True)
class NaiveCommitHead(drafters.FeatureHeadDrafter):
    """BROKEN on purpose: commits like a plain draft model (keeps every committed slot,
    including those whose input feature was the head's own prediction)."""

    def commit(self, state, new_lengths_B, accepted=None):
        return drafters.ModelDraftState(cache=state.cache.truncate(new_lengths_B - 1))


def _step_through(engine, ep, batch, sampling_cfg, state=None):
    """Round by round: [(lengths before, state after as host arrays)], final state."""
    state = engine.init(ep, batch) if state is None else state
    rounds = []
    for _ in range(MAX_NEW):
        before = np.asarray(state.lengths_B)
        state, _ = engine.step(ep, sampling_cfg, state)
        rounds.append((before, jax.device_get(state)))
        if np.asarray(state.done_B).all():
            break
    return rounds, state


def _true_features(tokens_BL, layers):
    """The target's features over whole token rows, cache-free (fresh)."""
    model, tp = _target()
    return np.asarray(_jit_features(model)(tp, jnp.asarray(tokens_BL), None, layers=layers)[1])


@functools.cache
def _medusa_stepped(mode):
    """Medusa (3 heads, gamma 3, greedy) round by round on PROMPTS (memoised)."""
    model, tp = _target()
    dr, hp = _head("medusa", mode)
    eng = decoding.Engine(model, dr, _gen(3))
    batch = decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))
    return _step_through(eng, decoding.EngineParams(target=tp, draft=hp), batch, GREEDY)


def _assert_committed_features(rounds, final, layers):
    """After every round the engine's feature buffer -- the next round's
    `DraftContext.features` -- holds at every position < L - 1 exactly what a fresh cache-free
    forward over the committed tokens gives: the features computed for rejected draft
    positions were overwritten or lie past L - 1."""
    ref = _true_features(final.tokens_BL, layers)
    for _, st in rounds:
        L, feats = st.lengths_B, st.features_BLF
        for b in range(len(L)):
            np.testing.assert_allclose(feats[b, :L[b] - 1], ref[b, :L[b] - 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["random", "zero"])
def test_medusa_greedy_and_features_after_every_round(mode):
    """Medusa, gamma 3, greedy, round by round (`Engine.step`): the target-only tokens, and the
    features a head can read are the committed ones (see _assert_committed_features; with
    W = 0 drafts are both accepted and rejected)."""
    rounds, final = _medusa_stepped(mode)
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    np.testing.assert_array_equal(np.asarray(m.proposed_B), 3 * np.asarray(m.rounds_B))
    if mode == "zero":
        acc, prop = int(np.asarray(m.accepted_B).sum()), int(np.asarray(m.proposed_B).sum())
        assert 0 < acc < prop, f"need both accepted and rejected drafts ({acc} of {prop})"
    _assert_committed_features(rounds, final, _head_config("medusa").feature_layers)


@functools.cache
def _eagle_setup(mode, gamma=3):
    model, tp = _target()
    dr, hp = _head("eagle", mode)
    eng = decoding.Engine(model, dr, _gen(gamma))
    ep = decoding.EngineParams(target=tp, draft=hp)
    return eng, ep, decoding.make_batch(PROMPTS, eng.config, jax.random.key(2))


@functools.cache
def _eagle_stepped(mode, naive=False, gamma=3):
    """The EAGLE head (gamma 3 or a tree, greedy) round by round; naive: the same init, then
    the broken commit."""
    eng, ep, batch = _eagle_setup(mode, gamma)
    state = None
    if naive:
        state = eng.init(ep, batch)
        eng = dataclasses.replace(eng, drafter=NaiveCommitHead(eng.drafter.model))
    return _step_through(eng, ep, batch, GREEDY, state)


@functools.cache
def _fresh_head_init(hc, capacity):
    head = drafters.FeatureHeadDrafter(drafters.EagleHead(hc))
    return jax.jit(lambda hp, tok, lens, f: head.init(hp, tok, lens, capacity, features_BPF=f).cache)


def _head_cache_mismatch(mode, naive=False, gamma=3):
    """After every commit compare the head's cache (K/V and output features of the slots it
    keeps) with a fresh head prefill over the committed tokens and their true features.
    Returns the largest absolute difference."""
    eng, ep, batch = _eagle_setup(mode, gamma)
    hc = eng.drafter.model.config
    rounds, _ = _eagle_stepped(mode, naive, gamma)
    worst = 0.0
    for before, st in rounds:
        if not naive:
            # cut back to the slots made from target features: those before the round's start
            np.testing.assert_array_equal(np.asarray(st.draft_state.cache.kv.lengths_B),
                                          np.minimum(st.lengths_B - 1, before))
        worst = max(worst, _kept_slots_vs_fresh(hc, ep, batch.capacity, st))
    return worst


def _kept_slots_vs_fresh(hc, ep, capacity, st):
    """The largest absolute difference between the head cache's kept slots (K/V and output
    features) in loop state `st` and a fresh head prefill over the committed tokens with their
    true features."""
    L, cache = st.lengths_B, st.draft_state.cache
    fresh = _fresh_head_init(hc, capacity)(ep.draft, st.tokens_BL, L, _true_features(st.tokens_BL, hc.feature_layers))
    kept = np.asarray(cache.kv.lengths_B)
    assert (kept <= L - 1).all()
    k, v = (np.asarray(x) for x in cache.kv.layer(0))
    fk, fv = (np.asarray(x) for x in fresh.kv.layer(0))
    pred, fpred = np.asarray(cache.pred_BSD), np.asarray(fresh.pred_BSD)
    worst = 0.0
    for b in range(len(L)):
        n = kept[b]
        worst = max(worst, np.abs(k[b, :, :n] - fk[b, :, :n]).max(initial=0),
                    np.abs(v[b, ..., :n] - fv[b, ..., :n]).max(initial=0),
                    np.abs(pred[b, :n] - fpred[b, :n]).max(initial=0))
    return worst


@pytest.mark.parametrize("mode", ["random", "good"])
def test_eagle_greedy_and_head_cache_after_every_commit(mode):
    """EAGLE head, gamma 3, greedy, round by round (`Engine.step`): the tokens are the
    target-only ones, and after every commit the head's cache equals a fresh head prefill
    over the committed tokens with the target's true features (only slots whose input feature
    was the target's survive a commit)."""
    rounds, final = _eagle_stepped(mode)
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    acc, prop = int(np.asarray(m.accepted_B).sum()), int(np.asarray(m.proposed_B).sum())
    if mode == "good":     # slots made from predictions existed and had to be dropped
        assert 0 < acc < prop and (np.asarray(m.accepted_at_BG)[:, 1] > 0).any(), (acc, prop)
    _assert_committed_features(rounds, final, _head_config("eagle").feature_layers)
    worst = _head_cache_mismatch(mode)
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


HEAD_TREES = {"static-2x2x1": trees.TreeShape.from_branching((2, 2, 1)),
              "dynamic-k2-d3-n6": trees.DynamicTree(depth=3, topk=2, node_budget=6)}


@pytest.mark.parametrize("tree", list(HEAD_TREES))
def test_eagle_tree_greedy_and_head_cache_after_every_commit(tree):
    """EAGLE head drafting token trees (EAGLE-2 dynamic and a static tree), greedy, round by
    round: the target-only tokens; the features a head reads are the committed ones after every
    round (the tree pass's accepted path lands in the engine's feature buffer); after every
    commit the head's cache equals a fresh true-feature prefill (its tree entries, made from its
    own predictions, are dropped); and paths of several tokens are accepted."""
    rounds, final = _eagle_stepped("good", gamma=HEAD_TREES[tree])
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    assert (np.asarray(m.accepted_at_BG)[:, 1] > 0).any(), "no round accepted two tree nodes"
    _assert_committed_features(rounds, final, _head_config("eagle").feature_layers)
    worst = _head_cache_mismatch("good", gamma=HEAD_TREES[tree])
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


@pytest.mark.parametrize("tree", list(HEAD_TREES))
def test_eagle_tree_nodes_score_as_the_chain_along_their_path(tree):
    """Each tree node's distribution (the q its children are ranked by) equals what the head
    gives when it drafts that node's path as a chain, one token at a time in feature space: a
    tree call reads its parent's output feature, at its path's position. Checked mid-sequence
    (after two rounds), every node of every row."""
    shape = HEAD_TREES[tree]
    # The random head (not 'good', whose output is close to its input feature whatever it is)
    # so that a node scored from another node's feature would differ.
    eng, ep, batch = _eagle_setup("random", shape)
    dr = eng.drafter
    state = eng.init(ep, batch)
    for _ in range(2):
        state, _ = eng.step(ep, GREEDY, state)
    ctx = drafters.DraftContext(tokens_BL=state.tokens_BL, lengths_B=state.lengths_B,
                                target_cache=state.target_cache, features=state.features_BLF)
    keys = jax.random.split(jax.random.key(0), len(PROMPTS))
    draft, q_BN1V, _ = jax.jit(lambda p, s, c, k: dr.propose_tree(p, s, c, k, shape, GREEDY, "deterministic"))(
        ep.draft, state.draft_state, ctx, keys)
    root_BV, cache = jax.jit(lambda p, s, c: dr._catch_up(p, dr._with_features(s, c), c))(ep.draft, state.draft_state,
                                                                                          ctx)
    np.testing.assert_allclose(np.asarray(q_BN1V[:, 0]), np.asarray(jax.nn.softmax(root_BV, -1)), **TOL)
    step = jax.jit(lambda p, t, c: dr.model.apply(p, t, c))
    toks, parents = np.asarray(draft.tokens_BN), np.asarray(draft.parents_BN)
    valid = np.asarray(draft.valid_BN)
    B, N = toks.shape
    paths = [[[] for _ in range(N)] for _ in range(B)]
    for b in range(B):
        for n in range(N):
            par = parents[b, n]
            paths[b][n] = (paths[b][par] if par >= 0 else []) + [n]
    checked = 0
    for n in range(N):
        depth = max(len(paths[b][n]) for b in range(B))
        c = cache.replace(true_BSF=None, drafting=True)
        got = {}
        for j in range(depth):
            col = np.asarray([toks[b, paths[b][n][j]] if j < len(paths[b][n]) else 0 for b in range(B)], np.int32)
            lg, c = step(ep.draft, jnp.asarray(col)[:, None], c)
            for b in range(B):
                if j == len(paths[b][n]) - 1:
                    got[b] = np.asarray(jax.nn.softmax(lg[b, 0], -1))
        for b in range(B):
            # Nodes the tree never forwarded (leaves) carry zero rows that are never read.
            if valid[b, n] and np.asarray(q_BN1V[b, n + 1]).sum() > 0:
                np.testing.assert_allclose(np.asarray(q_BN1V[b, n + 1]), got[b], **TOL)
                checked += 1
    # Every forwarded node: the static tree's 2 + 4 inner nodes, the dynamic tree's frontiers.
    assert checked >= B * (6 if isinstance(shape, trees.TreeShape) else 2), checked


def test_naive_head_commit_is_detected():
    """Negative control for the check above: keeping the slots computed from the head's own
    predicted features (a plain draft model's commit) makes the cache differ."""
    worst = _head_cache_mismatch("good", naive=True)
    assert worst > 1e-2, f"the naive commit was not detected (max difference {worst})"


# ----------------------------------------------------------------------------- 5. distribution exactness

DV = 5
D_CFG = models.ModelConfig(vocab_size=DV, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                           ffn_size=32, max_position=64, scan_layers=True)
D_PROMPT = (1, 4, 2)
D_NEW = 4
D_GAMMA = 2
D_BATCH = 30_000
D_SEED = 2025
FAMILY_WISE_ALPHA = 1e-4
T1 = dict(temperature=1.0)
T1_FILTERED = dict(temperature=1.0, top_k=3, top_p=0.9)
D_TREE = trees.TreeShape.from_branching((2, 1))      # sampled tree: 2 children of the root (iid), 1 each
D_EXACT = {"medusa_T1_topk3_topp0.9": (T1_FILTERED, "medusa"), "eagle_reduced_head_T1": (T1, "eagle_reduced"),
           "eagle_reduced_head_T1_topk3_tree2x1": (T1_FILTERED, "eagle_reduced", D_TREE),
           "hybrid_lookup_or_eagle_reduced_T1": (T1, "hybrid")}
D_NEGATIVE = {"medusa_samples_at_T/2_reports_T": (T1, "misreport"),
              "hybrid_reports_the_head_q_for_lookup_drafts": (T1, "hybrid_misreport")}
PER_TEST_ALPHA = FAMILY_WISE_ALPHA / len(D_EXACT)


@dataclasses.dataclass(frozen=True)
class MisreportingMedusa(drafters.MedusaDrafter):
    """BROKEN: samples each head at temperature T/2, reports the temperature-T q (without
    filters softmax(l/T) is proportional to softmax(l/(T/2))^(1/2))."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, q_half, st = super().propose(params, state, context, key_B, gamma,
                                           cfg.replace(temperature=cfg.temperature / 2))
        q = jnp.sqrt(q_half)
        return toks, q / q.sum(-1, keepdims=True), st


D_HEAD_IDS = (0, 2, 4)          # the reduced EAGLE head drafts only these: q = 0 on 1 and 3


@dataclasses.dataclass(frozen=True)
class MisreportingHybrid(drafters.HybridDrafter):
    """BROKEN: proposes as the hybrid does, but reports the head's q for every row, also for
    the rows whose tokens came from prompt lookup."""

    def propose(self, params, state, context, key_B, gamma, cfg):
        toks, _, st = super().propose(params, state, context, key_B, gamma, cfg)
        _, q_head, _ = self.model.propose(params, state, context, key_B, gamma, cfg)
        return toks, q_head, st


def _hybrid(model_drafter, cls=drafters.HybridDrafter, max_ngram=2, min_match=1):
    return cls(drafters.NGramDrafter(model_drafter.vocab_size, max_ngram=max_ngram), model_drafter,
               min_match=min_match)


@functools.cache
def _dist_setup():
    """(model, target params, {kind: (head config, head params)})."""
    model = models.Llama(D_CFG)
    canonical = _np_params(llama_lib.param_specs(D_CFG), np.random.default_rng(30), layer_scale=10.0)
    canonical["embed"] *= 20.0          # tied head: peaked logits (mean max p ~0.7)
    tp = _to_device(canonical)
    heads = {}
    for kind in ("medusa", "eagle_reduced"):
        hc = drafters.HeadConfig.make("medusa" if kind == "medusa" else "eagle", D_CFG, num_heads=D_GAMMA)
        own = dict(_own_params(hc, "random", 31, 10.0))
        if kind == "eagle_reduced":
            hc = dataclasses.replace(hc, head_size=len(D_HEAD_IDS))
            own["head_ids"] = jnp.asarray(D_HEAD_IDS, jnp.int32)
        heads[kind] = (hc, drafters.head_params(hc, own, tp))
    return model, tp, heads


@functools.cache
def _dist_run(name):
    """(generated [B, D_NEW], rejection rate) of one configuration (memoised)."""
    samp_kw, kind, *tree = {**D_EXACT, **D_NEGATIVE}[name]
    model, tp, heads = _dist_setup()
    hc, hp = heads[{"misreport": "medusa", "hybrid": "eagle_reduced", "hybrid_misreport": "eagle_reduced"}.get(kind, kind)]
    dr = {"misreport": lambda: MisreportingMedusa(hc), "hybrid": lambda: _hybrid(_drafter(hc)),
          "hybrid_misreport": lambda: _hybrid(_drafter(hc), MisreportingHybrid)}.get(kind, lambda: _drafter(hc))()
    eng = decoding.Engine(model, dr, decoding.GenerationConfig(max_new_tokens=D_NEW, gamma=tree[0] if tree else D_GAMMA))
    batch = decoding.make_batch([list(D_PROMPT)] * D_BATCH, eng.config, jax.random.key(D_SEED))
    out = eng.run(decoding.EngineParams(target=tp, draft=hp), sampling.SamplingConfig.make(**samp_kw), batch)
    np.testing.assert_array_equal(np.asarray(out.lengths_B), len(D_PROMPT) + D_NEW)
    m = out.metrics
    rejection = 1.0 - int(np.asarray(m.accepted_B).sum()) / int(np.asarray(m.proposed_B).sum())
    return np.asarray(out.tokens_BL)[:, len(D_PROMPT):len(D_PROMPT) + D_NEW], rejection


@functools.cache
def _exact_law(samp_items):
    """Exact target-only probability of every D_NEW-token continuation (itertools.product order)."""
    model, tp, _ = _dist_setup()
    cfg = sampling.SamplingConfig.make(**dict(samp_items))
    cells = np.array(list(itertools.product(range(DV), repeat=D_NEW)))
    toks = np.concatenate([np.tile(D_PROMPT, (len(cells), 1)), cells], axis=1)
    probs = jax.jit(lambda p, t, c: sampling.probabilities(model.apply(p, t, None)[0], c))
    p = np.asarray(probs(tp, jnp.asarray(toks, jnp.int32), cfg), np.float64)
    P = len(D_PROMPT)
    law = np.ones(len(cells))
    for j in range(D_NEW):
        law *= p[np.arange(len(cells)), P - 1 + j, cells[:, j]]
    return law / law.sum()


def _law(samp_kw):
    return _exact_law(tuple(sorted(samp_kw.items())))


def _pvalue(gen_BN, law):
    """Pooled chi-square p-value (cells with expected count < 5 pooled; see
    test_engine_distribution.py), the number of samples in cells of exact probability 0, and
    the number of cells tested."""
    index = gen_BN @ (DV ** np.arange(D_NEW - 1, -1, -1))
    observed = np.bincount(index, minlength=len(law)).astype(np.float64)
    n = observed.sum()
    impossible = int(observed[law == 0].sum())
    expected = n * law
    support = law > 0
    big = support & (expected >= 5)
    small = support & ~big
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < 5:
            i = int(np.argmin(exp[:-1]))
            obs[i] += obs.pop()
            exp[i] += exp.pop()
    obs, exp = np.array(obs), np.array(exp)
    exp *= obs.sum() / exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(scipy.stats.chi2.sf(stat, len(obs) - 1)), impossible, len(obs)


@pytest.mark.parametrize("name", list(D_EXACT))
def test_head_sampling_matches_target_law(name):
    """Distribution exactness of head drafters at T = 1: a Medusa head with top-k 3 + top-p 0.9,
    an EAGLE head with a reduced vocabulary (3 of the 5 tokens: its q is 0 on the others,
    which the target may still emit) without filters, that head drafting a sampled token
    tree (2 iid children of the root, one child each; top-k 3) through the tree verifier, and
    the hybrid of prompt lookup (bigrams; used where the last token occurred before, one-hot
    q) and that head (elsewhere), rows mixing both within and across rounds.

    A tiny Llama target (V = 5, 2 layers, weights scaled so that its distributions are peaked
    and prefix dependent); every row generates N = 4 tokens after the prompt (1, 4, 2) with
    gamma = 2 (several rounds per row, including the catch-up after a fully accepted round).
    Sample size: B = 30 000 rows per configuration in one batched `Engine.run`, one key per
    row (`make_batch` folds the request ids 0..B-1 into key 2025; all seeds are fixed, so the
    outcome is deterministic). The empirical law of the N-token continuation (5^4 = 625 cells)
    is compared with the exact target-only law (enumerated with `apply` and
    `sampling.probabilities` under the same `SamplingConfig`) by a pooled chi-square test
    (cells with expected count < 5 pooled; cells of exact probability 0 must stay empty).
    Family: the 4 configurations in D_EXACT, family-wise false-alarm rate 1e-4, so each test
    uses alpha = 5e-5 (Bonferroni). The negative control below must fail the same test."""
    samp_kw = D_EXACT[name][0]
    gen, rejection = _dist_run(name)
    p, impossible, n_cells = _pvalue(gen, _law(samp_kw))
    print(f"\n[{name}] p={p:.3g} rejection={rejection:.3f} cells={n_cells} (alpha per test {PER_TEST_ALPHA:.2g})")
    assert impossible == 0, f"{impossible} samples have target probability 0"
    # (A tree proposes 3 nodes and accepts at most 2: its rate is at least 1/3 by construction.)
    assert 0.1 < rejection < 0.95, f"rejection rate {rejection:.3f}: drafts should be both accepted and rejected"
    assert n_cells > 20
    assert p > PER_TEST_ALPHA, f"{name}: chi-square p={p:.3g} rejects exactness"


@pytest.mark.parametrize("name", list(D_NEGATIVE))
def test_head_sampling_negative_control_is_detected(name):
    """Broken drafters must fail the same test (p < the per-test alpha): a Medusa drafter that
    samples at T/2 but reports the T = 1 q, and a hybrid that reports the head's q for its
    prompt-lookup drafts (whose true q is one-hot): the test has power against a misreported q."""
    samp_kw = D_NEGATIVE[name][0]
    gen, rejection = _dist_run(name)
    p, _, n_cells = _pvalue(gen, _law(samp_kw))
    print(f"\n[{name}] p={p:.3g} rejection={rejection:.3f} cells={n_cells} (must be below alpha)")
    assert p < PER_TEST_ALPHA, f"negative control not detected (p={p:.3g})"


def test_distribution_target_is_peaked_and_prefix_dependent():
    """Guards the distribution tests: the target law is far from uniform, the filters cut
    many cells, and the next-token distribution depends on more than the current token (so a
    rollback that kept wrong history would change the law)."""
    law = _law(T1)
    assert law.max() > 20 / DV ** D_NEW
    filtered = _law(T1_FILTERED)
    assert (filtered == 0).sum() > 0.3 * len(filtered)
    model, tp, _ = _dist_setup()
    toks = np.random.default_rng(0).integers(0, DV, (64, 6)).astype(np.int32)
    toks[:, -1] = 2                                           # same current token, other prefixes
    p = np.asarray(jax.nn.softmax(_jit_apply(model)(tp, toks, None)[0][:, -1]))
    assert np.abs(p[:32] - p[32:]).sum(-1).mean() > 0.3


# ----------------------------------------------------------------------------- 6. training forward

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


# ----------------------------------------------------------------------------- 7. errors

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
    # gamma > num_heads: raised when the round is traced
    eng = decoding.Engine(model, med, _gen(4))
    with pytest.raises(ValueError, match="at most"):
        eng.run(decoding.EngineParams(target=tp, draft=hp), GREEDY,
                decoding.make_batch(PROMPTS, eng.config, jax.random.key(0)))
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


# ----------------------------------------------------------------------------- 9. packed layout

PACKED_CFG = CFG.replace(scan_layers=False, fuse_projections=True, packed_projections=True)


@functools.cache
def _packed_target():
    model = models.Llama(PACKED_CFG)
    return model, model.prepare_params(_target()[1])


def _propose_once(drafter, hp, model, tp, samp, gamma=2, seed=7):
    """(tokens, q) of one jitted `propose` after `init` on a random 9-token context with the
    target's true features (those the engine would hand the head)."""
    rng = np.random.default_rng(seed)
    cap, ctx = 16, 9
    toks = jnp.asarray(rng.integers(0, V, (2, cap)), jnp.int32)
    lengths = jnp.asarray([ctx, ctx - 3], jnp.int32)
    layers = drafter.feature_layers
    _, feats = _jit_features(models.Llama(CFG))(_target()[1], toks, None, layers=layers)[:2]
    state = drafter.init(hp, toks[:, :ctx], lengths, cap, features_BPF=feats[:, :ctx])
    ctxt = drafters.DraftContext(tokens_BL=toks, lengths_B=lengths, features=feats,
                                 target_cache=model.init_cache(2, cap).rollback(lengths - 1))
    keys = decoding.request_keys(jax.random.key(seed), [0, 1])
    return jax.jit(lambda p, st, c, k: drafter.propose(p, st, c, k, gamma, samp)[:2])(hp, state, ctxt, keys)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3_reduced"])
def test_packed_head_drafts_as_the_plain_head(kind, tmp_path):
    """Beside a packed target (the CPU kernel's layout) `load_head` runs the head packed too
    (its matrices as kernel panels, its layer unrolled and fused): at T = 1 with top-k its
    proposals and q equal the plain head's on the plain target (q to 2e-5: another summation
    order), and a greedy engine run with the EAGLE-3 one equals target-only decoding. The plain-layout
    config is what is stored: save / load round-trips it."""
    hc = _head_config(kind)
    own = _own_params(hc, "good" if kind != "medusa" else "random")
    drafters.save_head(tmp_path / "h", hc, own, dtype="float32")
    pmodel, ptp = _packed_target()
    dr, hp = drafters.load_head(tmp_path / "h", pmodel, ptp)
    got = dr.config if kind == "medusa" else dr.model.config
    assert got == dataclasses.replace(hc, target=PACKED_CFG, packed=True)
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
    with pytest.raises(ValueError, match="packed target"):
        dataclasses.replace(hc, packed=True)


# ----------------------------------------------------------------------------- 8. prefill reuse

def test_prefill_reuse_with_eagle_head():
    """`Engine.prefill` once, then `run(..., prefill=pre)` (twice: the prefill is not donated)
    gives exactly the tokens and metrics of the same engine without it (its round-by-round
    run from `init`, the same rounds as `run`); the target-only engine takes the same prefill."""
    eng, ep, batch = _eagle_setup("good")
    pre = eng.prefill(ep, batch)
    assert pre.features_BLF is not None and pre.features_BLF.shape == (len(PROMPTS), batch.capacity, D)
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
        eng.run(ep, GREEDY, batch, prefill=dataclasses.replace(pre, features_BLF=None))


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
    assert pre.features_BLF is not None
    out = eng.run(ep, GREEDY, batch, prefill=pre)
    ref = decoding.GenerateOutput.from_state(_medusa_stepped("random")[1])
    assert out.generated() == ref.generated()
    for x, y in zip(jax.tree.leaves(out.metrics), jax.tree.leaves(ref.metrics)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_scheduler_refills_head_rows():
    """The slot-refilling scheduler with the 'good' EAGLE head (gamma 3, greedy), 4 requests
    through 2 slots: every request gets the target-only tokens and the same accepted counts as
    its row of the whole-batch run, so a refilled row's target features and head cache hold
    only its own request (a row left with the previous request's features drafts otherwise)."""
    from specjax import serving
    eng, ep, batch = _eagle_setup("good")
    whole = jax.device_get(eng.run(ep, GREEDY, batch).metrics)
    requests = [serving.Request(id=i, prompt=p) for i, p in enumerate(PROMPTS)]
    out = serving.Scheduler(eng, ep, slots=2, pad_multiple=16, capacity=batch.capacity).run(
        requests, GREEDY, jax.random.key(2), warmup=False)
    assert [r.tokens for r in out.results] == _target_only()[0]
    assert [r.counters["accepted"] for r in out.results] == np.asarray(whole.accepted_B).tolist()
    assert [r.counters["proposed"] for r in out.results] == np.asarray(whole.proposed_B).tolist()
    assert sum(r.counters["accepted"] for r in out.results) > 0


# ----------------------------------------------------------------------------- 9. hybrid: prompt lookup + head

# Rows 0 and 2 repeat themselves from the start (prompt lookup drafts them at once), rows 1
# and 3 do not (the head drafts them until their last token is one seen before: min_match 1).
HYBRID_PROMPTS = ((5, 6, 5, 6, 5), (3, 4), (7, 8, 9, 7, 8, 9, 7), (1, 2, 3, 4, 5, 6, 7, 8, 9))


@functools.cache
def _hybrid_setup():
    model, tp = _target()
    head, hp = _head("eagle", "good")
    dr = _hybrid(head, max_ngram=3, min_match=1)
    eng = decoding.Engine(model, dr, _gen(3))
    ep = decoding.EngineParams(target=tp, draft=hp)
    return eng, ep, decoding.make_batch([list(p) for p in HYBRID_PROMPTS], eng.config, jax.random.key(2))


def test_hybrid_rule_and_proposals():
    """One `HybridDrafter.propose` (jitted): rows whose longest suffix match has >= min_match
    tokens get exactly the n-gram drafter's proposal (one-hot q), the others exactly the
    head's (tokens and q, same key); when every row matches, the head does not run and its
    state comes back unchanged."""
    eng, ep, batch = _hybrid_setup()
    dr = eng.drafter
    state = eng.init(ep, batch)
    keys = jax.random.split(jax.random.key(5), len(HYBRID_PROMPTS))

    def context(tokens_BL, lengths_B=state.lengths_B):
        return drafters.DraftContext(tokens_BL=tokens_BL, lengths_B=lengths_B, target_cache=state.target_cache,
                                     features=state.features_BLF)

    hybrid = jax.jit(lambda p, s, c, k: dr.propose(p, s, c, k, 3, GREEDY))
    head = jax.jit(lambda p, s, c, k: dr.model.propose(p, s, c, k, 3, GREEDY))
    ngram = jax.jit(lambda c: dr.retrieval.propose(None, None, c, None, 3, GREEDY)[:2])
    rule = jax.jit(dr.uses_lookup)
    ctx = context(state.tokens_BL)
    lookup = np.asarray(rule(ctx))
    assert lookup.tolist() == [True, False, True, False]
    toks, q, new_state = hybrid(ep.draft, state.draft_state, ctx, keys)
    h_toks, h_q, h_state = head(ep.draft, state.draft_state, ctx, keys)
    n_toks, n_q = ngram(ctx)
    for b, use in enumerate(lookup):
        want_t, want_q = (n_toks, n_q) if use else (h_toks, h_q)
        np.testing.assert_array_equal(np.asarray(toks[b]), np.asarray(want_t[b]))
        np.testing.assert_array_equal(np.asarray(q[b]), np.asarray(want_q[b]))
    assert np.asarray(n_toks[0]).tolist() == [6, 5, 6] and np.asarray(n_toks[2]).tolist() == [8, 9, 7]
    for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(h_state)):      # the head ran
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Every row repeating (each row given row 0's tokens): lookup only.
    ctx_all = context(jnp.broadcast_to(state.tokens_BL[:1], state.tokens_BL.shape),
                      jnp.broadcast_to(state.lengths_B[:1], state.lengths_B.shape))
    assert np.asarray(rule(ctx_all)).all()
    toks, q, same = hybrid(ep.draft, state.draft_state, ctx_all, keys)
    n_toks, n_q = ngram(ctx_all)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(n_toks))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(n_q))
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(state.draft_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Rows 1 and 3 finished (`active_B` False): the head does not run for them; the active rows
    # get their lookup proposals.
    ctx_idle = ctx.replace(active_B=jnp.asarray(lookup))
    toks, q, same = hybrid(ep.draft, state.draft_state, ctx_idle, keys)
    n_toks, n_q = ngram(ctx)
    np.testing.assert_array_equal(np.asarray(toks)[lookup], np.asarray(n_toks)[lookup])
    np.testing.assert_array_equal(np.asarray(q)[lookup], np.asarray(n_q)[lookup])
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(state.draft_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # One row (the main command's batch, whose model branch skips the per-row select): each
    # prompt's proposal equals the row's drafter's.
    for b, use in ((0, True), (1, False)):
        one = decoding.make_batch([list(HYBRID_PROMPTS[b])], eng.config, jax.random.key(2), capacity=batch.capacity)
        st = eng.init(ep, one)
        c1 = drafters.DraftContext(tokens_BL=st.tokens_BL, lengths_B=st.lengths_B, target_cache=st.target_cache,
                                   features=st.features_BLF)
        toks, q, _ = hybrid(ep.draft, st.draft_state, c1, keys[:1])
        want_t, want_q = ngram(c1) if use else head(ep.draft, st.draft_state, c1, keys[:1])[:2]
        np.testing.assert_array_equal(np.asarray(toks), np.asarray(want_t))
        np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))


def test_hybrid_greedy_and_head_cache_after_every_commit():
    """Prompt lookup + the 'good' EAGLE head, gamma 3, greedy, round by round: the target-only
    tokens; both drafters draft (rounds mixing both in one batch, and rounds in which every row
    drafts by lookup and the head does not run); after every commit the head's cache keeps
    exactly the slots it should (unchanged after a lookup-only round, else cut back to the
    round's start) and they equal a fresh prefill over the committed tokens with their true
    features, so the head catches up correctly after sitting out."""
    eng, ep, batch = _hybrid_setup()
    rounds, final = _step_through(eng, ep, batch, GREEDY)
    assert decoding.GenerateOutput.from_state(final).generated() == _target_only(HYBRID_PROMPTS)[0]
    rule = jax.jit(eng.drafter.uses_lookup)
    init = eng.init(ep, batch)
    states = [init] + [st for _, st in rounds[:-1]]
    lookup = np.stack([np.asarray(rule(drafters.DraftContext(tokens_BL=jnp.asarray(s.tokens_BL),
                                                             lengths_B=jnp.asarray(s.lengths_B), target_cache=None)))
                       for s in states])
    live = np.stack([~np.asarray(s.done_B) for s in states])
    assert (lookup & live).any() and (~lookup & live).any(), lookup
    assert ((lookup & live).any(axis=1) & (~lookup & live).any(axis=1)).any(), "no round mixed both drafters"
    assert lookup.all(axis=1).any(), "no round in which the head sat out (every row by lookup)"
    # The host replay of the rule (the CLI's report) gives the same rounds.
    lengths = np.stack([np.asarray(s.lengths_B) for s in [init] + [st for _, st in rounds]])
    for b, p in enumerate(HYBRID_PROMPTS):
        sizes = [int(n) for n, a in zip(np.diff(lengths[:, b]), live[:, b]) if a]
        row = np.asarray(final.tokens_BL)[b, :int(lengths[-1, b])].tolist()
        assert eng.drafter.lookup_rounds(row, len(p), sizes) == lookup[:len(sizes), b].tolist()
    m = final.metrics
    assert int(np.asarray(m.accepted_B).sum()) > 0
    # The head's kept slots, exactly: a round in which every active row drafts by lookup leaves the
    # head's cache as it was (the head does not run); any other round cuts every row back to the
    # slots before the round's start, as a head-only round does (the head caught up on all rows).
    kept_before = np.asarray(init.draft_state.cache.kv.lengths_B)
    for r, (before, st) in enumerate(rounds):
        kept = np.asarray(st.draft_state.cache.kv.lengths_B)
        head_sat_out = (lookup[r] | ~live[r]).all()          # finished rows do not keep the head running
        want = kept_before if head_sat_out else np.minimum(np.asarray(st.lengths_B) - 1, before)
        np.testing.assert_array_equal(kept, want, err_msg=f"round {r}, lookup rows {lookup[r]}")
        kept_before = kept
    hc = eng.drafter.model.model.config
    worst = max(_kept_slots_vs_fresh(hc, ep, batch.capacity, st) for _, st in rounds)
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


def test_hybrid_settings_are_checked():
    model, tp = _target()
    head, _ = _head("eagle", "good")
    with pytest.raises(ValueError, match="min_match"):
        _hybrid(head, max_ngram=3, min_match=4)
    with pytest.raises(ValueError, match="vocab mismatch"):
        drafters.HybridDrafter(drafters.NGramDrafter(V + 1), head)
    with pytest.raises(ValueError, match="chains"):
        decoding.Engine(model, _hybrid(head), _gen(trees.TreeShape.from_branching((2, 1))))
    with pytest.raises(ValueError, match="force"):
        dataclasses.replace(_hybrid(head), force=2)


def test_adaptive_policy_keeps_an_estimate_per_regime():
    """`adaptive.update` folds each regime's tested acceptances into that regime's estimate only,
    and remembers the choice of the round's regime only; `choose` prices a round with its own
    regime's estimate and round times; the batch regime is the lowest among active rows."""
    from specjax.decoding import adaptive
    pol = decoding.AdaptiveGamma(gammas=(0, 1, 3), ema=0.5, hysteresis=0.0, initial_alpha=0.5)
    st = adaptive.init_policy(pol, [[1.0, 5.0, 9.0], [1.0, 1.0, 1.0]])
    # At the prior 0.5: gamma 0 is cheapest in regime 0 (a dear draft), gamma 3 in regime 1.
    assert int(adaptive.choose(pol, st, 0)[0]) == 0 and int(adaptive.choose(pol, st, 1)[0]) == 2
    new = adaptive.update(pol, st, jnp.int32(2), jnp.zeros((), bool), jnp.asarray([0.0, 2.7]),
                          jnp.asarray([0, 3]), regime=1)
    np.testing.assert_allclose(np.asarray(new.alpha_R), [0.5, 0.5 * 0.5 + 0.5 * 0.9], rtol=1e-6)
    assert np.asarray(new.index_R).tolist() == [2, 2] and np.asarray(new.since_probe_R).tolist() == [0, 0]
    new = adaptive.update(pol, new, jnp.int32(0), jnp.zeros((), bool), jnp.asarray([0.4, 0.0]),
                          jnp.asarray([2, 0]), regime=0)
    np.testing.assert_allclose(np.asarray(new.alpha_R), [0.5 * 0.5 + 0.5 * 0.2, 0.7], rtol=1e-6)
    assert np.asarray(new.index_R).tolist() == [0, 2] and np.asarray(new.since_probe_R).tolist() == [1, 0]
    regime = jax.jit(adaptive.batch_regime)
    assert int(regime(jnp.asarray([1, 0, 1]), jnp.asarray([True, True, True]))) == 0
    assert int(regime(jnp.asarray([1, 0, 1]), jnp.asarray([True, False, True]))) == 1
    assert int(regime(jnp.asarray([1, 1]), jnp.asarray([False, False]))) == 0


def test_hybrid_adaptive_gamma_per_draft_source():
    """Adaptive gamma over the hybrid (two rows, greedy) with round times per draft source: the
    model half's rounds priced so that drafting never pays (gamma 0 but for probes), the lookup
    half's so that gamma 3 always does. Every round runs the gamma of its own regime (read before
    the round from the committed tokens: lookup only when every active row drafts by lookup),
    which one pooled estimate and one row of round times could not do; the tokens equal
    target-only greedy. `stream` with every candidate precompiled (the main command's path:
    host dispatch of the chosen round) makes the same rounds and compiles nothing after its
    first round."""
    eng, ep, _ = _hybrid_setup()
    prompts = HYBRID_PROMPTS[0::2]      # two rows that repeat themselves
    policy = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=4)
    eng = dataclasses.replace(eng, config=_gen(policy))
    batch = decoding.make_batch([list(p) for p in prompts], eng.config, jax.random.key(2))
    assert eng.regimes == 2
    times = (1.0, 5.0, 9.0) + (1.0, 1.0, 1.0)           # (model: gamma 0, 1, 3), (lookup: gamma 0, 1, 3)
    state = eng.init(ep, batch, round_time_s=times)
    regime = jax.jit(eng._regime)
    chosen = []                                  # (batch regime, gamma index) per round
    for _ in range(MAX_NEW):
        r = int(regime(state)[0])
        before = np.asarray(state.metrics.gamma_rounds_K)
        state, _ = eng.step(ep, GREEDY, state)
        chosen.append((r, int(np.argmax(np.asarray(state.metrics.gamma_rounds_K) - before))))
        if np.asarray(state.done_B).all():
            break
    assert decoding.GenerateOutput.from_state(state).generated() == _target_only(prompts)[0]
    lookup = [g for r, g in chosen if r == drafters.HybridDrafter.LOOKUP]
    model = [g for r, g in chosen if r == drafters.HybridDrafter.MODEL]
    print("\n(regime, gamma index) per round:", chosen)
    assert lookup and model, chosen
    assert set(lookup) == {2}, chosen                     # gamma 3 in every lookup round
    assert set(model) <= {0, 1} and model.count(0) > model.count(1), chosen   # gamma 0, probes at gamma 1
    stream = eng.stream(ep, GREEDY, batch, round_time_s=times, precompile=True)
    events = [next(stream)]
    compiled = decoding.Engine._chosen_round_jit._cache_size()
    events += list(stream)
    assert decoding.Engine._chosen_round_jit._cache_size() == compiled, "a round compiled mid-stream"
    last = events[-1].output
    assert [sum((e.new_tokens[b] for e in events), []) for b in range(len(prompts))] == _target_only(prompts)[0]
    np.testing.assert_array_equal(np.asarray(last.metrics.gamma_rounds_K), np.asarray(state.metrics.gamma_rounds_K))
    np.testing.assert_allclose(np.asarray(last.policy.alpha_R), np.asarray(state.policy.alpha_R), rtol=1e-6)
    with pytest.raises(ValueError, match="per \\(regime, gamma\\)"):
        eng.init(ep, batch, round_time_s=(1.0,) * 5)
    for bad in ((1.0, float("nan"), 1.0), (1.0, 0.0, 1.0) * 2, (1.0, -2.0, 1.0)):
        with pytest.raises(ValueError, match="finite and > 0"):
            eng.init(ep, batch, round_time_s=bad)
    head = eng.drafter.model                    # a drafter that declares two regimes but cannot say which drafts
    two = type("TwoSources", (type(head),), {"capabilities": dataclasses.replace(head.capabilities, regimes=2)})(
        **{f.name: getattr(head, f.name) for f in dataclasses.fields(head) if f.init})
    with pytest.raises(ValueError, match="lacks regime_B or for_regime"):
        decoding.Engine(eng.target, two, eng.config)


def test_round_times_time_each_draft_source_on_its_own(monkeypatch):
    """`Engine.round_times` of a drafter with two sources: each source timed by an engine whose
    drafter is held to it (`for_regime`), with the caller's prefill handed over (its drafter
    relabelled: same state), regime-major; a held drafter drafts every row from its source."""
    eng, ep, batch = _hybrid_setup()
    eng = dataclasses.replace(eng, config=_gen(decoding.AdaptiveGamma(gammas=(0, 3))))
    calls = []

    def fake(self, params, sampling_cfg, b, repeats, prefill):
        calls.append((self.drafter, prefill))
        return [float(len(calls)), 10.0 * len(calls)]

    monkeypatch.setattr(decoding.Engine, "_time_rounds", fake)
    pre = eng.prefill(ep, batch)
    assert eng.round_times(ep, GREEDY, batch, prefill=pre) == [1.0, 10.0, 2.0, 20.0]
    H = drafters.HybridDrafter
    assert [d for d, _ in calls] == [eng.drafter.for_regime(H.MODEL), eng.drafter.for_regime(H.LOOKUP)]
    assert all(p.drafter == d and p.draft_state is pre.draft_state for d, p in calls)
    state = eng.init(ep, batch)
    ctx = drafters.DraftContext(tokens_BL=state.tokens_BL, lengths_B=state.lengths_B, target_cache=None)
    assert np.asarray(eng.drafter.regime_B(ctx)).tolist() == [H.LOOKUP, H.MODEL, H.LOOKUP, H.MODEL]
    for r in (H.MODEL, H.LOOKUP):
        assert (np.asarray(eng.drafter.for_regime(r).regime_B(ctx)) == r).all()
