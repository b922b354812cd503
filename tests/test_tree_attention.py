"""Tree attention in `Llama.apply(..., tree=TreeBlock)` and `KVCache.commit_path`.

Reference for every tree computation: a plain causal forward (cache=None) of the row's prompt
followed by the node's path from the root, one row at a time. Block position 0 is the root (the
last committed token), block position n + 1 is node n (`specjax.trees`).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _hf_tiny import right_padded
from specjax import trees
from specjax.models import KVCache, Llama, ModelConfig, TreeBlock, canonical_params

BASE = ModelConfig(vocab_size=97, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                   head_dim=8, ffn_size=64, rope_theta=10000.0, rms_eps=1e-5)
QWENISH = BASE.replace(attention_bias=True, tie_embeddings=False, arch="qwen2",
                       rope_scaling={"rope_type": "linear", "factor": 2.0})
ATOL = 3e-5
CAPACITY = 32
SHAPE = trees.TreeShape.from_branching((2, 2))     # nodes 0,1 at depth 1; 2,3 <- 0; 4,5 <- 1
commit = jax.jit(KVCache.commit_path)


def _model(config, seed=0):
    model = Llama(config)
    params = canonical_params(model.init_params(jax.random.key(seed)), config)
    # Bigger weights than the 0.02 init make attention patterns non-trivial.
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    return model, model.prepare_params(params)


@pytest.fixture(scope="module", params=["scan", "unrolled_fused"])
def setup(request):
    """Stacked cache + unfused projections, or per-layer cache + fused projections (+ biases,
    scaled RoPE): both cache layouts and both projection layouts."""
    config = {"scan": BASE,
              "unrolled_fused": QWENISH.replace(scan_layers=False, fuse_projections=True)}[request.param]
    model, params = _model(config)
    fresh = jax.jit(lambda p, t: model.apply(p, t, None)[0])

    def reference(seq, pad_to=24):
        """Logits [len(seq), V] of a plain causal forward (one compile: fixed padding)."""
        padded = np.zeros((1, pad_to), np.int32)
        padded[0, :len(seq)] = seq
        return np.asarray(fresh(params, jnp.asarray(padded))[0, :len(seq)])

    return model, params, jax.jit(model.apply), reference


def _prefill(step, params, model, prompts):
    tokens, lengths = right_padded(prompts)
    _, cache = step(params, jnp.asarray(tokens), model.init_cache(len(prompts), CAPACITY),
                    jnp.asarray(lengths))
    return cache


def _path(shape, n):
    """Node indices from depth 1 down to node n."""
    out = []
    while n >= 0:
        out.append(n)
        n = shape.parents[n]
    return out[::-1]


def _target_block(shape, nodes_BN, roots_B, valid_BN=None):
    """tokens [B, 1 + N] and the TreeBlock of a target verification block (offset 0)."""
    B, N = nodes_BN.shape
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, N))
    valid = jnp.ones((B, N), bool) if valid_BN is None else jnp.asarray(valid_BN)
    visible = trees.ancestor_mask(parents, valid, shape.max_depth)
    rel = jnp.broadcast_to(jnp.asarray((0,) + shape.depths, jnp.int32), (B, N + 1))
    tokens = np.concatenate([np.asarray(roots_B)[:, None], nodes_BN], axis=1)
    return jnp.asarray(tokens), TreeBlock(rel_positions_BT=rel, visible_BTW=visible)


def _check_nodes(logits, prompts, nodes_BN, shape, reference, valid_BN=None):
    """logits [B, 1 + N]: the root's equal the prompt's last, node n's the prompt + n's path."""
    for b, prompt in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[b, 0]), reference(prompt)[-1], atol=ATOL, rtol=1e-4)
        for n in range(shape.num_nodes):
            if valid_BN is not None and not valid_BN[b, n]:
                continue
            seq = np.concatenate([prompt, nodes_BN[b, _path(shape, n)]])
            np.testing.assert_allclose(np.asarray(logits[b, n + 1]), reference(seq)[-1],
                                       atol=ATOL, rtol=1e-4, err_msg=f"row {b} node {n}")


def test_tree_block_equals_path_forwards(setup):
    """One verification block (root + a (2, 2) tree) over ragged committed prefixes: every
    node's logits are those of its own path; row 1 holds a padding node (node 2, with a
    child of node 0 after it) that nothing may see."""
    model, params, step, reference = setup
    rng = np.random.default_rng(0)
    V = model.vocab_size
    prompts = [rng.integers(0, V, 6), rng.integers(0, V, 3)]
    cache = _prefill(step, params, model, [p[:-1] for p in prompts])
    nodes = rng.integers(0, V, (2, SHAPE.num_nodes))
    valid = np.ones((2, SHAPE.num_nodes), bool)
    valid[1, 2] = False
    tokens, tree = _target_block(SHAPE, nodes, [p[-1] for p in prompts], valid)
    logits, out = step(params, tokens, cache, None, tree)
    _check_nodes(logits, prompts, nodes, SHAPE, reference, valid)
    # Tentative entries: the committed lengths stay; the block sits at lengths + t.
    np.testing.assert_array_equal(np.asarray(out.lengths_B), np.asarray(cache.lengths_B))
    # Negative control: the causal mask of a chain gives node 1 (and later nodes) another
    # context, and the comparison above would catch it.
    causal = tree.replace(visible_BTW=jnp.broadcast_to(jnp.tril(jnp.ones((7, 7), bool)), (2, 7, 7)))
    wrong, _ = step(params, tokens, cache, None, causal)
    with pytest.raises(AssertionError):
        _check_nodes(wrong, prompts, nodes, SHAPE, reference, valid)


@pytest.mark.parametrize("batch", [1, 2])
def test_draft_levels_with_a_window_equal_path_forwards(setup, batch):
    """The drafter pattern: the prompt (root included) is committed; each depth of the tree is
    one call whose window (offset = nodes written so far) shows the earlier depths' tentative
    entries. Batch 1 writes with dynamic_update_slice, batch 2 (ragged, a (2, 2, 1) tree: a
    window over two earlier depths) with a scatter."""
    model, params, step, reference = setup
    rng = np.random.default_rng(1 + batch)
    V = model.vocab_size
    shape = trees.TreeShape.from_branching((2, 2, 1) if batch == 2 else (2, 2))
    N = shape.num_nodes
    prompts = [rng.integers(0, V, n) for n in (4, 7)[:batch]]
    cache = _prefill(step, params, model, prompts)
    nodes = rng.integers(0, V, (batch, N))
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (batch, N))
    # Node-to-node ancestor mask (the root is committed, so drop its row and column).
    anc = trees.ancestor_mask(parents, jnp.ones((batch, N), bool), shape.max_depth)[:, 1:, 1:]
    logits = np.zeros((batch, N, V), np.float32)
    for depth in range(1, shape.max_depth + 1):
        start, stop = shape.level(depth)
        rel = jnp.full((batch, stop - start), depth - 1, jnp.int32)
        tree = TreeBlock(rel_positions_BT=rel, visible_BTW=anc[:, start:stop, :stop])
        assert tree.offset == start
        out, cache = step(params, jnp.asarray(nodes[:, start:stop]), cache, None, tree)
        logits[:, start:stop] = np.asarray(out)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), [len(p) for p in prompts])
    for b, prompt in enumerate(prompts):
        for n in range(N):
            seq = np.concatenate([prompt, nodes[b, _path(shape, n)]])
            np.testing.assert_allclose(logits[b, n], reference(seq)[-1], atol=ATOL, rtol=1e-4,
                                       err_msg=f"row {b} node {n}")


def _committed_kv(cache):
    k = np.stack(cache.k) if cache.per_layer else np.asarray(cache.k)    # [L, B, K, S, H]
    v = np.stack(cache.v) if cache.per_layer else np.asarray(cache.v)    # [L, B, K, H, S]
    return k, np.swapaxes(v, -1, -2)


def test_commit_path_then_decode_equals_fresh_recompute(setup):
    """Verify a (2, 2) tree, commit different accepted paths per row (depth 2, the root only,
    and nothing), then decode normally and run another (smaller) tree round: every logit
    equals a fresh recompute of the committed prefix, the committed K/V equal a fresh
    prefill's, and the rejected branches' leftover entries have no effect."""
    model, params, step, reference = setup
    rng = np.random.default_rng(3)
    V = model.vocab_size
    prompts = [rng.integers(0, V, n) for n in (5, 8, 4)]
    cache = _prefill(step, params, model, [p[:-1] for p in prompts])
    nodes = rng.integers(0, V, (3, SHAPE.num_nodes))
    tokens, tree = _target_block(SHAPE, nodes, [p[-1] for p in prompts])
    _, cache = step(params, tokens, cache, None, tree)
    # Row 0 accepts node 1 then node 5 (block positions 0, 2, 6), row 1 no node (the root),
    # row 2 commits nothing (e.g. a finished row). Entries past num_B are arbitrary.
    offsets = jnp.asarray([[0, 2, 6], [0, 5, 1], [3, 4, 5]], jnp.int32)
    num = jnp.asarray([3, 1, 0], jnp.int32)
    committed = [np.concatenate([prompts[0], nodes[0, [1, 5]]]), prompts[1], prompts[2][:-1]]
    lengths_before = np.asarray(cache.lengths_B)
    new = commit(cache, offsets, num)
    np.testing.assert_array_equal(np.asarray(new.lengths_B), lengths_before + np.asarray(num))

    # The committed slots hold what a fresh prefill of the committed prefixes writes.
    fresh_cache = _prefill(step, params, model, committed)
    np.testing.assert_array_equal(np.asarray(fresh_cache.lengths_B), np.asarray(new.lengths_B))
    (k, v), (fk, fv) = _committed_kv(new), _committed_kv(fresh_cache)
    for b, seq in enumerate(committed):
        np.testing.assert_allclose(k[:, b, :, :len(seq)], fk[:, b, :, :len(seq)], atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose(v[:, b, :, :len(seq)], fv[:, b, :, :len(seq)], atol=ATOL, rtol=1e-4)
    # Row 2 committed nothing: its whole buffer is untouched by commit_path.
    old_k, old_v = _committed_kv(cache)
    np.testing.assert_array_equal(k[:, 2], old_k[:, 2])
    np.testing.assert_array_equal(v[:, 2], old_v[:, 2])

    # The next token, decoded normally on top of the committed path.
    nxt = rng.integers(0, V, (3, 1))

    def check_next(c):
        logits, _ = step(params, jnp.asarray(nxt), c)
        for b, seq in enumerate(committed):
            want = reference(np.concatenate([seq, nxt[b]]))[-1]
            np.testing.assert_allclose(np.asarray(logits[b, 0]), want, atol=ATOL, rtol=1e-4,
                                       err_msg=f"row {b}")

    check_next(new)
    # Negative controls, which the check above must catch: committing a rejected branch's
    # entries (row 0: node 0 and its child node 2 instead of 1 and 5), or only advancing the
    # length (slot order = block order, so node 0, a rejected sibling, lands on the path).
    with pytest.raises(AssertionError):
        check_next(commit(cache, jnp.asarray([[0, 1, 3], [0, 5, 1], [3, 4, 5]], jnp.int32), num))
    with pytest.raises(AssertionError):
        check_next(cache.rollback(cache.lengths_B + num))

    # The next round: a smaller tree (a chain of 2) leaves round 1's rejected entries past
    # its block in the cache; they stay invisible.
    chain = trees.TreeShape.chain(2)
    nodes2 = rng.integers(0, V, (3, 2))
    tokens2, tree2 = _target_block(chain, nodes2, nxt[:, 0])
    logits2, after = step(params, tokens2, new, None, tree2)
    np.testing.assert_array_equal(np.asarray(after.lengths_B), np.asarray(new.lengths_B))
    _check_nodes(logits2, [np.concatenate([s, nxt[b]]) for b, s in enumerate(committed)],
                 nodes2, chain, reference)


def _reference_commit(k, v, lengths, offsets, num):
    """numpy commit_path on [L, B, K, S, H] / [L, B, K, H, S] buffers."""
    k, v = k.copy(), v.copy()
    for b in range(k.shape[1]):
        src = [lengths[b] + offsets[b, j] for j in range(num[b])]
        ks, vs = k[:, b, :, src, :].copy(), v[:, b, :, :, src].copy()
        for j in range(num[b]):
            k[:, b, :, lengths[b] + j, :] = ks[j]
            v[:, b, :, :, lengths[b] + j] = vs[j]
    return k, v


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("case", ["batch1", "batch1_near_capacity", "batch3"])
def test_commit_path_moves_exactly_the_path(per_layer, case):
    """commit_path against a numpy reference on random buffers: only the path's slots change
    (batch 1: dynamic_update_slice, also when lengths + A would run past the capacity; batch 3:
    a scatter, rows committing 0..A entries)."""
    L, K, S, H = 2, 2, 12, 4
    lengths, offsets, num = {
        "batch1": ([3], [[1, 2, 4, 6]], [3]),
        "batch1_near_capacity": ([9], [[0, 2, 7, 7]], [2]),      # 9 + 4 > 12: a clamped start
        "batch3": ([2, 5, 0], [[0, 1, 2, 3], [2, 3, 5, 6], [1, 4, 6, 7]], [0, 4, 2]),
    }[case]
    B = len(lengths)
    rng = np.random.default_rng(4)
    k = rng.standard_normal((L, B, K, S, H)).astype(np.float32)
    v = rng.standard_normal((L, B, K, H, S)).astype(np.float32)
    cache = KVCache(k=tuple(jnp.asarray(x) for x in k) if per_layer else jnp.asarray(k),
                    v=tuple(jnp.asarray(x) for x in v) if per_layer else jnp.asarray(v),
                    lengths_B=jnp.asarray(lengths, jnp.int32))
    out = commit(cache, jnp.asarray(offsets, jnp.int32), jnp.asarray(num, jnp.int32))
    want_k, want_v = _reference_commit(k, v, lengths, np.asarray(offsets), num)
    got_k = np.stack(out.k) if per_layer else np.asarray(out.k)
    got_v = np.stack(out.v) if per_layer else np.asarray(out.v)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(np.asarray(out.lengths_B), np.asarray(lengths) + np.asarray(num))


@pytest.mark.parametrize("batch", [1, 2])
def test_tree_step_and_commit_update_the_donated_cache_in_place(batch):
    """Neither a donated tree step nor commit_path copies or transposes a cache buffer: only
    their in-place writes (dynamic-update-slice / scatter) touch buffer-sized data. Compiled
    with XLA's fusion emitters on, as a user's build is: the suite's fast-compile options
    (`_bench_run.FAST_COMPILE_XLA_FLAGS`) emit fusions with XLA's older emitters, whose batch-2
    tree step copies the four cache buffers."""
    model, params = _model(BASE.replace(scan_layers=False, fuse_projections=True))
    K, H, S = BASE.num_kv_heads, BASE.head_dim, 256
    cache = model.init_cache(batch, S)
    tree = TreeBlock(rel_positions_BT=jnp.zeros((batch, 3), jnp.int32),
                     visible_BTW=jnp.ones((batch, 3, 5), bool))
    programs = {
        "tree step": jax.jit(model.apply, donate_argnums=(2,)).lower(
            params, jnp.zeros((batch, 3), jnp.int32), cache, None, tree),
        "commit_path": jax.jit(KVCache.commit_path, donate_argnums=(0,)).lower(
            cache, jnp.zeros((batch, 4), jnp.int32), jnp.zeros((batch,), jnp.int32)),
    }
    buffer_shape = re.compile(rf"= f32\[{batch},{K},({S},{H}|{H},{S})\]\S* (copy|transpose|fusion)\(")
    for name, lowered in programs.items():
        txt = lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True}).as_text()
        entry = txt[txt.index("\nENTRY"):]
        moved = [line.strip()[:160] for line in entry.split("\n")
                 if buffer_shape.search(line) and "dynamic-update-slice" not in line
                 and "scatter" not in line]
        assert moved == [], name + ":\n" + "\n".join(moved)


def test_tree_argument_errors():
    model, params = _model(BASE)
    tokens = jnp.asarray([[3, 1, 4]])
    tree = TreeBlock(rel_positions_BT=jnp.zeros((1, 3), jnp.int32), visible_BTW=jnp.ones((1, 3, 3), bool))
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="needs a cache"):
        model.apply(params, tokens, None, tree=tree)
    with pytest.raises(ValueError, match="num_valid_B"):
        model.apply(params, tokens, cache, jnp.asarray([2]), tree=tree)
    bad = tree.replace(visible_BTW=jnp.ones((1, 3, 2), bool))        # W < T
    with pytest.raises(ValueError, match="visible_BTW"):
        model.apply(params, tokens, cache, tree=bad)
    with pytest.raises(ValueError, match="offsets_BA"):
        cache.commit_path(jnp.zeros((2, 3), jnp.int32), 1)
