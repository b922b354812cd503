"""The attention seam (`specjax.models.attention`): the ops agree, and a model selects one.

`dot_product` (jax.nn.dot_product_attention) against `reference` (einsums) on the same inputs:
no cache, a cache with ragged lengths, a token tree with a window of tentative entries, and a
sliding window; then whole models (a windowed Mistral-like and a Llama) built with each op give
the same logits for a prefill, a decode step and a tree block. The training-time-test rule
(`TrainingTimeTest`, a block-structured visibility) against the same rule as dense masks through
`reference`, values and gradients. Tolerance: 2e-5 absolute on float32 values of order 1.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import trees
from specjax.models import Llama, ModelConfig, TreeBlock
from specjax.models import attention as attn

ATOL = 2e-5
B, T, N, K, H, S = 2, 5, 4, 2, 8, 16


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k_new = jax.random.normal(ks[1], (B, T, K, H))
    v_new = jax.random.normal(ks[2], (B, T, K, H))
    k_past = jax.random.normal(ks[3], (B, K, S, H))
    v_past = jax.random.normal(ks[4], (B, K, H, S))
    return q, k_new, v_new, (k_past, v_past, jnp.asarray([3, 9], jnp.int32))


def _both(q, k_new, v_new, past, visibility, spec=attn.AttentionSpec(scale=H ** -0.5)):
    ref = attn.reference_attention(q, k_new, v_new, past, visibility, spec)
    dpa = attn.dot_product_attention(q, k_new, v_new, past, visibility, spec)
    np.testing.assert_allclose(np.asarray(dpa), np.asarray(ref), atol=ATOL)
    return np.asarray(ref)


def test_ops_agree_on_every_visibility():
    q, k_new, v_new, past = _inputs()
    lengths = past[2]
    _both(q, k_new, v_new, None, None)
    plain = _both(q, k_new, v_new, past, None)
    # the causal rule spelled out as a visibility is the same rule
    explicit = _both(q, k_new, v_new, past, attn.causal_mask(lengths, T, S))
    np.testing.assert_allclose(explicit, plain, atol=ATOL)
    # a tree over a window of two tentative entries
    shape = trees.TreeShape.from_branching((2, 1))
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, shape.num_nodes))
    vis = trees.ancestor_mask(parents, jnp.ones((B, shape.num_nodes), bool), shape.max_depth)[:, 1:, 1:]
    tree = TreeBlock(rel_positions_BT=jnp.zeros((B, 2), jnp.int32) + 1, visible_BTW=vis[:, 2:4, :4])
    tmask = attn.tree_attention_mask(tree, lengths, S)
    _both(q[:, :2], k_new[:, :2], v_new[:, :2], past, tmask)
    # sliding windows, with and without a cache
    positions = lengths[:, None] + jnp.arange(T)[None]
    windowed = _both(q, k_new, v_new, past, attn.window_mask(None, positions, lengths, S, 4))
    assert np.abs(windowed - plain).max() > 1e-2          # the window removed keys
    _both(q, k_new, v_new, None, attn.window_mask(None, jnp.broadcast_to(jnp.arange(T), (B, T)), None, None, 2))
    # window 0 is no window
    np.testing.assert_allclose(_both(q, k_new, v_new, past, attn.window_mask(None, positions, lengths, S, 0)),
                               plain, atol=ATOL)


@pytest.mark.parametrize("chunk,softcap", [(4, None), (3, 2.0), (1, None)])
def test_causal_chunks_are_the_causal_rule(chunk, softcap):
    """A cache-free causal call longer than ``causal_chunk`` (here 11 tokens in chunks of 4, 3
    and 1, the last chunk short) gives the values and gradients of the one-block computation
    (``causal_chunk=0``), with grouped queries and soft-capping; a call with a cache or another
    visibility never takes the chunked path (the same result with any chunk)."""
    T_ = 11
    ks = jax.random.split(jax.random.key(chunk), 3)
    q = jax.random.normal(ks[0], (B, T_, N, H)) * 2
    k_new, v_new = jax.random.normal(ks[1], (B, T_, K, H)) * 2, jax.random.normal(ks[2], (B, T_, K, H))
    one = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap, causal_chunk=0)
    chunked = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap, causal_chunk=chunk)
    # jitted: one program per computation (op by op, every chunk's shapes compile their own kernels)
    f = lambda spec: jax.jit(lambda *a: attn.reference_attention(*a, None, None, spec))  # noqa: E731
    np.testing.assert_allclose(np.asarray(f(chunked)(q, k_new, v_new)), np.asarray(f(one)(q, k_new, v_new)),
                               atol=ATOL)
    w = jax.random.normal(jax.random.key(5), (B, T_, N * H))
    g1 = jax.jit(jax.grad(lambda *a: jnp.sum(f(one)(*a) * w), argnums=(0, 1, 2)))(q, k_new, v_new)
    g2 = jax.jit(jax.grad(lambda *a: jnp.sum(f(chunked)(*a) * w), argnums=(0, 1, 2)))(q, k_new, v_new)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)
    full = attn.reference_attention(q, k_new, v_new, None, (jnp.ones((B, T_, 0), bool),
                                                            jnp.ones((B, T_, T_), bool)), chunked)
    assert np.abs(np.asarray(full) - np.asarray(f(one)(q, k_new, v_new))).max() > 1e-2   # not causal: differs
    np.testing.assert_array_equal(np.asarray(full), np.asarray(attn.reference_attention(
        q, k_new, v_new, None, (jnp.ones((B, T_, 0), bool), jnp.ones((B, T_, T_), bool)), one)))


@pytest.mark.parametrize("blocks,hides_first,softcap", [(1, False, None), (2, True, None), (4, False, 3.0),
                                                       (3, True, 3.0)])
def test_training_time_test_equals_its_dense_masks(blocks, hides_first, softcap):
    """`training_time_test_attention` (a causal block and diagonal entries) == `reference` under
    `TrainingTimeTest.dense` (grouped queries, soft-capping, the first slot hidden or not), and so
    do the gradients with respect to every input; the dense masks are not the plain causal rule
    (the outputs differ from causal attention over the same keys)."""
    ks = jax.random.split(jax.random.key(blocks), 5)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k_new, v_new = jax.random.normal(ks[1], (B, T, K, H)), jax.random.normal(ks[2], (B, T, K, H))
    k_past = jax.random.normal(ks[3], (B, K, blocks * T, H))
    v_past = jax.random.normal(ks[4], (B, K, H, blocks * T))
    spec = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap)
    tt = attn.TrainingTimeTest(hides_first=hides_first)

    def fast(q, kn, vn, kp, vp):
        return attn.attention(q, kn, vn, (kp, vp, None), tt, spec=spec)

    def dense(q, kn, vn, kp, vp):
        return attn.reference_attention(q, kn, vn, (kp, vp, None), tt.dense(B, T, blocks), spec)

    args = (q, k_new, v_new, k_past, v_past)
    np.testing.assert_allclose(np.asarray(fast(*args)), np.asarray(dense(*args)), atol=ATOL)
    w = jax.random.normal(jax.random.key(9), (B, T, N * H))
    g_fast = jax.jit(jax.grad(lambda *a: jnp.sum(fast(*a) * w), argnums=(0, 1, 2, 3, 4)))(*args)
    g_dense = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(g_fast, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)
    causal = attn.reference_attention(q, k_new, v_new, (k_past, v_past, jnp.full((B,), blocks * T)), None, spec)
    assert np.abs(np.asarray(causal) - np.asarray(fast(*args))).max() > 1e-2
    with pytest.raises(ValueError, match="whole blocks"):
        attn.attention(q, k_new, v_new, (k_past[:, :, 1:], v_past[..., 1:], None), tt, spec=spec)


@pytest.mark.parametrize("blocks,hides_first", [(1, False), (2, True), (3, False)])
def test_training_time_test_at_origins_is_the_full_rule_gathered(blocks, hides_first):
    """With ``origins_BQ`` (queries at Q < T origins, padded by repeats) the op gives row q of the
    full computation at origin ``origins_BQ[b, q]`` (the origins' own queries, diagonal entries
    and new keys gathered from the full inputs; the step-1 block whole), equals `reference`
    under `TrainingTimeTest.dense` with the origins, and so do its gradients; a past that is not
    T step-1 entries plus whole blocks of Q is refused."""
    ks = jax.random.split(jax.random.key(10 + blocks), 5)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k_new, v_new = jax.random.normal(ks[1], (B, T, K, H)), jax.random.normal(ks[2], (B, T, K, H))
    k_past = jax.random.normal(ks[3], (B, K, blocks * T, H))
    v_past = jax.random.normal(ks[4], (B, K, H, blocks * T))
    spec = attn.AttentionSpec(scale=H ** -0.5, softcap=None)
    full = attn.attention(q, k_new, v_new, (k_past, v_past, None), attn.TrainingTimeTest(hides_first=hides_first),
                          spec=spec)
    rng = np.random.default_rng(blocks)
    Q = T // 2
    o_BQ = np.stack([np.sort(rng.choice(T, Q, replace=False)) for _ in range(B)]).astype(np.int32)
    o_BQ[0, -1] = o_BQ[0, -2]                  # a padding origin repeats one
    o = jnp.asarray(o_BQ)
    rows = lambda x: jnp.take_along_axis(x, o.reshape(B, Q, 1, 1), axis=1)  # noqa: E731  [B, T, ...] -> [B, Q, ...]
    diag_k = [jnp.transpose(rows(jnp.transpose(k_past[:, :, i * T:(i + 1) * T], (0, 2, 1, 3))), (0, 2, 1, 3))
              for i in range(1, blocks)]
    diag_v = [jnp.transpose(rows(jnp.transpose(v_past[..., i * T:(i + 1) * T], (0, 3, 1, 2))), (0, 2, 3, 1))
              for i in range(1, blocks)]
    kp = jnp.concatenate([k_past[:, :, :T]] + diag_k, axis=2)
    vp = jnp.concatenate([v_past[..., :T]] + diag_v, axis=3)
    tt = attn.TrainingTimeTest(hides_first=hides_first, origins_BQ=o, width=T)
    args = (rows(q), rows(k_new), rows(v_new), kp, vp)

    def fast(q, kn, vn, kp, vp):
        return attn.attention(q, kn, vn, (kp, vp, None), tt, spec=spec)

    def dense(q, kn, vn, kp, vp):
        return attn.reference_attention(q, kn, vn, (kp, vp, None), tt.dense(B, T, blocks, Q), spec)

    got = np.asarray(fast(*args))
    want = np.take_along_axis(np.asarray(full), o_BQ[..., None], axis=1)
    np.testing.assert_allclose(got, want, atol=ATOL)
    np.testing.assert_allclose(got, np.asarray(dense(*args)), atol=ATOL)
    w = jax.random.normal(jax.random.key(9), (B, Q, N * H))
    g_fast = jax.jit(jax.grad(lambda *a: jnp.sum(fast(*a) * w), argnums=(0, 1, 2, 3, 4)))(*args)
    g_dense = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(g_fast, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)
    with pytest.raises(ValueError, match="whole blocks of Q"):
        attn.attention(*args[:3], (kp[:, :, 1:], vp[..., 1:], None), tt, spec=spec)
    with pytest.raises(ValueError, match="go together"):
        attn.TrainingTimeTest(origins_BQ=o)


def test_softcap_is_reference_only_and_named():
    q, k_new, v_new, past = _inputs(1)
    spec = attn.AttentionSpec(scale=0.5, softcap=2.0)
    capped = attn.reference_attention(q, k_new, v_new, past, None, spec)
    uncapped = attn.reference_attention(q, k_new, v_new, past, None, attn.AttentionSpec(scale=0.5))
    assert np.abs(np.asarray(capped) - np.asarray(uncapped)).max() > 1e-2
    with pytest.raises(ValueError, match="soft-cap"):
        attn.dot_product_attention(q, k_new, v_new, past, None, spec)
    with pytest.raises(ValueError, match="unknown attention op 'flash'"):
        attn.get_attention_op("flash")


def test_a_registered_op_is_what_the_model_calls():
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return attn.reference_attention(*args)

    attn.register_attention_op("test_counting", counting)
    try:
        config = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=48, attention_op="test_counting")
        model = Llama(config)
        params = model.init_params(jax.random.key(0))
        model.apply(params, jnp.zeros((1, 3), jnp.int32), None)
        assert calls and set(calls) == {(1, 3, 4, 8)}      # traced once per layer body
    finally:
        attn.ATTENTION_OPS.pop("test_counting")


@pytest.mark.parametrize("window", [0, 3], ids=["llama", "windowed"])
def test_models_agree_across_ops(window):
    from _ops_common import assert_models_agree
    assert_models_agree(ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    head_dim=8, ffn_size=48, sliding_window=window,
                                    window_layers=(True, False) if window else None,
                                    arch="mistral" if window else "llama"), ("reference", "dot_product"))
