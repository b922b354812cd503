"""`specjax.kernels.decode_attention` (decode_attention.cc) against the model's reference attention
(`specjax.models.llama.attention`): random GQA shapes, ragged lengths (0 and full capacity
included), blocks of 1..16 tokens, garbage past each row's length, NaN propagation, a model
forward with `ModelConfig.cpu_attention`, and the fallback where the kernel cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels, models
from specjax.models import llama

ATOL = 2e-5       # float32: the kernel sums in another order than XLA's einsum and softmax


def test_the_kernel_is_built():
    assert kernels.built(), "specjax/kernels/_panel_matmul*.so is missing: pip install did not build the kernels"
    assert kernels.attention_built(), "the kernel library lacks decode_attention.cc (rebuild: pip install -e .)"


def _operands(key, B, T, N, K, H, S, lengths):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k_new = jax.random.normal(ks[1], (B, T, K, H))
    v_new = jax.random.normal(ks[2], (B, T, K, H))
    k_c = jax.random.normal(ks[3], (B, K, S, H))
    v_c = jax.random.normal(ks[4], (B, K, H, S))
    # slots past each row's length hold garbage the kernel must never read
    past_end = jnp.arange(S)[None, :] >= jnp.asarray(lengths)[:, None]
    k_c = jnp.where(past_end[:, None, :, None], 1e30, k_c)
    v_c = jnp.where(past_end[:, None, None, :], jnp.nan, v_c)
    return q, k_new, v_new, k_c, v_c, jnp.asarray(lengths, jnp.int32)


def _kernel(q, k_new, v_new, k_c, v_c, lengths):
    """The kernel alone: the other backends' branch (traced, never run on the CPU) gives zeros."""
    B, T, N, H = q.shape
    return kernels.decode_attention(q, k_new, v_new, k_c, v_c, lengths,
                                    reference=lambda: jnp.zeros((B, T, N * H), jnp.float32), min_rows=1)


def _reference(q, k_new, v_new, k_c, v_c, lengths):
    S = k_c.shape[2]
    visible = (jnp.arange(S)[None, :] < lengths[:, None])
    # the reference reads every slot: zero what is past the lengths so 0 x garbage stays 0
    k_c = jnp.where(visible[:, None, :, None], k_c, 0.0)
    v_c = jnp.where(visible[:, None, None, :], v_c, 0.0)
    return llama.attention(q, k_new, v_new, (k_c, v_c, lengths))


@pytest.mark.parametrize("B, T, N, K, H, S", [(3, 1, 9, 3, 64, 40), (2, 4, 4, 2, 16, 33), (2, 16, 6, 1, 8, 17),
                                              (1, 3, 8, 8, 24, 5)])
def test_matches_the_reference(B, T, N, K, H, S):
    rng = np.random.default_rng(B * 100 + T)
    lengths = rng.integers(0, S + 1, B)
    lengths[0] = S if B > 1 else lengths[0]
    lengths[-1] = 0
    ops = _operands(jax.random.key(T), B, T, N, K, H, S, lengths)
    got = jax.jit(_kernel)(*ops)
    want = _reference(*ops)
    assert got.shape == (B, T, N * H) and bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=1e-5)


def test_a_query_does_not_depend_on_later_tokens_or_other_rows():
    B, T, N, K, H, S = 3, 5, 6, 2, 32, 24
    ops = _operands(jax.random.key(0), B, T, N, K, H, S, [7, 0, 24])
    f = jax.jit(_kernel)
    full = np.asarray(f(*ops))
    q, k_new, v_new, k_c, v_c, L = ops
    for t in range(1, T + 1):      # the first t tokens of the block alone: bit for bit the same
        part = np.asarray(f(q[:, :t], k_new[:, :t], v_new[:, :t], k_c, v_c, L))
        assert np.array_equal(part, full[:, :t])
    one = np.asarray(f(*(x[1:2] for x in ops)))
    assert np.array_equal(one, full[1:2])


def test_nan_score_gives_nan_and_nan_values_past_length_do_not():
    B, T, N, K, H, S = 2, 2, 4, 2, 16, 12
    q, k_new, v_new, k_c, v_c, L = _operands(jax.random.key(1), B, T, N, K, H, S, [5, 12])
    f = jax.jit(_kernel)
    assert bool(jnp.isfinite(f(q, k_new, v_new, k_c, v_c, L)).all())      # NaN values past length 5: unread
    out = np.asarray(f(q.at[0, 1].set(jnp.nan), k_new, v_new, k_c, v_c, L))
    assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all() and np.isfinite(out[1]).all()
    out = np.asarray(f(q, k_new, v_new, k_c.at[1, 0, 3].set(jnp.nan), v_c, L))
    G = N // K
    assert np.isnan(out[1, :, :G * H]).all() and np.isfinite(out[1, :, G * H:]).all() and np.isfinite(out[0]).all()


def test_falls_back_where_it_cannot_run():
    B, N, K, H, S = 1, 2, 1, 8, 4
    too_long = _operands(jax.random.key(2), B, kernels.ATTENTION_MAX_TOKENS + 1, N, K, H, S, [3])
    marker = jnp.full((1,), 7.0)
    assert kernels.decode_attention(*too_long, reference=lambda: marker, min_rows=1) is marker
    few = _operands(jax.random.key(2), B, 2, N, K, H, S, [3])
    assert kernels.decode_attention(*few, reference=lambda: marker) is marker          # 1 < ATTENTION_MIN_ROWS
    short = _operands(jax.random.key(2), B, 2, N, K, H, S, [3])
    bf16 = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in short]
    assert kernels.decode_attention(*bf16, reference=lambda: marker, min_rows=1) is marker


def test_model_forward_with_cpu_attention():
    """A packed 2-layer model with and without the kernel: prefill, one-token steps and a
    4-token verification block give the same logits within float tolerance."""
    cfg = models.ModelConfig(vocab_size=97, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                             ffn_size=64, max_position=256, scan_layers=False, fuse_projections=True,
                             linear_op="panels")
    ref, ker = models.Llama(cfg), models.Llama(cfg.replace(cpu_attention=True))
    params = ref.init_params(jax.random.key(0))
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)
    B = kernels.ATTENTION_MIN_ROWS
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 97, (B, 8)), jnp.int32)
    n_valid = jnp.asarray(rng.integers(1, 9, B), jnp.int32)
    step_tokens, block_tokens = (jnp.asarray(rng.integers(0, 97, (B, t)), jnp.int32) for t in (1, 4))
    outs = []
    for model in (ref, ker):
        cache = model.init_cache(B, 32)
        logits0, cache = jax.jit(model.apply)(params, prompt, cache, n_valid)
        step, cache = jax.jit(model.apply)(params, step_tokens, cache)
        block, cache = jax.jit(model.apply)(params, block_tokens, cache)
        outs.append([np.asarray(x) for x in (logits0, step, block)])
        hlo = jax.jit(model.apply).lower(params, step_tokens, cache).compile().as_text()
        assert (kernels.ATTENTION_TARGET in hlo) == (model is ker)
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-4)
