"""Step = block, bitwise, in bfloat16: a verification block's row t computes exactly what a
one-token decode step computes from the same cache, in the accelerator profiles' layout
(configs/generate_gpu.py: unrolled per-layer weights and caches, fused projections, bfloat16,
XLA's matmuls, the einsum attention op; configs/generate_tpu.py: the same with separate
projections), on this CPU.

For every family preset (tiny random models of each family's own pieces: q/k norms, biases,
sliding windows, soft-caps, sandwich norms, local RoPE, routed experts), at batch 1 and at
batch 2 with rows at different lengths:

* chains: a k-token block over a prefilled cache against k one-token steps, logits compared
  with ``==`` (no tolerance), and the caches' committed entries after both paths;
* trees: a tree block (root + nodes, ancestor mask) against one-token steps along a
  root-to-leaf path, the path's rows compared with ``==``.

A step scores the engine's one block shape (`GenerationConfig.block_tokens`, as the profiles
set it): its token, then padding, in a pass as wide as the verification block. At batch 1 a
pass of one row is a matrix-vector product on this CPU and rounds differently from the rows of
a matrix product: without the padding, steps and blocks differ in the last bit.

This is what makes greedy speculative decoding reproduce target-only greedy decoding token for
token in bfloat16. The stacked ``lax.scan`` layout (configs/generate_gpu_scan.py) does not have
it on this CPU: its blocks and steps differ in the last bit of some logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models, trees
from specjax.models import TreeBlock
from specjax.models.hf_loader import config_from_hf

from _hf_tiny import FAMILY_KINDS, family_config

KINDS = ("llama", "qwen2") + FAMILY_KINDS
CAPACITY = 64
PROFILE = dict(dtype="bfloat16", scan_layers=False, fuse_projections=True, packed_projections=False,
               cpu_attention=False, attention_op="reference")


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


def _model(kind: str, **layout):
    model = models.Llama(_config(kind, **layout))
    params = model.init_params(jax.random.key(len(kind)))
    # weights well above the init's 0.02, so that bf16 rounding has something to round
    params = jax.tree.map(lambda x: (x.astype(jnp.float32) * (1.0 if x.ndim == 1 else 8.0)).astype(x.dtype), params)
    return model, params


def _prefilled(model, params, B: int):
    lengths = np.array([9, 5][:B], np.int32)
    tokens = jax.random.randint(jax.random.key(7), (B, 9), 0, model.vocab_size)
    _, cache = jax.jit(model.apply)(params, tokens, model.init_cache(B, CAPACITY), jnp.asarray(lengths))
    return cache


def _steps(model, params, tokens_BT, cache, width: int):
    """One-token steps as the engine runs them with a padded block: each a pass of ``width``
    tokens (the token repeated), row 0 kept, the cache cut back to one new entry."""
    apply = jax.jit(model.apply)
    out = []
    for t in range(tokens_BT.shape[1]):
        block = jnp.repeat(tokens_BT[:, t:t + 1], width, axis=1)
        before = cache.lengths_B
        logits, cache = apply(params, block, cache)
        cache = cache.rollback(before + 1)
        out.append(logits[:, :1])
    return jnp.concatenate(out, axis=1), cache


def _committed(cache, lengths):
    """Each row's committed K and V entries (slots below its length), every layer."""
    out = []
    for k, v in zip(cache.k, cache.v):
        for b, n in enumerate(np.asarray(lengths)):
            out += [np.asarray(k[b, :, :n]), np.asarray(v[b, :, :, :n])]
    return out


# batch 1 for every family (a one-row step is the case padding exists for); batch 2 (rows at
# different lengths, a scatter write) for the families whose pieces differ most
CASES = [(kind, 1) for kind in KINDS] + [(kind, 2) for kind in ("llama", "gemma2", "mixtral")]


@pytest.mark.parametrize("kind,B", CASES)
def test_block_equals_steps(kind, B):
    model, params = _model(kind)
    cache = _prefilled(model, params, B)
    _chain(model, params, cache, kind)
    _tree(model, params, cache, kind)


@pytest.mark.parametrize("B", [1, 2])
def test_block_equals_steps_with_separate_projections(B):
    """The TPU profile's layout: q, k, v, gate and up as separate matmuls."""
    model, params = _model("llama", fuse_projections=False)
    cache = _prefilled(model, params, B)
    _chain(model, params, cache, "llama")
    _tree(model, params, cache, "llama")


def _chain(model, params, cache, kind):
    B = cache.batch_size
    block = jax.random.randint(jax.random.key(3), (B, 4), 0, model.vocab_size)
    logits_block, cache_block = jax.jit(model.apply)(params, block, cache)
    logits_steps, cache_steps = _steps(model, params, block, cache, width=block.shape[1])
    assert np.array_equal(np.asarray(logits_block), np.asarray(logits_steps)), \
        f"{kind}: {int(jnp.sum(logits_block != logits_steps))} of {logits_steps.size} logits differ"
    for a, b in zip(_committed(cache_block, cache_block.lengths_B), _committed(cache_steps, cache_block.lengths_B)):
        assert np.array_equal(a, b)


# 5 nodes under the root: nodes 0 and 1 its children, 1 -> 2 -> 3 -> 4; the path root, 1, 2, 3, 4
PARENTS = (-1, -1, 1, 2, 3)      # parent index of node i among the nodes (-1: the root)


def _tree(model, params, cache, kind):
    B = cache.batch_size
    N = len(PARENTS)
    nodes = jax.random.randint(jax.random.key(5), (B, N), 0, model.vocab_size)
    root = jax.random.randint(jax.random.key(6), (B, 1), 0, model.vocab_size)
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (B, N))
    depth = [0] * N
    for i, p in enumerate(PARENTS):
        depth[i] = 1 if p < 0 else depth[p] + 1
    visible = trees.ancestor_mask(parents, jnp.ones((B, N), bool), max(depth))
    rel = jnp.broadcast_to(jnp.asarray([0] + depth, jnp.int32), (B, N + 1))
    apply = jax.jit(model.apply)
    logits_tree, _ = apply(params, jnp.concatenate([root, nodes], axis=1), cache,
                           tree=TreeBlock(rel_positions_BT=rel, visible_BTW=visible))
    path = [0, 2, 3, 4, 5]           # block rows of the root and nodes 1-4 (node 0 is a sibling branch)
    tokens = jnp.concatenate([root, nodes[:, 1:2], nodes[:, 2:3], nodes[:, 3:4], nodes[:, 4:5]], axis=1)
    logits_steps, _ = _steps(model, params, tokens, cache, width=N + 1)
    got = logits_tree[:, jnp.asarray(path)]
    assert np.array_equal(np.asarray(got), np.asarray(logits_steps)), \
        f"{kind}: {int(jnp.sum(got != logits_steps))} of {logits_steps.size} logits differ"
