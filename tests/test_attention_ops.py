"""The attention seam (`specjax.models.attention`): the ops agree, and a model selects one.

`dot_product` (jax.nn.dot_product_attention) against `reference` (einsums) on the same inputs:
no cache, a cache with ragged lengths, a token tree with a window of tentative entries, and a
sliding window; then whole models (a Mistral-like one whose first layer is windowed and whose second
is a plain Llama layer) built with each op give the same logits for a prefill, a decode step and a
tree block. Each op-level case is one jitted program. The training-time-test rule
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


def _normal(rng, *shape):
    """Standard normal float32 inputs drawn in numpy (jax.random would compile a program per shape)."""
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = _normal(rng, B, T, N, H)
    k_new = _normal(rng, B, T, K, H)
    v_new = _normal(rng, B, T, K, H)
    k_past = _normal(rng, B, K, S, H)
    v_past = _normal(rng, B, K, H, S)
    return q, k_new, v_new, (k_past, v_past, jnp.asarray([3, 9], jnp.int32))


def _both(q, k_new, v_new, past, visibility, spec=attn.AttentionSpec(scale=H ** -0.5)):
    """(reference, dot_product) of one call (traced: the callers jit every case into one program)."""
    return (attn.reference_attention(q, k_new, v_new, past, visibility, spec),
            attn.dot_product_attention(q, k_new, v_new, past, visibility, spec))


@jax.jit
def _every_visibility(q, k_new, v_new, past):
    """Both ops on every visibility of `test_ops_agree_on_every_visibility`, in one program."""
    lengths = past[2]
    out = {"no_cache": _both(q, k_new, v_new, None, None),
           "plain": _both(q, k_new, v_new, past, None),
           # the causal rule spelled out as a visibility is the same rule
           "explicit": _both(q, k_new, v_new, past, attn.causal_mask(lengths, T, S))}
    # a tree over a window of two tentative entries
    shape = trees.TreeShape.from_branching((2, 1))
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, shape.num_nodes))
    vis = trees.ancestor_mask(parents, jnp.ones((B, shape.num_nodes), bool), shape.max_depth)[:, 1:, 1:]
    tree = TreeBlock(rel_positions_BT=jnp.zeros((B, 2), jnp.int32) + 1, visible_BTW=vis[:, 2:4, :4])
    out["tree"] = _both(q[:, :2], k_new[:, :2], v_new[:, :2], past, attn.tree_attention_mask(tree, lengths, S))
    # sliding windows, with and without a cache; window 0 is no window
    positions = lengths[:, None] + jnp.arange(T)[None]
    out["windowed"] = _both(q, k_new, v_new, past, attn.window_mask(None, positions, lengths, S, 4))
    out["windowed_no_cache"] = _both(q, k_new, v_new, None,
                                     attn.window_mask(None, jnp.broadcast_to(jnp.arange(T), (B, T)), None, None, 2))
    out["window_0"] = _both(q, k_new, v_new, past, attn.window_mask(None, positions, lengths, S, 0))
    return out


def test_ops_agree_on_every_visibility():
    out = jax.device_get(_every_visibility(*_inputs()))
    for name, (ref, dpa) in out.items():
        np.testing.assert_allclose(dpa, ref, atol=ATOL, err_msg=name)
    plain = out["plain"][0]
    np.testing.assert_allclose(out["explicit"][0], plain, atol=ATOL)
    assert np.abs(out["windowed"][0] - plain).max() > 1e-2          # the window removed keys
    np.testing.assert_allclose(out["window_0"][0], plain, atol=ATOL)


@pytest.mark.parametrize("chunk,softcap", [(4, None), (3, 2.0), (1, None)])
def test_causal_chunks_are_the_causal_rule(chunk, softcap):
    """A cache-free causal call longer than ``causal_chunk`` (here 11 tokens in chunks of 4, 3
    and 1, the last chunk short) gives the values and gradients of the one-block computation
    (``causal_chunk=0``), with grouped queries and soft-capping; a call with a cache or another
    visibility never takes the chunked path (the same result with any chunk)."""
    T_ = 11
    one = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap, causal_chunk=0)
    chunked = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap, causal_chunk=chunk)
    not_causal = (jnp.ones((B, T_, 0), bool), jnp.ones((B, T_, T_), bool))

    rng = np.random.default_rng(chunk)
    q, k_new, v_new = _normal(rng, B, T_, N, H) * 2, _normal(rng, B, T_, K, H) * 2, _normal(rng, B, T_, K, H)
    w = _normal(rng, B, T_, N * H)

    # one program for the whole case (op by op, every chunk's shapes compile their own kernels)
    @jax.jit
    def case(q, k_new, v_new, w):
        f = lambda spec: lambda *a: attn.reference_attention(*a, None, None, spec)  # noqa: E731
        grad = lambda spec: jax.grad(lambda *a: jnp.sum(f(spec)(*a) * w), argnums=(0, 1, 2))  # noqa: E731
        full = [attn.reference_attention(q, k_new, v_new, None, not_causal, spec) for spec in (chunked, one)]
        return (f(chunked)(q, k_new, v_new), f(one)(q, k_new, v_new), grad(chunked)(q, k_new, v_new),
                grad(one)(q, k_new, v_new), full)

    got, want, g2, g1, (full_chunked, full_one) = jax.device_get(case(q, k_new, v_new, w))
    np.testing.assert_allclose(got, want, atol=ATOL)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, atol=ATOL)
    assert np.abs(full_chunked - want).max() > 1e-2   # not causal: differs
    np.testing.assert_array_equal(full_chunked, full_one)


def _tt_inputs(seed, blocks):
    """(q, k_new, v_new, k_past, v_past) of a training-time-test call with ``blocks`` past blocks of T."""
    rng = np.random.default_rng(seed)
    return (_normal(rng, B, T, N, H), _normal(rng, B, T, K, H), _normal(rng, B, T, K, H),
            _normal(rng, B, K, blocks * T, H), _normal(rng, B, K, H, blocks * T))


def _values_and_grads(fast, dense, w):
    """(fast(*args), dense(*args), their gradients of sum(out * w) in every input), traced."""
    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2, 3, 4))

    def both(*args):
        return fast(*args), dense(*args), grads(fast)(*args), grads(dense)(*args)
    return both


@pytest.mark.parametrize("blocks,hides_first,softcap", [(1, False, None), (2, True, None), (4, False, 3.0),
                                                       (3, True, 3.0)])
def test_training_time_test_equals_its_dense_masks(blocks, hides_first, softcap):
    """`training_time_test_attention` (a causal block and diagonal entries) == `reference` under
    `TrainingTimeTest.dense` (grouped queries, soft-capping, the first slot hidden or not), and so
    do the gradients with respect to every input; the dense masks are not the plain causal rule
    (the outputs differ from causal attention over the same keys)."""
    spec = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap)
    tt = attn.TrainingTimeTest(hides_first=hides_first)

    def fast(q, kn, vn, kp, vp):
        return attn.attention(q, kn, vn, (kp, vp, None), tt, spec=spec)

    def dense(q, kn, vn, kp, vp):
        return attn.reference_attention(q, kn, vn, (kp, vp, None), tt.dense(B, T, blocks), spec)

    q, k_new, v_new, k_past, v_past = args = _tt_inputs(blocks, blocks)
    w = _normal(np.random.default_rng(9), B, T, N * H)

    @jax.jit          # one program for the case
    def case(w, *args):
        causal = attn.reference_attention(*args[:3], (args[3], args[4], jnp.full((B,), blocks * T)), None, spec)
        return _values_and_grads(fast, dense, w)(*args), causal

    (got, want, g_fast, g_dense), causal = jax.device_get(case(w, *args))
    np.testing.assert_allclose(got, want, atol=ATOL)
    for a, b in zip(g_fast, g_dense):
        np.testing.assert_allclose(a, b, atol=ATOL)
    assert np.abs(causal - got).max() > 1e-2
    with pytest.raises(ValueError, match="whole blocks"):
        attn.attention(q, k_new, v_new, (k_past[:, :, 1:], v_past[..., 1:], None), tt, spec=spec)


@pytest.mark.parametrize("blocks,hides_first", [(1, False), (2, True), (3, False)])
def test_training_time_test_at_origins_is_the_full_rule_gathered(blocks, hides_first):
    """With ``origins_BQ`` (queries at Q < T origins, padded by repeats) the op gives row q of the
    full computation at origin ``origins_BQ[b, q]`` (the origins' own queries, diagonal entries
    and new keys gathered from the full inputs; the step-1 block whole), equals `reference`
    under `TrainingTimeTest.dense` with the origins, and so do its gradients; a past that is not
    T step-1 entries plus whole blocks of Q is refused."""
    spec = attn.AttentionSpec(scale=H ** -0.5, softcap=None)
    rng = np.random.default_rng(blocks)
    Q = T // 2
    o_BQ = np.stack([np.sort(rng.choice(T, Q, replace=False)) for _ in range(B)]).astype(np.int32)
    o_BQ[0, -1] = o_BQ[0, -2]                  # a padding origin repeats one
    o = jnp.asarray(o_BQ)
    tt = attn.TrainingTimeTest(hides_first=hides_first, origins_BQ=o, width=T)

    def gathered(q, k_new, v_new, k_past, v_past):
        """The origins' queries, new keys and diagonal entries, gathered from the full inputs."""
        rows = lambda x: jnp.take_along_axis(x, o.reshape(B, Q, 1, 1), axis=1)  # noqa: E731  [B, T, ...] -> [B, Q, ...]
        diag_k = [jnp.transpose(rows(jnp.transpose(k_past[:, :, i * T:(i + 1) * T], (0, 2, 1, 3))), (0, 2, 1, 3))
                  for i in range(1, blocks)]
        diag_v = [jnp.transpose(rows(jnp.transpose(v_past[..., i * T:(i + 1) * T], (0, 3, 1, 2))), (0, 2, 3, 1))
                  for i in range(1, blocks)]
        kp = jnp.concatenate([k_past[:, :, :T]] + diag_k, axis=2)
        vp = jnp.concatenate([v_past[..., :T]] + diag_v, axis=3)
        return rows(q), rows(k_new), rows(v_new), kp, vp

    def fast(q, kn, vn, kp, vp):
        return attn.attention(q, kn, vn, (kp, vp, None), tt, spec=spec)

    def dense(q, kn, vn, kp, vp):
        return attn.reference_attention(q, kn, vn, (kp, vp, None), tt.dense(B, T, blocks, Q), spec)

    w = _normal(np.random.default_rng(9), B, Q, N * H)

    @jax.jit          # one program for the case
    def case(w, q, k_new, v_new, k_past, v_past):
        full = attn.attention(q, k_new, v_new, (k_past, v_past, None),
                              attn.TrainingTimeTest(hides_first=hides_first), spec=spec)
        args = gathered(q, k_new, v_new, k_past, v_past)
        return full, args, _values_and_grads(fast, dense, w)(*args)

    full, args, (got, from_dense, g_fast, g_dense) = jax.device_get(case(w, *_tt_inputs(10 + blocks, blocks)))
    want = np.take_along_axis(full, o_BQ[..., None], axis=1)
    np.testing.assert_allclose(got, want, atol=ATOL)
    np.testing.assert_allclose(got, from_dense, atol=ATOL)
    for a, b in zip(g_fast, g_dense):
        np.testing.assert_allclose(a, b, atol=ATOL)
    kp, vp = jnp.asarray(args[3]), jnp.asarray(args[4])
    with pytest.raises(ValueError, match="whole blocks of Q"):
        attn.attention(*(jnp.asarray(x) for x in args[:3]), (kp[:, :, 1:], vp[..., 1:], None), tt, spec=spec)
    with pytest.raises(ValueError, match="go together"):
        attn.TrainingTimeTest(origins_BQ=o)


def test_softcap_is_reference_only_and_named():
    q, k_new, v_new, past = _inputs(1)
    spec = attn.AttentionSpec(scale=0.5, softcap=2.0)
    capped, uncapped = jax.jit(lambda *a: [attn.reference_attention(*a, None, s) for s in (
        spec, attn.AttentionSpec(scale=0.5))])(q, k_new, v_new, past)
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
        # one program: the op is called while the model's apply is traced
        jax.jit(lambda k: model.apply(model.init_params(k), jnp.zeros((1, 3), jnp.int32), None))(jax.random.key(0))
        assert calls and set(calls) == {(1, 3, 4, 8)}      # traced once per layer body
    finally:
        attn.ATTENTION_OPS.pop("test_counting")


def test_models_agree_across_ops():
    """A windowed Mistral-like model (a sliding window in its first layer, none in its second: the
    plain Llama layer's causal rule, the same call as every layer of a model without windows)
    built with each op: the same logits for a ragged prefill, a decode step and a tree block.
    Unrolled layers: under `lax.scan` two layer variants stack their visibilities, the causal one
    made explicit, so the second layer would not get the plain (None) visibility a Llama's layers get."""
    from _ops_common import assert_models_agree
    assert_models_agree(ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    head_dim=8, ffn_size=48, sliding_window=3, window_layers=(True, False),
                                    arch="mistral", scan_layers=False), ("reference", "dot_product"))
