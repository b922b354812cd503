"""KV cache semantics of the Llama decoder on small random models.

Reference for every cached computation: a plain causal forward (cache=None) of the row's
whole sequence, one row at a time.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import (CacheCapacityError, KVCache, Llama, ModelConfig, check_capacity,
                            prefill, truncate_layers)
from specjax.models.llama import unstack_layers

BASE = ModelConfig(vocab_size=97, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                   head_dim=8, ffn_size=64, rope_theta=10000.0, rms_eps=1e-5)
QWENISH = BASE.replace(attention_bias=True, tie_embeddings=False, arch="qwen2",
                       rope_scaling={"rope_type": "linear", "factor": 2.0})
ATOL = 3e-5


def _model(config, seed=0):
    model = Llama(config)
    params = model.init_params(jax.random.key(seed))
    # Bigger weights than the 0.02 init make attention patterns non-trivial.
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    return model, params


_FULL = {}


def _fresh(model, params, seq, pad_to=16):
    """Plain causal forward of one row (right-padded to a fixed length: one compile)."""
    fn = _FULL.setdefault(model, jax.jit(lambda p, t: model.apply(p, t, None)[0]))
    seq = np.asarray(seq, np.int32)
    padded = np.zeros((1, pad_to), np.int32)
    padded[0, :len(seq)] = seq
    return np.asarray(fn(params, jnp.asarray(padded))[0, :len(seq)])


@pytest.fixture(scope="module", params=["scan", "unrolled", "fused", "qwenish", "qwenish_fused_scan"])
def setup(request):
    config = {"scan": BASE, "unrolled": BASE.replace(scan_layers=False),
              "fused": BASE.replace(scan_layers=False, fuse_projections=True),
              "qwenish": QWENISH, "qwenish_fused_scan": QWENISH.replace(fuse_projections=True)}[request.param]
    model, params = _model(config)
    params = model.prepare_params(params)
    return model, params, jax.jit(model.apply)


def test_prefill_then_decode_equals_full_recompute(setup):
    model, params, step = setup
    rng = np.random.default_rng(0)
    seq = rng.integers(0, model.vocab_size, 12)
    want = _fresh(model, params, seq)
    cache = model.init_cache(1, 32)
    got = []
    logits, cache = step(params, jnp.asarray(seq[None, :6]), cache)
    got.append(np.asarray(logits[0]))
    for t in range(6, 12):
        logits, cache = step(params, jnp.asarray(seq[None, t:t + 1]), cache)
        got.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(got), want, atol=ATOL, rtol=1e-4)
    assert int(cache.lengths_B[0]) == 12


def test_ragged_batch_append_rollback_append(setup):
    model, params, step = setup
    rng = np.random.default_rng(1)
    V = model.vocab_size
    plens = [5, 2, 7]
    prompts = [rng.integers(0, V, n) for n in plens]
    # Ragged prefill: right-padded, num_valid_B says how many tokens each row commits.
    logits, cache, lengths = prefill(model, params, prompts, capacity=24, pad_id=0,
                                     apply_fn=step)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), plens)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[b, :len(p)]), _fresh(model, params, p),
                                   atol=ATOL, rtol=1e-4)
    # Append k=4 tokens per row.
    k = 4
    block = rng.integers(0, V, (3, k))
    logits, cache = step(params, jnp.asarray(block), cache)
    for b, p in enumerate(prompts):
        want = _fresh(model, params, np.concatenate([p, block[b]]))[len(p):]
        np.testing.assert_allclose(np.asarray(logits[b]), want, atol=ATOL, rtol=1e-4)
    # Roll back to a different j < k per row (no copy), then append different tokens.
    keep = np.array([1, 3, 0])
    cache2 = cache.rollback(jnp.asarray(plens) + keep)
    assert cache2.k is cache.k and cache2.v is cache.v
    other = rng.integers(0, V, (3, 3))
    # Only part of the block is committed for rows 0 and 2 (like a partial accept).
    num_valid = jnp.asarray([3, 1, 2])
    logits, cache3 = step(params, jnp.asarray(other), cache2, num_valid)
    np.testing.assert_array_equal(np.asarray(cache3.lengths_B),
                                  np.asarray(plens) + keep + np.asarray(num_valid))
    for b, p in enumerate(prompts):
        prefix = np.concatenate([p, block[b, :keep[b]]])
        want = _fresh(model, params, np.concatenate([prefix, other[b]]))[len(prefix):]
        np.testing.assert_allclose(np.asarray(logits[b]), want, atol=ATOL, rtol=1e-4)
    # And one more decode step on top of the partially committed block.
    nxt = rng.integers(0, V, (3, 1))
    logits, _ = step(params, jnp.asarray(nxt), cache3)
    for b, p in enumerate(prompts):
        seq = np.concatenate([p, block[b, :keep[b]], other[b, :int(num_valid[b])], nxt[b]])
        np.testing.assert_allclose(np.asarray(logits[b, 0]), _fresh(model, params, seq)[-1],
                                   atol=ATOL, rtol=1e-4)


def test_scan_and_unrolled_agree():
    model_s, params = _model(BASE)
    model_u = Llama(BASE.replace(scan_layers=False))
    seq = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 9)))
    ls, cs = jax.jit(model_s.apply)(params, seq, model_s.init_cache(2, 16))
    lu, cu = jax.jit(model_u.apply)(params, seq, model_u.init_cache(2, 16))
    lu2, cu2 = jax.jit(model_u.apply)(model_u.prepare_params(params), seq,
                                      model_u.init_cache(2, 16))
    np.testing.assert_allclose(np.asarray(ls), np.asarray(lu), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lu2), np.asarray(lu), atol=1e-6, rtol=1e-6)
    assert not cs.per_layer and cu2.per_layer and len(cu2.k) == BASE.num_layers
    np.testing.assert_allclose(np.asarray(cs.k), np.stack(cu2.k), atol=1e-5)
    # scan mode also accepts per-layer params
    ls2, _ = model_s.apply(unstack_layers(params), seq, None)
    np.testing.assert_allclose(np.asarray(ls2), np.asarray(ls), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan", [True, False])
def test_either_cache_layout_in_either_layer_loop(scan):
    """A model accepts both cache layouts and returns the layout it was given, same content."""
    model_ref, params = _model(BASE)
    model = Llama(BASE.replace(scan_layers=scan))
    p = model.prepare_params(params)
    seq = jnp.asarray(np.random.default_rng(4).integers(0, 97, (2, 9)))
    want, ref = jax.jit(model_ref.apply)(params, seq[:, :5], model_ref.init_cache(2, 16))
    want2, ref = jax.jit(model_ref.apply)(params, seq[:, 5:], ref)
    for per_layer in (True, False):
        cache = KVCache.zeros(3, 2, 2, 16, 8, per_layer=per_layer)
        step = jax.jit(model.apply, donate_argnums=(2,))
        got, cache = step(p, seq[:, :5], cache)
        got2, cache = step(p, seq[:, 5:], cache)
        assert cache.per_layer == per_layer
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(got2), np.asarray(want2), atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(cache.stacked().v), np.asarray(ref.v), atol=ATOL)
    first = model.init_cache(2, 16).first_layers(2)
    assert first.num_layers == 2 and first.capacity == 16 and first.batch_size == 2


@pytest.mark.parametrize("config", [BASE, QWENISH])
def test_fused_projections_round_trip(config):
    """Fusing is exact (same logits), and `canonical_params` gives back the original tensors."""
    from specjax.models.llama import canonical_params
    model, params = _model(config)
    seq = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 7)))
    want, _ = model.apply(params, seq, None)
    for scan in (True, False):
        fused = Llama(config.replace(fuse_projections=True, scan_layers=scan))
        fp = fused.prepare_params(params)
        layer = fp["layers"] if scan else fp["layers"][0]
        assert "wqkv" in layer and "w_gate_up" in layer and "wq" not in layer and "w_up" not in layer
        assert ("bqkv" in layer) == config.attention_bias
        got, _ = fused.apply(fp, seq, None)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        back = canonical_params(fp, config)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
        # and an unfused model unfuses prepared params
        again = Llama(config.replace(scan_layers=scan)).prepare_params(fp)
        assert "wq" in (again["layers"] if scan else again["layers"][0])


def test_capacity_errors():
    model, params = _model(BASE)
    with pytest.raises(CacheCapacityError):
        check_capacity(16, [10, 3], max_new_tokens=4, gamma=2)
    check_capacity(17, [10, 3], max_new_tokens=4, gamma=2)
    with pytest.raises(CacheCapacityError, match="does not fit"):
        prefill(model, params, [[1] * 9, [2] * 3], capacity=8)
    cache = model.init_cache(1, 8).rollback(jnp.asarray([6]))
    with pytest.raises(CacheCapacityError):
        cache.check_fits(3)
    cache.check_fits(2)


def test_bfloat16_runs_and_is_close_to_float32():
    model32, params = _model(BASE)
    model16 = Llama(BASE.replace(dtype="bfloat16"))
    p16 = model16.cast_params(params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    seq = jnp.asarray(np.random.default_rng(3).integers(0, 97, (1, 10)))
    c16 = model16.init_cache(1, 16)
    assert c16.dtype == jnp.bfloat16
    l32, _ = model32.apply(params, seq, model32.init_cache(1, 16))
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
    got, cache = direct.apply(p2, seq, direct.init_cache(1, 8))
    assert cache.num_layers == 2
    # per-layer form truncates the same way
    p2u, _ = truncate_layers(unstack_layers(params), BASE, 2)
    got_u, _ = Llama(c2.replace(scan_layers=False)).apply(p2u, seq, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(got_u), atol=1e-5)


def test_hidden_states_and_head_compose_to_apply():
    model, params = _model(QWENISH)
    seq = jnp.asarray([[3, 1, 4, 1, 5]])
    h, _ = model.hidden_states(params, seq, None)
    assert h.shape == (1, 5, QWENISH.hidden_size)
    logits, _ = model.apply(params, seq, None)
    np.testing.assert_allclose(np.asarray(model.logits_from_hidden(params, h)),
                               np.asarray(logits), atol=1e-6)


def test_model_is_static_jit_arg_and_accepts_nnx_state():
    model, _ = _model(BASE)
    assert hash(model) == hash(Llama(BASE)) and model == Llama(BASE)
    module = model.module(jax.random.key(5))
    _, state = nnx.split(module)
    seq = jnp.asarray([[1, 2, 3]])
    f = jax.jit(lambda m, p, t: m.apply(p, t, None)[0], static_argnums=0)
    a = f(model, state, seq)
    b = module(seq)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert isinstance(model.init_cache(2, 4), KVCache)
    axes = model.param_logical_axes()
    assert axes["layers"]["wq"] == ("layers", "embed", "heads")


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_compiled_decode_step_writes_the_cache_in_place(num_tokens):
    """The donated per-layer cache of a decode / verification step is neither copied nor
    transposed: only its in-place writes touch buffer-sized data (PROFILE.md: with XLA's
    default copy insertion every buffer was copied twice per step; with v stored [.., S, H]
    every layer transposed it). Checks the program the tests compile, i.e. with the XLA CPU
    options of `specjax.build.tune_xla_cpu` (set in conftest)."""
    import re
    model, params = _model(BASE.replace(scan_layers=False, fuse_projections=True))
    params = model.prepare_params(params)
    cache = model.init_cache(1, 256)
    K, H = BASE.num_kv_heads, BASE.head_dim
    txt = jax.jit(model.apply, donate_argnums=(2,)).lower(
        params, jnp.zeros((1, num_tokens), jnp.int32), cache).compile().as_text()
    entry = txt[txt.index("\nENTRY"):]
    buffer_shape = re.compile(rf"= f32\[(1,)?{K},(256,{H}|{H},256)\]\S* (copy|transpose|fusion)\(")
    moved = [line.strip()[:160] for line in entry.split("\n")
             if buffer_shape.search(line) and "dynamic-update-slice" not in line]
    assert moved == [], "\n".join(moved)
