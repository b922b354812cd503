"""KV cache semantics of the Llama decoder on small random models.

Reference for every cached computation: a plain causal forward (cache=None) of the row's
whole sequence, one row at a time.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _hf_tiny import right_padded
from specjax.models import (KVCache, Llama, ModelConfig, canonical_params,
                            truncate_layers)
from specjax.models.llama import param_specs

BASE = ModelConfig(vocab_size=97, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                   head_dim=8, ffn_size=64, rope_theta=10000.0, rms_eps=1e-5)
QWENISH = BASE.replace(attention_bias=True, tie_embeddings=False, arch="qwen2",
                       rope_scaling={"rope_type": "linear", "factor": 2.0})
ATOL = 3e-5


def _canonical_weights(specs, rng):
    """Canonical params drawn in numpy (nothing to compile): `init_params`' kinds (normal(0.02)
    weights and biases, unit or zero norms), then every tensor of more than one axis (all but
    the final norm) x4: bigger weights and layer norms make attention patterns non-trivial, and
    a layout that dropped a layer norm's weight would change the logits."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, dict):
            out[name] = _canonical_weights(spec, rng)
            continue
        shape, _, kind = spec
        w = {"ones": np.ones, "zeros": np.zeros}.get(kind, lambda s: 0.02 * rng.standard_normal(s))(shape)
        out[name] = jnp.asarray(w * 4.0 if len(shape) > 1 else w, jnp.float32)
    return out


def _model(config, seed=0):
    """(model, params in the model's layout): the same weights for every layout of a config."""
    model = Llama(config)
    return model, model.prepare_params(_canonical_weights(param_specs(config), np.random.default_rng(seed)))


def _prefill(step, model, prompts, capacity):
    """Ragged prefill: right-padded prompts, ``num_valid_B`` = each row's length."""
    tokens, lengths = right_padded(prompts)
    logits, cache = step(jnp.asarray(tokens), model.init_cache(len(prompts), capacity), jnp.asarray(lengths))
    return logits, cache


_FULL = {}


def _jit_apply(model):
    """``model.apply`` jitted (one program per model and shapes; op by op, every operation of
    every layer compiles its own)."""
    return _FULL.setdefault((model, "apply"), jax.jit(model.apply))


def _fresh(model, params, seq, pad_to=16):
    """Plain causal forward of one row (right-padded to a fixed length: one compile)."""
    fn = _FULL.setdefault(model, jax.jit(lambda p, t: model.apply(p, t, None)[0]))
    seq = np.asarray(seq, np.int32)
    padded = np.zeros((1, pad_to), np.int32)
    padded[0, :len(seq)] = seq
    return np.asarray(fn(params, jnp.asarray(padded)))[0, :len(seq)]      # sliced on the host: no slicing program


# The layouts: the per-layer cache with fused projections ("fused"), the stacked one with separate
# projections ("scan") and with fused ones ("qwenish_fused_scan"), and the Qwen-like features
# (biases, untied head, RoPE scaling). The per-layer cache with separate projections equals the
# stacked one, logits and cache contents: test_scan_and_unrolled_agree.
@pytest.fixture(scope="module", params=["scan", "fused", "qwenish", "qwenish_fused_scan"])
def setup(request):
    config = {"scan": BASE, "fused": BASE.replace(scan_layers=False, fuse_projections=True),
              "qwenish": QWENISH, "qwenish_fused_scan": QWENISH.replace(fuse_projections=True)}[request.param]
    model, params = _model(config)
    return model, params, jax.jit(model.apply)


# Both tests below start alike (3 rows, a ragged prefill padded to 7 tokens, capacity 24, then
# one-token steps): they share those compiled programs per layout.
PLENS, CAPACITY = [5, 2, 7], 24


def test_prefill_then_decode_equals_full_recompute(setup):
    """A ragged prefill (5, 2, 7 tokens) then 6 one-token decode steps per row: every position's
    logits equal a full causal recompute of the row's sequence."""
    model, params, step = setup
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.vocab_size, n + 6) for n in PLENS]
    logits, cache = _prefill(lambda *a: step(params, *a), model, [s[:n] for s, n in zip(seqs, PLENS)], CAPACITY)
    logits = np.asarray(logits)                 # rows sliced on the host (eagerly, every slice compiles)
    got = [[logits[b, :n]] for b, n in enumerate(PLENS)]
    for t in range(6):
        logits, cache = step(params, jnp.asarray([[s[n + t]] for s, n in zip(seqs, PLENS)]), cache)
        logits = np.asarray(logits)
        for b in range(3):
            got[b].append(logits[b])
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(np.concatenate(got[b]), _fresh(model, params, s), atol=ATOL, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), np.asarray(PLENS) + 6)


def test_ragged_batch_append_rollback_append(setup):
    model, params, step = setup
    rng = np.random.default_rng(1)
    V = model.vocab_size
    plens = PLENS
    prompts = [rng.integers(0, V, n) for n in plens]
    # Ragged prefill: right-padded, num_valid_B says how many tokens each row commits. (Outputs are
    # sliced on the host: an eager slice of a device array compiles a program per shape.)
    logits, cache = _prefill(lambda *a: step(params, *a), model, prompts, capacity=CAPACITY)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), plens)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits)[b, :len(p)], _fresh(model, params, p),
                                   atol=ATOL, rtol=1e-4)
    # Append k=4 tokens per row.
    k = 4
    block = rng.integers(0, V, (3, k))
    logits, cache = step(params, jnp.asarray(block), cache)
    for b, p in enumerate(prompts):
        want = _fresh(model, params, np.concatenate([p, block[b]]))[len(p):]
        np.testing.assert_allclose(np.asarray(logits)[b], want, atol=ATOL, rtol=1e-4)
    # Roll back to a different j < k per row (no copy), then append different tokens.
    keep = np.array([1, 3, 0])
    cache2 = cache.rollback(jnp.asarray(plens) + keep)
    assert cache2.k is cache.k and cache2.v is cache.v
    other = rng.integers(0, V, (3, 3))
    # Only part of the block is committed for rows 0 and 2 (like a partial accept).
    num_valid = np.asarray([3, 1, 2])
    logits, cache3 = step(params, jnp.asarray(other), cache2, jnp.asarray(num_valid, jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache3.lengths_B),
                                  np.asarray(plens) + keep + num_valid)
    for b, p in enumerate(prompts):
        prefix = np.concatenate([p, block[b, :keep[b]]])
        want = _fresh(model, params, np.concatenate([prefix, other[b]]))[len(prefix):]
        np.testing.assert_allclose(np.asarray(logits)[b], want, atol=ATOL, rtol=1e-4)
    # And one more decode step on top of the partially committed block.
    nxt = rng.integers(0, V, (3, 1))
    logits, _ = step(params, jnp.asarray(nxt), cache3)
    for b, p in enumerate(prompts):
        seq = np.concatenate([p, block[b, :keep[b]], other[b, :int(num_valid[b])], nxt[b]])
        np.testing.assert_allclose(np.asarray(logits)[b, 0], _fresh(model, params, seq)[-1],
                                   atol=ATOL, rtol=1e-4)


def test_scan_and_unrolled_agree():
    model_s, params = _model(BASE)
    model_u = Llama(BASE.replace(scan_layers=False))
    params_u = model_u.prepare_params(params)
    assert isinstance(params_u["layers"], tuple) and len(params_u["layers"]) == BASE.num_layers
    seq = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 9)))
    ls, cs = jax.jit(model_s.apply)(params, seq, model_s.init_cache(2, 16))
    lu, cu = jax.jit(model_u.apply)(params_u, seq, model_u.init_cache(2, 16))
    np.testing.assert_allclose(np.asarray(ls), np.asarray(lu), atol=1e-5, rtol=1e-5)
    assert not cs.per_layer and cu.per_layer and len(cu.k) == BASE.num_layers
    np.testing.assert_allclose(np.asarray(cs.k), np.stack(cu.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cs.v), np.stack(cu.v), atol=1e-5)
    first = model_u.init_cache(2, 16).first_layers(2)
    assert first.num_layers == 2 and first.capacity == 16 and first.batch_size == 2
    # prepare_params is idempotent and converts back
    again = model_s.prepare_params(params_u)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again, params)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("fuse", [True, False])
def test_apply_refuses_params_or_cache_of_another_layout(scan, fuse):
    """The layout is the config's: other params or a cache of the other layout are an error
    that names the fix, never a silent conversion."""
    model_ref, params = _model(BASE)
    model = Llama(BASE.replace(scan_layers=scan, fuse_projections=fuse))
    seq = jnp.asarray([[3, 1, 4]])
    for other_scan in (True, False):
        for other_fuse in (True, False):
            other = Llama(BASE.replace(scan_layers=other_scan, fuse_projections=other_fuse))
            p = other.prepare_params(params)
            if (other_scan, other_fuse) == (scan, fuse):
                jax.eval_shape(model.apply, p, seq, None)      # accepted (traced: the check is at trace time)
                continue
            with pytest.raises(ValueError, match=r"model\.prepare_params\(params\)"):
                model.apply(p, seq, None)
    with pytest.raises(ValueError, match="init_cache"):
        model.apply(model.prepare_params(params), seq, KVCache.zeros(3, 1, 2, 16, 8, per_layer=scan))
    short, _ = truncate_layers(model.prepare_params(params), BASE, 2)
    with pytest.raises(ValueError, match="prepare_params"):
        model.apply(short, seq, None)


@pytest.mark.parametrize("scan", [True, False])
def test_apply_names_a_missing_or_misshapen_tensor(scan):
    """Params of the right layout with a tensor missing or of another shape (another config, a
    bad edit) are an error naming that tensor, at trace time, not a shape error deep in a layer."""
    model = Llama(BASE.replace(scan_layers=scan))
    _, params = _model(model.config)
    seq = jnp.asarray([[3, 1, 4]])
    first = (lambda p: p["layers"]) if scan else (lambda p: p["layers"][1])
    bad = model.prepare_params(params)
    first(bad)["wq"] = first(bad)["wq"][..., :-8]
    with pytest.raises(ValueError, match=r"\['wq'\] has shape .*expects"):
        jax.jit(model.apply)(bad, seq, None)
    bad = model.prepare_params(params)
    del first(bad)["w_up"]
    with pytest.raises(ValueError, match=r"missing: \['w_up'\]"):
        model.apply(bad, seq, None)
    wide = Llama(model.config.replace(hidden_size=60, ffn_size=72))
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(97, 48\).*\(97, 60\)"):
        wide.apply(params, seq, None)
    with pytest.raises(ValueError, match="final_norm"):
        model.apply({k: v for k, v in params.items() if k != "final_norm"}, seq, None)


@pytest.mark.parametrize("config", [BASE, QWENISH])
def test_fused_projections_round_trip(config):
    """Fusing is exact (same logits), and `canonical_params` gives back the original tensors."""
    model, params = _model(config)
    seq = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 7)))
    want, _ = _jit_apply(model)(params, seq, None)
    for scan in (True, False):
        fused = Llama(config.replace(fuse_projections=True, scan_layers=scan))
        fp = fused.prepare_params(params)
        layer = fp["layers"] if scan else fp["layers"][0]
        assert "wqkv" in layer and "w_gate_up" in layer and "wq" not in layer and "w_up" not in layer
        assert ("bqkv" in layer) == config.attention_bias
        got, _ = _jit_apply(fused)(fp, seq, None)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        back = canonical_params(fp, config)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
        # and an unfused model unfuses prepared params
        again = Llama(config.replace(scan_layers=scan)).prepare_params(fp)
        assert "wq" in (again["layers"] if scan else again["layers"][0])


def test_bfloat16_runs_and_is_close_to_float32():
    model32, params = _model(BASE)
    model16 = Llama(BASE.replace(dtype="bfloat16"))
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    seq = jnp.asarray(np.random.default_rng(3).integers(0, 97, (1, 10)))
    c16 = model16.init_cache(1, 16)
    assert c16.dtype == jnp.bfloat16
    l32, _ = _jit_apply(model32)(params, seq, model32.init_cache(1, 16))
    l16, c16 = jax.jit(model16.apply)(p16, seq[:, :7], c16)
    l16b, c16 = jax.jit(model16.apply)(p16, seq[:, 7:], c16)
    l16 = np.concatenate([np.asarray(l16), np.asarray(l16b)], axis=1)
    assert l16.dtype == np.float32
    scale = np.abs(np.asarray(l32)).max()
    assert np.abs(l16 - np.asarray(l32)).max() / scale < 5e-2


def test_truncate_layers_is_a_smaller_model():
    model, params = _model(BASE)
    p2, c2 = truncate_layers(params, BASE, 2)
    assert c2.num_layers == 2 and p2["layers"]["wq"].shape[0] == 2
    assert p2["embed"] is params["embed"]
    direct = Llama(c2)
    seq = jnp.asarray([[3, 1, 4, 1, 5]])
    got, cache = _jit_apply(direct)(p2, seq, direct.init_cache(1, 8))
    assert cache.num_layers == 2
    # the per-layer, fused layout truncates the same way and keeps its layout
    fused = Llama(BASE.replace(scan_layers=False, fuse_projections=True))
    p2u, c2u = truncate_layers(fused.prepare_params(params), fused.config, 2)
    assert isinstance(p2u["layers"], tuple) and len(p2u["layers"]) == 2 and "wqkv" in p2u["layers"][0]
    got_u, _ = _jit_apply(Llama(c2u))(p2u, seq, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(got_u), atol=1e-5)


def test_hidden_states_and_head_compose_to_apply():
    model, params = _model(QWENISH)
    seq = jnp.asarray([[3, 1, 4, 1, 5]])
    h, _ = model.hidden_states(params, seq, None)
    assert h.shape == (1, 5, QWENISH.hidden_size)
    logits, _ = model.apply(params, seq, None)
    np.testing.assert_allclose(np.asarray(model.logits_from_hidden(params, h)),
                               np.asarray(logits), atol=1e-6)


def test_model_is_static_jit_arg_and_init_is_in_its_layout():
    model, params = _model(BASE)
    assert hash(model) == hash(Llama(BASE)) and model == Llama(BASE)
    seq = jnp.asarray([[1, 2, 3]])
    f = jax.jit(lambda m, p, t: m.apply(p, t, None)[0], static_argnums=0)
    want = model.apply(params, seq, None)[0]
    np.testing.assert_allclose(np.asarray(f(model, params, seq)), np.asarray(want), atol=1e-6)
    assert isinstance(model.init_cache(2, 4), KVCache)
    axes = model.param_logical_axes()
    assert axes["layers"]["wq"] == ("layers", "embed", "heads")
    fused = Llama(BASE.replace(scan_layers=False, fuse_projections=True))
    init = jax.jit(fused.init_params)(jax.random.key(5))      # one program (op by op: one per tensor shape)
    assert isinstance(init["layers"], tuple) and "wqkv" in init["layers"][0]
    _jit_apply(fused)(init, seq, None)
    axes = fused.param_logical_axes()
    assert axes["layers"][0]["wqkv"] == ("embed", "heads") and "wq" not in axes["layers"][0]
    assert jax.tree.structure(init) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)
                                                          and all(isinstance(a, str) for a in x))


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_compiled_decode_step_writes_the_cache_in_place(num_tokens):
    """The donated per-layer cache of a decode / verification step is neither copied nor
    transposed: only its in-place writes touch buffer-sized data (PROFILE.md: with XLA's
    default copy insertion every buffer was copied twice per step; with v stored [.., S, H]
    every layer transposed it). Checks the program the tests compile, i.e. with the XLA CPU
    options of `specjax.build.tune_xla_cpu` (set in conftest)."""
    import re
    model, params = _model(BASE.replace(scan_layers=False, fuse_projections=True))
    cache = model.init_cache(1, 256)
    K, H = BASE.num_kv_heads, BASE.head_dim
    txt = jax.jit(model.apply, donate_argnums=(2,)).lower(
        params, jnp.zeros((1, num_tokens), jnp.int32), cache).compile().as_text()
    entry = txt[txt.index("\nENTRY"):]
    buffer_shape = re.compile(rf"= f32\[(1,)?{K},(256,{H}|{H},256)\]\S* (copy|transpose|fusion)\(")
    moved = [line.strip()[:160] for line in entry.split("\n")
             if buffer_shape.search(line) and "dynamic-update-slice" not in line]
    assert moved == [], "\n".join(moved)
