"""Step = block, bitwise, in bfloat16: a verification block's row t computes exactly what a
one-token decode step computes from the same cache, in the accelerator profiles' layout
(configs/generate_gpu.py: unrolled per-layer weights and caches, fused projections, bfloat16,
XLA's matmuls, the einsum attention op; configs/generate_tpu.py: the same with separate
projections), on this CPU.

For every family preset (tiny random models of each family's own pieces: q/k norms, biases,
sliding windows, soft-caps, sandwich norms, local RoPE, routed experts), at batch 1 and at
batch 2 with rows at different lengths:

* chains: a k-token block over a filled cache against k one-token steps, logits compared
  with ``==`` (no tolerance), and the caches' committed entries after both paths;
* trees: a tree block (root + nodes, ancestor mask) against one-token steps along a
  root-to-leaf path, the path's rows compared with ``==``. A node's ancestors sit at other slots
  than the steps find them at; each query sums its last keys apart, in their order
  (`AttentionSpec.ordered_tail`). The attention-level tests and a float32 model check show it
  (bfloat16 outputs of tiny models hide most differences), with a control that fails without it.

A step scores the engine's one block shape (`GenerationConfig.block_tokens`, as the profiles
set it): its token, then padding, in a pass as wide as the verification block. At batch 1 a
pass of one row is a matrix-vector product on this CPU and rounds differently from the rows of
a matrix product: without the padding, steps and blocks differ in the last bit.

This is what makes greedy speculative decoding reproduce target-only greedy decoding token for
token in bfloat16. The stacked ``lax.scan`` layout (configs/generate_gpu_scan.py) does not have
it on this CPU: its blocks and steps differ in the last bit of some logits.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models, trees
from specjax.models import TreeBlock
from specjax.models.hf_loader import config_from_hf

from _bench_run import default_xla_env
from _hf_tiny import FAMILY_KINDS, family_config

KINDS = ("llama", "qwen2") + FAMILY_KINDS
CAPACITY = 256
PROFILE = dict(dtype="bfloat16", scan_layers=False, fuse_projections=True, linear_op="xla",
               cpu_attention=False, attention_op="reference", write_then_attend=True, ordered_tail=True)


def _config(kind: str, **layout):
    if kind == "llama":
        cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
               "tie_word_embeddings": False}
    elif kind == "qwen2":
        cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
               "tie_word_embeddings": True}
    else:
        cfg = family_config(kind).to_dict()
    return config_from_hf(cfg).replace(**{**PROFILE, **layout})


def _params(model, seed: int, matrix_scale: float = 1.0) -> dict:
    """Random parameters in the model's layout, drawn in NumPy (nothing to compile: drawn with
    jax.random, op by op, they were a compiled program per operation and shape, and in the
    float32 subprocess below as long to compile as the model): normal(0.02) weights and biases,
    the weight matrices times ``matrix_scale``, unit norms (`llama.param_specs`' canonical form,
    then `prepare_params`)."""
    from specjax.models import llama as llama_lib
    rng = np.random.default_rng(seed)

    def draw(specs: dict, stacked: int) -> dict:
        out = {}
        for name, spec in specs.items():
            if isinstance(spec, dict):
                out[name] = draw(spec, 1)         # the layers: a leading layer axis
                continue
            shape, _, kind = spec
            if kind in ("ones", "zeros"):
                x = np.full(shape, 1.0 if kind == "ones" else 0.0, np.float32)
            else:
                scale = matrix_scale if len(shape) - stacked > 1 else 1.0
                x = 0.02 * scale * rng.standard_normal(shape, np.float32)
            out[name] = x.astype(model.config.jnp_dtype)
        return out
    return model.prepare_params(draw(llama_lib.param_specs(model.config), 0))


def _model(kind: str, **layout):
    model = models.Llama(_config(kind, **layout))
    # weights well above the init's 0.02, so that bf16 rounding has something to round
    return model, _params(model, len(kind), matrix_scale=8.0)


def _prefilled(model, params, B: int):
    """A cache holding 181 and 122 committed entries: contexts long enough for the order of the
    attention sums to matter (with a block's keys appended after the cache instead of written
    into it, these differ in the last bit).

    Its committed K and V are random (standard normal, numpy seed 7, in the cache's dtype; zeros
    past each row's length, as a fresh cache), not a prefill's: the block and the steps read the
    same cache, so what they must agree on does not depend on where its entries came from, and
    no prefill program is compiled (it was a third of each case's compilation; a prefill's
    write-then-attend is compared in `test_write_then_attend_computes_the_same_attention`)."""
    del params
    rng = np.random.default_rng(7)
    lengths = np.array([181, 122][:B], np.int32)
    cache = model.init_cache(B, CAPACITY)

    def fill(bufs, slot_axis):
        out = []
        for buf in bufs:
            x = rng.standard_normal(buf.shape, np.float32)
            slots = np.arange(CAPACITY).reshape([-1 if a == slot_axis else 1 for a in range(x.ndim)])
            x = np.where(slots < lengths.reshape([-1] + [1] * (x.ndim - 1)), x, 0.0)
            out.append(jnp.asarray(x.astype(buf.dtype)))
        return tuple(out)

    # k [B, K, S, H], v [B, K, H, S] per layer (the unrolled layout of PROFILE)
    return cache.replace(k=fill(cache.k, 2), v=fill(cache.v, 3), lengths_B=jnp.asarray(lengths))


def _steps(apply, params, tokens_BT, cache, width: int):
    """One-token steps as the engine runs them with a padded block: each a pass of ``width``
    tokens (the token repeated), row 0 kept, the cache cut back to one new entry. (Inputs built
    and outputs sliced on the host: only ``apply`` is compiled.)"""
    tokens_BT = np.asarray(tokens_BT)
    out = []
    for t in range(tokens_BT.shape[1]):
        block = jnp.asarray(np.repeat(tokens_BT[:, t:t + 1], width, axis=1))
        before = np.asarray(cache.lengths_B)
        logits, cache = apply(params, block, cache)
        cache = cache.rollback(before + 1)
        out.append(np.asarray(logits)[:, :1])
    return np.concatenate(out, axis=1), cache


def _committed(cache, lengths):
    """Each row's committed K and V entries (slots below its length), every layer (sliced on the
    host)."""
    out = []
    for k, v in zip(cache.k, cache.v):
        k, v = np.asarray(k), np.asarray(v)
        for b, n in enumerate(np.asarray(lengths)):
            out += [k[b, :, :n], v[b, :, :, :n]]
    return out


# batch 1 for every family (a one-row step is the case padding exists for); batch 2 (rows at
# different lengths, a scatter write) for the families whose pieces differ most
CASES = [(kind, 1) for kind in KINDS] + [(kind, 2) for kind in ("llama", "gemma2", "mixtral")]


# 5 nodes under the root: nodes 0 and 1 its children, 1 -> 2 -> 3 -> 4; the path root, 1, 2, 3, 4
PARENTS = (-1, -1, 1, 2, 3)      # parent index of node i among the nodes (-1: the root)
# The engine's one block shape: the chain block and the tree block are both this wide, so every
# step (a pass of this width), the chain block and the tree's steps are one compiled program and
# a case compiles two (that one and the tree block's).
WIDTH = len(PARENTS) + 1


@pytest.mark.parametrize("kind,B", CASES)
def test_block_equals_steps(kind, B):
    model, params = _model(kind)
    cache = _prefilled(model, params, B)
    apply = jax.jit(model.apply)
    _chain(model, params, cache, kind, apply)
    _tree(model, params, cache, kind, apply)


@pytest.mark.parametrize("B", [1, 2])
def test_block_equals_steps_with_separate_projections(B):
    """The TPU profile's layout: q, k, v, gate and up as separate matmuls."""
    model, params = _model("llama", fuse_projections=False)
    cache = _prefilled(model, params, B)
    apply = jax.jit(model.apply)
    _chain(model, params, cache, "llama", apply)
    _tree(model, params, cache, "llama", apply)


def _tokens(seed: int, shape, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _chain(model, params, cache, kind, apply):
    B = cache.batch_size
    block = _tokens(3, (B, WIDTH), model.vocab_size)
    logits_block, cache_block = apply(params, jnp.asarray(block), cache)
    logits_block = np.asarray(logits_block)
    logits_steps, cache_steps = _steps(apply, params, block, cache, width=block.shape[1])
    assert np.array_equal(logits_block, logits_steps), \
        f"{kind}: {int(np.sum(logits_block != logits_steps))} of {logits_steps.size} logits differ"
    for a, b in zip(_committed(cache_block, cache_block.lengths_B), _committed(cache_steps, cache_block.lengths_B)):
        assert np.array_equal(a, b)


@functools.lru_cache(maxsize=None)
def _tree_block(B: int) -> TreeBlock:
    """The tree block of PARENTS for B rows (`trees.ancestor_mask`), built once per batch size."""
    N = len(PARENTS)
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (B, N))
    depth = [0] * N
    for i, p in enumerate(PARENTS):
        depth[i] = 1 if p < 0 else depth[p] + 1
    visible = trees.ancestor_mask(parents, jnp.ones((B, N), bool), max(depth))
    rel = jnp.broadcast_to(jnp.asarray([0] + depth, jnp.int32), (B, N + 1))
    return TreeBlock(rel_positions_BT=rel, visible_BTW=visible)


def _tree(model, params, cache, kind, apply=None):
    apply = apply or jax.jit(model.apply)
    B = cache.batch_size
    N = len(PARENTS)
    nodes = _tokens(5, (B, N), model.vocab_size)
    root = _tokens(6, (B, 1), model.vocab_size)
    logits_tree, _ = apply(params, jnp.asarray(np.concatenate([root, nodes], axis=1)), cache, tree=_tree_block(B))
    path = [0, 2, 3, 4, 5]           # block rows of the root and nodes 1-4 (node 0 is a sibling branch)
    tokens = np.concatenate([root, nodes[:, 1:2], nodes[:, 2:3], nodes[:, 3:4], nodes[:, 4:5]], axis=1)
    logits_steps, _ = _steps(apply, params, tokens, cache, width=WIDTH)
    got = np.asarray(logits_tree)[:, path]
    assert np.array_equal(got, logits_steps), \
        f"{kind}: {int(np.sum(got != logits_steps))} of {logits_steps.size} logits differ"


# ---------------------------------------------------------------------------------------
# The attention op alone: write-then-attend is what makes a block's row t and a step agree.
# ---------------------------------------------------------------------------------------
def _attention_case(dtype, seed: int = 0, B: int = 2, K: int = 2, G: int = 3, H: int = 32, S: int = 256, T: int = 4):
    ks = jax.random.split(jax.random.key(seed), 5)
    bf = jnp.dtype(dtype)
    k_buf = jax.random.normal(ks[0], (B, K, S, H), bf)
    v_buf = jax.random.normal(ks[1], (B, K, H, S), bf)
    q = jax.random.normal(ks[2], (B, T, K * G, H), bf)
    k_new = jax.random.normal(ks[3], (B, T, K, H), bf)
    v_new = jax.random.normal(ks[4], (B, T, K, H), bf)
    return q, k_new, v_new, k_buf, v_buf, jnp.asarray([150, 97][:B], jnp.int32)


def _pad(x_BT, t: int, T: int):
    """Token t of a block as a padded one-token step: token t, then copies of it."""
    return jnp.repeat(x_BT[:, t:t + 1], T, axis=1)


@pytest.mark.parametrize("op", ["reference", "dot_product"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_write_then_attend_block_row_equals_step(op, dtype):
    """150 and 97 committed slots, a 4-token block: each block row equals, bit for bit, the padded
    one-token step that scores its token once the block's earlier tokens are committed."""
    from specjax.models.attention import attention, written_visibility
    from specjax.models.kv_cache import write_kv
    q, k_new, v_new, k_buf, v_buf, lengths = _attention_case(dtype)
    T, S = q.shape[1], k_buf.shape[2]

    @jax.jit
    def written(q, k_new, v_new, k_buf, v_buf, lengths):
        kb, vb = write_kv(k_buf, v_buf, k_new, v_new, lengths)
        return attention(q, None, None, (kb, vb, lengths), (written_visibility(None, lengths, lengths, T, S), None),
                         op=op), (kb, vb)

    block, (kb, vb) = written(q, k_new, v_new, k_buf, v_buf, lengths)
    for t in range(T):
        step, _ = written(_pad(q, t, T), _pad(k_new, t, T), _pad(v_new, t, T), kb, vb, lengths + t)
        assert np.array_equal(np.asarray(step[:, 0]), np.asarray(block[:, t])), f"row {t}"


def test_appended_block_keys_round_differently():
    """The control that shows the comparison above can fail: with the block's keys appended after
    the cache (a step finds the earlier tokens in the cache, a block row in the appended part),
    the same case differs in the last bit of some outputs. In float32: a bfloat16 output hides
    most of these differences in its rounding, and a model's layers then amplify the few that
    remain (experiments/greedy_exactness/README.md)."""
    from specjax.models.attention import attention
    from specjax.models.kv_cache import write_kv
    q, k_new, v_new, k_buf, v_buf, lengths = _attention_case("float32")
    T = q.shape[1]
    appended = jax.jit(lambda *a: attention(a[0], a[1], a[2], (a[3], a[4], a[5])))
    block = appended(q, k_new, v_new, k_buf, v_buf, lengths)
    kb, vb = write_kv(k_buf, v_buf, k_new, v_new, lengths)
    differ = sum(int(jnp.sum(appended(_pad(q, t, T), _pad(k_new, t, T), _pad(v_new, t, T), kb, vb, lengths + t)[:, 0]
                             != block[:, t])) for t in range(1, T))
    assert differ > 0


# The families whose attention differs where write-then-attend changes it (`llama._layer`: the
# block's q/k/v projection, q/k norms and RoPE before the write; the visibility, window and
# soft-cap of the attention after it; the MLP or experts after attention do not see the order):
# llama (plain), gemma2 (windowed and full layers, attention soft-cap, query scalar), gemma3 (q/k
# norms, a local RoPE on its windowed layers), qwen2_window (attention biases, a window above
# layer 0). The others add nothing here: qwen2's biases are qwen2_window's, qwen3's and
# qwen3_moe's q/k norms gemma3's, mistral's and mixtral's windowed layers gemma2's windowed
# layer; their experts sit after attention. (Every family's block = steps bitwise above.)
WRITE_THEN_ATTEND_KINDS = ("llama", "gemma2", "gemma3", "qwen2_window")


@pytest.mark.parametrize("kind", WRITE_THEN_ATTEND_KINDS)
def test_write_then_attend_computes_the_same_attention(kind):
    """Write-then-attend is the same function as attend-then-write: float32, every kind of
    attention the families have (WRITE_THEN_ATTEND_KINDS: windows, soft-caps, q/k norms, local
    RoPE, biases), a prefill, a chain block and a tree block at batch 2 (rows at different
    lengths), logits within float32 rounding and the same committed cache entries."""
    first = models.Llama(_config(kind, dtype="float32"))
    params = _params(first, len(kind))
    after = models.Llama(first.config.replace(write_then_attend=False))
    assert first.config.write_then_attend and not after.config.write_then_attend
    lengths = jnp.asarray([181, 122], jnp.int32)
    tokens = jax.random.randint(jax.random.key(7), (2, 181), 0, first.vocab_size)
    block = jax.random.randint(jax.random.key(3), (2, 4), 0, first.vocab_size)
    nodes = jax.random.randint(jax.random.key(5), (2, len(PARENTS) + 1), 0, first.vocab_size)
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (2, len(PARENTS)))
    visible = trees.ancestor_mask(parents, jnp.ones((2, len(PARENTS)), bool), 4)
    rel = jnp.broadcast_to(jnp.asarray([0, 1, 1, 2, 3, 4], jnp.int32), (2, len(PARENTS) + 1))
    got = []
    for model in (first, after):
        apply = jax.jit(model.apply)
        prefill, cache = apply(params, tokens, model.init_cache(2, CAPACITY), lengths)
        chain, cache_chain = apply(params, block, cache)
        tree, _ = apply(params, nodes, cache, tree=TreeBlock(rel_positions_BT=rel, visible_BTW=visible))
        got.append((prefill, chain, tree, _committed(cache_chain, cache_chain.lengths_B)))
    for a, b in zip(got[0][:3], got[1][:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[0][3], got[1][3]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Token trees: a node's ancestors sit at the slots of their block rows, not at the slots the
# steps find them at; `AttentionSpec.ordered_tail` sums each query's last keys in their order.
# ---------------------------------------------------------------------------------------
def _tree_visibility(B: int):
    """Visibility among a tree block's tokens (the root, then the nodes of PARENTS): [B, T, T]."""
    T = len(PARENTS) + 1
    vt = np.zeros((T, T), bool)
    for t in range(T):
        vt[t, 0] = vt[t, t] = True
        n = t - 1
        while n >= 0:
            vt[t, n + 1] = True
            n = PARENTS[n]
    return jnp.asarray(np.broadcast_to(vt, (B, T, T)))


def _tree_rows_against_steps(op: str, dtype: str, ordered_tail: bool):
    """A tree block (root + PARENTS) over 150 and 97 committed slots against one-token steps (each
    a pass of the block's width) along the path root, 1, 2, 3, 4: (differing outputs, outputs)."""
    from specjax.models.attention import AttentionSpec, attention, written_visibility
    from specjax.models.kv_cache import write_kv
    T = len(PARENTS) + 1
    q, k_new, v_new, k_buf, v_buf, lengths = _attention_case(dtype, T=T)
    B, S = q.shape[0], k_buf.shape[2]
    spec = AttentionSpec(scale=float(1 / np.sqrt(q.shape[-1])), ordered_tail=T if ordered_tail else 0)

    @jax.jit
    def written(q, k_new, v_new, k_buf, v_buf, lengths, visible_new_BTT):
        kb, vb = write_kv(k_buf, v_buf, k_new, v_new, lengths)
        past_B1S = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, :]
        visible = written_visibility((past_B1S, visible_new_BTT), lengths, lengths, T, S)
        return attention(q, None, None, (kb, vb, lengths), (visible, None), spec=spec, op=op), (kb, vb)

    tree, _ = written(q, k_new, v_new, k_buf, v_buf, lengths, _tree_visibility(B))
    causal = jnp.asarray(np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)))
    differ = total = 0
    kb, vb = k_buf, v_buf
    for depth, row in enumerate([0, 2, 3, 4, 5]):
        step, (kb, vb) = written(_pad(q, row, T), _pad(k_new, row, T), _pad(v_new, row, T), kb, vb, lengths + depth,
                                 causal)
        differ += int(jnp.sum(step[:, 0] != tree[:, row]))
        total += step[:, 0].size
    return differ, total


@pytest.mark.parametrize("op", ["reference", "pallas"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tree_block_row_equals_step(op, dtype):
    """Each row on a root-to-leaf path of a tree block equals, bit for bit, the padded one-token
    step that scores its token once its ancestors are committed (at ``length + depth``)."""
    differ, total = _tree_rows_against_steps(op, dtype, ordered_tail=True)
    assert differ == 0, f"{differ} of {total} outputs differ"


@pytest.mark.parametrize("op", ["reference", "pallas"])
def test_tree_without_ordered_tail_rounds_differently(op):
    """The control: summing over slots (the ancestors where the block put them) differs in the last
    bit of some outputs in float32."""
    differ, _ = _tree_rows_against_steps(op, "float32", ordered_tail=False)
    assert differ > 0


_TREE_FLOAT32 = """
import sys
sys.path.insert(0, "tests")
import test_block_step_bitwise as t
for kind in sys.argv[1:]:
    model, params = t._model(kind, dtype="float32")
    t._tree(model, params, t._prefilled(model, params, 2), kind)
    print(kind, "equal")
"""


def test_tree_block_equals_steps_float32():
    """Whole models in float32 (where a different summation order shows in the logits), batch 2:
    a tree block's path rows equal the steps' logits bit for bit (llama; gemma2: windows and
    soft-caps; mixtral: routed experts).

    Compiled with XLA's default options, as `specjax generate` compiles, in a subprocess: the
    suite's fast compilation (`FAST_COMPILE_XLA_FLAGS`) has XLA:CPU compute RoPE's cos and sin
    of the same positions to different bits in the tree's program and the steps'."""
    env = default_xla_env()
    kinds = ("llama", "gemma2", "mixtral")
    r = subprocess.run([sys.executable, "-c", _TREE_FLOAT32, *kinds], capture_output=True, text=True, env=env,
                       cwd=pathlib.Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.split() == [w for k in kinds for w in (k, "equal")]
