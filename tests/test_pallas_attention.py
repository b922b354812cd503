"""The Pallas attention kernel (`specjax.kernels.cache_attention`, attention op ``pallas``).

On CPU the kernel runs in Pallas interpret mode: the same kernel body, grid and block specs as
on a TPU, executed by XLA. Checked against the reference op's write-then-attend form on the same
written cache: a decode step, a k-token block, a token tree, a sliding window and soft-capping,
grouped queries, ragged rows, a capacity of several slot blocks and one that is no multiple of
the block. Tolerances: float32 2e-5 absolute on values of order 1 (the online softmax sums in
another order); bfloat16 results within 2 bf16 ulps of the reference's (3e-2 absolute).

Then: blocks past a row's live length are not read (NaN there changes nothing); a row of a
k-token block is bitwise the same row computed as a one-token step in a call of the block's
shape, in bfloat16 (what the accelerator profiles' exact greedy speculation needs); whole
models with the op give the reference op's logits for a prefill, a step and a tree; and the
kernel compiles for a TPU topology (Mosaic, deviceless) with the kernel as a TPU custom call.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import aot, kernels, sharding, trees
from specjax.models import ModelConfig, TreeBlock
from specjax.models import attention as attn

B, N, K, H = 2, 4, 2, 8


# The inputs are made in numpy and every helper that runs JAX ops is jitted: op by op, each of
# the many small ops of the kernel's wrapper and of the reference compiled on its own per shape.
def _normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)


def _cache(S, dtype, seed=0, h=H):
    return (_normal((seed, 0), (B, K, S, h), dtype), _normal((seed, 1), (B, K, h, S), dtype),
            _normal((seed, 2), (B, 1, N, h), dtype))


def _queries(T, dtype, seed=1, h=H):
    return _normal((seed, 3), (B, T, N, h), dtype)


@functools.partial(jax.jit, static_argnames="spec")
def _reference_jit(q, k, v, visible, spec):
    return attn.reference_attention(q, None, None, (k, v, None), (visible, None), spec).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_slots"))
def _kernel_jit(q, k, v, visible, scale, softcap, block_slots):
    return kernels.cache_attention(q, k, v, visible, scale=scale, softcap=softcap,
                                   block_slots=block_slots).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("spec", "block_slots"))
def _both_jit(q, k, v, visible, spec, block_slots):
    return (_reference_jit(q, k, v, visible, spec),
            _kernel_jit(q, k, v, visible, spec.scale, spec.softcap, block_slots))


def _reference(q, k, v, visible, spec):
    return np.asarray(_reference_jit(q, k, v, visible, spec))


def _reference_and_kernel(q, k, v, visible, spec, block_slots):
    """(the reference op's result, the kernel's), float32, computed in one program."""
    return tuple(np.asarray(x) for x in _both_jit(q, k, v, visible, spec, block_slots))


def _kernel(q, k, v, visible, spec, block_slots=512):
    return np.asarray(_kernel_jit(q, k, v, visible, spec.scale, spec.softcap, block_slots))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _chain_visibility(lengths, T, S, window=0):
    """What a T-token block written at ``lengths`` sees (causal; a sliding window if > 0)."""
    positions = lengths[:, None] + jnp.arange(T)[None]
    rule = attn.window_mask(None, positions, lengths, S, window) if window else None
    return attn.written_visibility(rule, lengths, lengths, T, S)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _tree_visibility_jit(lengths, S, branching):
    shape = trees.TreeShape.from_branching(branching)
    T = shape.num_nodes + 1
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, shape.num_nodes))
    vis = trees.ancestor_mask(parents, jnp.ones((B, shape.num_nodes), bool), shape.max_depth)
    rel = jnp.broadcast_to(jnp.asarray((0,) + shape.depths, jnp.int32), (B, T))
    rule = attn.tree_attention_mask(TreeBlock(rel_positions_BT=rel, visible_BTW=vis), lengths, S)
    return attn.written_visibility(rule, lengths, lengths, T, S)


def _tree_visibility(lengths, S, branching=(2, 2)):
    return _tree_visibility_jit(lengths, S, branching), trees.TreeShape.from_branching(branching).num_nodes + 1


CASES = {   # name: (capacity, lengths, tokens, window, softcap, block_slots)
    "step": (64, (5, 40), 1, 0, None, 512),
    "block": (64, (5, 40), 5, 0, None, 512),
    "window": (64, (20, 40), 5, 7, None, 512),
    "softcap": (64, (5, 40), 5, 0, 2.5, 512),
    "multi_block": (640, (100, 500), 4, 0, None, 128),
    "ragged_capacity": (200, (3, 150), 4, 0, 5.0, 128),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_the_reference_op(case, dtype):
    S, lengths, T, window, softcap, block = CASES[case]
    lengths = jnp.asarray(lengths, jnp.int32)
    k, v, _ = _cache(S, dtype)
    q = _queries(T, dtype)
    spec = attn.AttentionSpec(scale=H ** -0.5, softcap=softcap)
    visible = _chain_visibility(lengths, T, S, window)
    ref, got = _reference_and_kernel(q, k, v, visible, spec, block)
    np.testing.assert_allclose(got, ref, atol=2e-5 if dtype == jnp.float32 else 3e-2)
    if window:             # the window hid keys: not the causal result
        assert np.abs(_reference(q, k, v, _chain_visibility(lengths, T, S), spec) - ref).max() > 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_equals_the_reference_op_on_a_token_tree(dtype):
    S = 256
    lengths = jnp.asarray([17, 130], jnp.int32)
    visible, T = _tree_visibility(lengths, S)
    k, v, _ = _cache(S, dtype, seed=3)
    q = _queries(T, dtype, seed=4)
    spec = attn.AttentionSpec(scale=H ** -0.5)
    ref, got = _reference_and_kernel(q, k, v, visible, spec, 128)
    np.testing.assert_allclose(got, ref, atol=2e-5 if dtype == jnp.float32 else 3e-2)
    # siblings do not see each other: the tree differs from a causal chain over the same slots
    assert np.abs(_reference(q, k, v, _chain_visibility(lengths, T, S), spec) - ref).max() > 1e-2


def test_lane_wide_heads_read_keys_slot_major():
    """A head width of 128 (a multiple of the TPU's lanes: keys read as [slots, H] blocks; the
    other tests' width 8 reads them as [H, slots]): the reference op's result."""
    S, T, h = 256, 3, 128
    lengths = jnp.asarray([30, 140], jnp.int32)
    k, v, _ = _cache(S, jnp.float32, seed=7, h=h)
    q = _queries(T, jnp.float32, seed=8, h=h)
    spec = attn.AttentionSpec(scale=h ** -0.5, softcap=4.0)
    visible = _chain_visibility(lengths, T, S)
    ref, got = _reference_and_kernel(q, k, v, visible, spec, 128)
    np.testing.assert_allclose(got, ref, atol=2e-5)


def test_blocks_past_the_live_length_are_not_read():
    """NaN in every slot block wholly past each row's last visible slot: the kernel's output is
    finite and equal to the clean cache's (the reference op, which reads every slot, is NaN)."""
    S, T, block = 512, 3, 128
    lengths = jnp.asarray([10, 200], jnp.int32)
    k, v, _ = _cache(S, jnp.float32)
    visible = _chain_visibility(lengths, T, S)
    live = np.asarray(lengths) + T
    first_dead = -(-live // block) * block                  # the first slot of a block past the live one
    dead_BS = np.arange(S)[None, :] >= first_dead[:, None]
    k_bad = jnp.where(dead_BS[:, None, :, None], jnp.nan, k)
    v_bad = jnp.where(dead_BS[:, None, None, :], jnp.nan, v)
    q = _queries(T, jnp.float32)
    spec = attn.AttentionSpec(scale=H ** -0.5)
    clean = _kernel(q, k, v, visible, spec, block)
    bad = _kernel(q, k_bad, v_bad, visible, spec, block)
    assert np.isfinite(bad).all()
    np.testing.assert_array_equal(bad, clean)
    assert np.isnan(_reference(q, k_bad, v_bad, visible, spec)).any()


def test_a_block_row_is_bitwise_the_step_in_bfloat16():
    """Row t of a T-token chain block == a one-token step for that token (written at slot
    lengths + t, seeing the same slots), computed in a call of the block's shape whose other
    rows are padding: bitwise, in bfloat16."""
    S, T = 384, 4
    dtype = jnp.bfloat16
    lengths = jnp.asarray([37, 250], jnp.int32)
    k, v, _ = _cache(S, dtype, seed=5)
    q = _queries(T, dtype, seed=6)
    spec = attn.AttentionSpec(scale=H ** -0.5)
    block = _kernel(q, k, v, _chain_visibility(lengths, T, S), spec, 128)
    for t in range(T):
        q_step = jnp.concatenate([q[:, t:t + 1], jnp.zeros((B, T - 1, N, H), dtype)], axis=1)
        step_visible = _chain_visibility(lengths + t, 1, S)                   # [B, 1, S]
        pad_visible = jnp.zeros((B, T - 1, S), bool).at[:, :, 0].set(True)
        step = _kernel(q_step, k, v, jnp.concatenate([step_visible, pad_visible], axis=1), spec, 128)
        np.testing.assert_array_equal(step[:, 0], block[:, t])


def test_the_op_asks_for_capacities_it_reads_in_place():
    """`specjax.build` pads prompts (and so rounds capacities) to the op's slot multiple: the
    kernel's 128-slot blocks for 'pallas' (another capacity is padded, a copy), any for the rest."""
    assert attn.slot_multiple("pallas") == 128 and attn.slot_multiple("reference") == 1
    with pytest.raises(ValueError, match="unknown attention op 'nope'"):
        attn.slot_multiple("nope")


def test_bad_shapes_are_named():
    k, v, _ = _cache(128, jnp.float32)
    q = _normal((0, 4), (B, 1, 3, H), jnp.float32)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of the cache's 2 KV heads"):
        kernels.cache_attention(q, k, v, jnp.ones((B, 1, 128), bool), scale=1.0)
    with pytest.raises(ValueError, match=r"values .* are not \[B, K, S, H\] and \[B, K, H, S\]"):
        kernels.cache_attention(_queries(1, jnp.float32), k, jnp.swapaxes(v, 2, 3), jnp.ones((B, 1, 128), bool),
                                scale=1.0)


@pytest.mark.parametrize("family", ["llama", "windowed_softcapped"])
def test_models_with_the_op_give_the_reference_logits(family):
    """Write-then-attend models (the accelerator profiles' layout) with attention_op 'pallas' and
    'reference': the same logits for a ragged prefill, a decode step and a token-tree block.
    Plain Llama, and one model with both the op's options: a sliding window of 3 in its first
    layer (the second plain causal) and attention soft-capping in both."""
    from _ops_common import assert_models_agree
    extra = {"windowed_softcapped": dict(sliding_window=3, window_layers=(True, False), arch="mistral",
                                         attn_softcap=3.0)}.get(family, {})
    assert_models_agree(ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    head_dim=8, ffn_size=48, scan_layers=False, write_then_attend=True, **extra),
                        ("reference", "pallas"))


_MESH_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from specjax import decoding, drafters, models, sampling, sharding
sys.path.insert(0, "tests")
from _multiprocess_common import tiny_pair
assert jax.device_count() == 4, jax.devices()
target, tp, small, sp = tiny_pair()
written = target.config.replace(write_then_attend=True)
rng = np.random.default_rng(0)
prompts = [list(rng.integers(0, 96, n)) for n in (3, 9, 5, 12)]
gen = decoding.GenerationConfig(max_new_tokens=12, gamma=3)
batch = decoding.make_batch(prompts, gen, jax.random.key(7))
greedy = sampling.SamplingConfig.make(0.0)

# The target's greedy continuations: its cache-free forward (default layout and attention) over
# each sequence so far, argmax, 12 times, in one program.
@jax.jit
def target_greedy(params, toks, lens):
    rows = jnp.arange(toks.shape[0])
    def add_one(_, carry):
        toks, lens = carry
        logits = target.apply(params, toks, None)[0][rows, lens - 1]
        return toks.at[rows, lens].set(jnp.argmax(logits, -1).astype(toks.dtype)), lens + 1
    return jax.lax.fori_loop(0, 12, add_one, (toks, lens))[0]

lens = np.asarray([len(p) for p in prompts])
padded = np.zeros((len(prompts), lens.max() + 12), np.int32)
for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
want = [row[n:n + 12] for row, n in zip(np.asarray(target_greedy(tp, jnp.asarray(padded), jnp.asarray(lens))).tolist(),
                                        lens)]
out = {}
for shape in (None, (2, 2)):
    model = models.Llama(written.replace(attention_op="pallas"))
    draft = drafters.ModelDrafter(models.Llama(small.config.replace(write_then_attend=True, attention_op="pallas")))
    params = decoding.EngineParams(target=tp, draft=sp)
    eng = decoding.Engine(model, draft, gen, mesh=None if shape is None else sharding.make_mesh(*shape))
    b = batch
    if shape is not None:
        params, b = eng.place(params, batch)
    r = eng.run(params, greedy, b)
    out[shape] = (r.generated(), np.asarray(r.metrics.accepted_B))
for shape, (tokens, accepted) in out.items():
    assert tokens == want, (shape, tokens, want)
np.testing.assert_array_equal(out[(2, 2)][1], out[None][1])
assert out[None][1].sum() > 0
print("OK")
"""


def test_speculative_greedy_with_the_op_on_a_mesh():
    """The engine with attention_op 'pallas' (write-then-attend, a draft model using it too) on
    one device and on a 2 x 2 mesh of simulated CPU devices (rows over data, KV heads over
    model: the kernel split by `shard_map` under the engine's mesh): greedy tokens equal to the
    target's own greedy continuations (its cache-free forward with the default attention, argmax:
    the tiny target's greedy margins are far above rounding, tests/_multiprocess_common.py) and
    the same accepted drafts on the mesh as on one device."""
    from _bench_run import run_script_on_devices
    assert "OK" in run_script_on_devices(_MESH_SCRIPT, devices=4)


def test_the_kernel_compiles_for_a_tpu_topology():
    """Lowered for 4 TPU v5e chips without a TPU: the kernel is a Mosaic custom call (not the
    interpreter's loops), compiled with Llama-3.1-8B's attention shapes (32 query heads over 8
    KV heads of 128, bf16) for a 4-token block over a 2,048-slot cache, traced under a mesh
    of one row per chip and under one of 2 rows x 2 KV-head groups."""
    _, devices = aot.topology_devices("v5e:2x2")
    Bt, T, S = 4, 4, 2048

    def f(q, k, v, visible):
        return kernels.cache_attention(q, k, v, visible, scale=128 ** -0.5)

    for data, model in ((4, 1), (2, 2)):
        mesh = sharding.make_mesh(data, model, devices)
        rows, heads = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", "model"))
        shapes = [jax.ShapeDtypeStruct((Bt, T, 32, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None, "model"))),
                  jax.ShapeDtypeStruct((Bt, 8, S, 128), jnp.bfloat16, sharding=heads),
                  jax.ShapeDtypeStruct((Bt, 8, 128, S), jnp.bfloat16, sharding=heads),
                  jax.ShapeDtypeStruct((Bt, T, S), jnp.bool_, sharding=rows)]
        with aot.without_persistent_cache(), jax.set_mesh(mesh):
            lowered = jax.jit(f).lower(*shapes)
            compiled = lowered.compile()
        assert 'custom_call_target="tpu_custom_call"' in compiled.as_text(), (data, model)
        assert compiled.memory_analysis() is not None
