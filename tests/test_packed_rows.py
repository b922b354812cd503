"""Packed rows (`specjax.models.PackedRows`): a cached chain block computed only at the positions
each row uses gives the dense call's logits, features and cache entries at those positions.

Reference: the same model's dense call on the same block and cache (float32, tolerance 2e-5:
the packed call runs the same per-position arithmetic in matmuls of another row count).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import Llama, ModelConfig, PackedRows, canonical_params

BASE = ModelConfig(vocab_size=97, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                   head_dim=8, ffn_size=64, rope_theta=10000.0, rms_eps=1e-5)
CONFIGS = {
    "scan": BASE,
    "unrolled_fused": BASE.replace(scan_layers=False, fuse_projections=True),
    "qk_norm_bias": BASE.replace(attention_bias=True, qk_norm=True, scan_layers=False),
    "windows_sandwich": BASE.replace(sliding_window=3, window_layers=(True, False, True), sandwich_norms=True,
                                     local_rope_theta=100.0),
    "experts": BASE.replace(num_experts=4, experts_per_token=2),
}
ATOL = 2e-5


def _model(config, seed=0):
    model = Llama(config)
    params = canonical_params(model.init_params(jax.random.key(seed)), config)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    return model, model.prepare_params(params)


def _prefilled(model, params, B, capacity, seed=1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 9, size=B).astype(np.int32)
    prompt = rng.integers(0, model.vocab_size, size=(B, 9)).astype(np.int32)
    _, cache = jax.jit(model.apply)(params, jnp.asarray(prompt), model.init_cache(B, capacity), jnp.asarray(lengths))
    return cache, lengths


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_block_equals_the_dense_block_where_used(name):
    model, params = _model(CONFIGS[name])
    B, T, N = 4, 5, 11
    cache, lengths = _prefilled(model, params, B, capacity=24)
    counts_B = np.array([1, 5, 2, 3], np.int32)            # 11 used positions in 11 slots
    block = jnp.asarray(np.random.default_rng(2).integers(0, model.vocab_size, size=(B, T)), jnp.int32)
    rows = PackedRows.leading(jnp.asarray(counts_B), T, N)

    dense = jax.jit(lambda p, t, c: model.apply_with_features(p, t, c, layers=(0, -1)))
    packed = jax.jit(lambda p, t, c, r: model.apply_with_features(p, t, c, layers=(0, -1), rows=r))
    ld, fd, cd = dense(params, block, cache)
    lp, fp, cp = packed(params, block, cache, rows)
    used_BT = np.arange(T)[None] < counts_B[:, None]
    np.testing.assert_allclose(np.asarray(lp)[used_BT], np.asarray(ld)[used_BT], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(fp)[used_BT], np.asarray(fd)[used_BT], atol=ATOL, rtol=0)
    assert not np.asarray(lp)[~used_BT].any() and not np.asarray(fp)[~used_BT].any()
    # the cache: committed slots untouched, the used positions' entries as the dense call wrote them
    np.testing.assert_array_equal(np.asarray(cp.lengths_B), np.asarray(cd.lengths_B))
    kd, kp = np.asarray(jax.tree.leaves(cd.k)), np.asarray(jax.tree.leaves(cp.k))
    vd, vp = np.asarray(jax.tree.leaves(cd.v)), np.asarray(jax.tree.leaves(cp.v))
    for b in range(B):
        upto = lengths[b] + counts_B[b]
        np.testing.assert_allclose(kp[..., b, :, :upto, :], kd[..., b, :, :upto, :], atol=ATOL, rtol=0)
        np.testing.assert_allclose(vp[..., b, :, :, :upto], vd[..., b, :, :, :upto], atol=ATOL, rtol=0)
    # and the plain apply agrees with apply_with_features
    la, _ = jax.jit(lambda p, t, c, r: model.apply(p, t, c, rows=r))(params, block, cache, rows)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lp), atol=1e-6, rtol=0)


def test_spare_slots_and_a_wrong_count_show():
    """Slots beyond the used positions change nothing the used ones get; a count that does not fit
    the slots drops positions (the caller's allocation must fit: see the module doc), which the
    comparison catches."""
    model, params = _model(BASE)
    B, T = 3, 4
    cache, _ = _prefilled(model, params, B, capacity=20)
    block = jnp.asarray(np.random.default_rng(3).integers(0, model.vocab_size, size=(B, T)), jnp.int32)
    counts = jnp.asarray([2, 1, 4], jnp.int32)
    fn = jax.jit(lambda p, t, c, r: model.apply(p, t, c, rows=r)[0])
    ld, _ = jax.jit(model.apply)(params, block, cache)
    used = np.arange(T)[None] < np.asarray(counts)[:, None]
    for size in (7, 9, 12):
        lp = fn(params, block, cache, PackedRows.leading(counts, T, size))
        np.testing.assert_allclose(np.asarray(lp)[used], np.asarray(ld)[used], atol=ATOL, rtol=0)
    short = np.asarray(fn(params, block, cache, PackedRows.leading(counts, T, 6)))
    assert not short[2, 3].any()                  # row 2's last used position had no slot


def test_rows_refuse_a_tree_and_a_wrong_block():
    model, params = _model(BASE)
    cache, _ = _prefilled(model, params, 2, capacity=16)
    rows = PackedRows.leading(jnp.asarray([1, 2], jnp.int32), 3, 4)
    with pytest.raises(ValueError, match=r"rows= packs a \[2, 3\] block, the tokens are \[2, 4\]"):
        model.apply(params, jnp.zeros((2, 4), jnp.int32), cache, rows=rows)
    with pytest.raises(ValueError, match="1 to 6 slots, got 7"):
        PackedRows.leading(jnp.asarray([1, 2], jnp.int32), 3, 7)
