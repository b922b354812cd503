"""Tree drafting by a model: expand a static tree level by level, or grow an EAGLE-2 dynamic tree.

Both start from the draft's logits at the root (the last committed token, already in the
draft's cache, whose ``lengths_B`` is the committed length L) and write the tentative K/V of
the nodes they forward at slots ``L + slot`` through the model's tree attention
(`specjax.models.TreeBlock`), so the cache's committed part is never touched; the accepted
path is moved to the committed slots afterwards (`KVCache.commit_path`, see `ModelDrafter`).

Children of one node (``children`` mode, `specjax.trees.CHILDREN_MODES`):

* ``"deterministic"``: the k most probable tokens in order (probabilities after the round's
  logits processing; under greedy decoding, the draft's plain softmax, since greedy q is one-hot);
* ``"iid"``: k independent draws from q (duplicates possible);
* ``"without_replacement"``: Gumbel-top-k on log q, which draws the k children in sequence
  without replacement (Kool, van Hoof, Welling 2019, "Stochastic Beams and Where to Find Them").

A child that cannot be drawn (q has fewer than k tokens in its support) is marked invalid, and
so is its subtree. The static tree forwards every level but the last (``max_depth`` forwards
counting the root's ingest); node n's K/V sit at slot ``L + n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax import trees as trees_lib
from specjax import models


def ranking_probs(logits_BV, sampling):
    """The distribution children are drawn from (or ranked by): the round's q; under greedy
    decoding, whose q is one-hot, the softmax of the logits (penalized, with penalties) ranks
    the alternatives."""
    if sampling.greedy:
        return jax.nn.softmax(sampling_lib.adjusted_logits(logits_BV, sampling), axis=-1)
    return sampling_lib.probabilities(logits_BV, sampling)


def draw_children(key_B, q_BOV, k: int, mode: str):
    """k children of each of P parents -> tokens_BPk, ok_BPk (False: could not be drawn)."""
    B, P, V = q_BOV.shape
    logq = jnp.log(q_BOV)
    if mode == "deterministic":
        vals, toks = jax.lax.top_k(logq, k)
        return toks.astype(jnp.int32), vals > -jnp.inf
    if mode == "without_replacement":
        g = jax.vmap(lambda key: jax.random.gumbel(key, (P, V), jnp.float32))(key_B)
        vals, toks = jax.lax.top_k(logq + g, k)
        return toks.astype(jnp.int32), vals > -jnp.inf
    if mode == "iid":
        # = jax.random.categorical(key, lq[:, None, :], shape=(P, k)) bit for bit (noise [P, k, V]).
        toks = jax.vmap(lambda key, lq: sampling_lib.categorical(key, jnp.broadcast_to(lq[:, None, :], (P, k, V))))(
            key_B, logq)
        return toks, jnp.ones((B, P, k), bool)
    raise ValueError(f"children must be one of {trees_lib.CHILDREN_MODES}, got {mode!r}")


def expand_static(model, params, cache, root_logits_BV, key_B, shape: trees_lib.TreeShape, sampling,
                  mode: str):
    """Draft a static tree -> (DraftTree, q_BN1V, cache with tentative entries).

    Level d's nodes are drawn from their parents' q (one draw per parent, k = its child
    count), then forwarded together in one tree block (except the last level)."""
    B = root_logits_BV.shape[0]
    N, D = shape.num_nodes, shape.max_depth
    parents, depths, ranks = np.asarray(shape.parents), np.asarray(shape.depths), np.asarray(shape.ranks)
    q_rows = [ranking_probs(root_logits_BV, sampling)]       # q of the root, then of each node
    tokens, valid = [], []
    level_keys_B = jax.vmap(lambda k: jax.random.split(k, D))(key_B)
    for d in range(1, D + 1):
        start, stop = shape.level(d)
        par = parents[start:stop]
        uniq = sorted(set(par.tolist()))
        k = max(int(ranks[start:stop].max()) + 1, 1)
        q_BOV = jnp.stack([q_rows[p + 1] for p in uniq], axis=1)
        toks_BPk, ok_BPk = draw_children(level_keys_B[:, d - 1], q_BOV, k, mode)
        pos = np.asarray([uniq.index(p) for p in par])
        tok_BW = toks_BPk[:, pos, ranks[start:stop]]
        ok_BW = ok_BPk[:, pos, ranks[start:stop]]
        par_ok_BW = (jnp.ones((B, stop - start), bool) if d == 1
                     else jnp.stack([valid[p] for p in par], axis=1))
        ok_BW = ok_BW & par_ok_BW
        tokens.extend(tok_BW[:, i] for i in range(stop - start))
        valid.extend(ok_BW[:, i] for i in range(stop - start))
        if d == D:
            break
        # Forward this level: node n (slot n) sees the committed prefix, its ancestors
        # (earlier slots) and itself.
        anc = _ancestors(shape)
        vis_TW = np.zeros((stop - start, stop), bool)
        for i, n in enumerate(range(start, stop)):
            vis_TW[i, list(anc[n]) + [n]] = True
        block = models.TreeBlock(rel_positions_BT=jnp.full((B, stop - start), d - 1, jnp.int32),
                          visible_BTW=jnp.broadcast_to(jnp.asarray(vis_TW), (B, stop - start, stop)))
        logits_BWV, cache = model.apply(params, tok_BW, cache, tree=block)
        # Penalties, automata: a node's children see the tokens on its path (ancestors, itself).
        q_BWV = ranking_probs(logits_BWV, sampling.at_paths(jnp.stack(tokens, axis=1), parents[:stop],
                                                            np.arange(start, stop)))
        q_rows.extend(q_BWV[:, i] for i in range(stop - start))
    # Leaves have no children: their q rows are never read (zeros keep the shapes static).
    V = root_logits_BV.shape[-1]
    q_rows.extend(jnp.zeros((B, V), jnp.float32) for _ in range(N + 1 - len(q_rows)))
    tree = trees_lib.DraftTree.from_shape(
        shape, jnp.stack(tokens, axis=1), mode, valid_BN=jnp.stack(valid, axis=1),
        draft_slots_BN=jnp.broadcast_to(jnp.where(jnp.asarray(depths) < D, jnp.arange(N), -1)[None], (B, N)))
    return tree, jnp.stack(q_rows, axis=1), cache


def _ancestors(shape: trees_lib.TreeShape) -> list[list[int]]:
    out = []
    for p in shape.parents:
        out.append([] if p < 0 else out[p] + [p])
    return out


def expand_dynamic(model, params, cache, root_logits_BV, spec: trees_lib.DynamicTree, sampling):
    """EAGLE-2 dynamic tree (Li et al. 2024, arXiv:2406.16858) -> (DraftTree, q_BN1V, cache).

    Depth 1: the root's ``topk`` most probable children. Then, for each further depth: forward
    the ``topk`` frontier nodes in one tree block, take each one's ``topk`` most probable
    children, scored by cumulative log-probability (parent's + own), and make the best ``topk``
    of them the next frontier. Every candidate joins a pool; the ``node_budget`` best of the pool
    by cumulative log-probability are kept (ties: shallower first, so a parent always precedes
    its children: a child's score never exceeds its parent's) and laid out breadth-first, the
    children of a node in descending probability. Children are deterministic. The depth loop
    is unrolled (each depth's block sits at a different static cache offset): depth d's
    frontier holds its K/V at slots ``L + (d - 1) topk + i``.
    """
    B, V = root_logits_BV.shape
    k, D, budget = spec.topk, spec.depth, spec.node_budget
    q_root_BV = ranking_probs(root_logits_BV, sampling)
    score_Bk, tok_Bk = jax.lax.top_k(jnp.log(q_root_BV), k)
    pool_tok, pool_score = [tok_Bk.astype(jnp.int32)], [score_Bk]
    pool_parent = [jnp.full((B, k), -1, jnp.int32)]          # pool index of the parent (-1: root)
    pool_depth = [1] * k
    front_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (B, k))
    front_tok, front_score = tok_Bk.astype(jnp.int32), score_Bk
    anc_BkW = jnp.zeros((B, k, 0), bool)                      # which forwarded slots each frontier node sees
    P = k + (D - 1) * k * k
    slot_BO = jnp.full((B, P), -1, jnp.int32)
    q_BOV = jnp.zeros((B, P, V), jnp.float32)
    rows = jnp.arange(B)[:, None]
    for d in range(1, D):
        vis_BkW = jnp.concatenate([anc_BkW, jnp.broadcast_to(jnp.eye(k, dtype=bool)[None], (B, k, k))], axis=2)
        block = models.TreeBlock(rel_positions_BT=jnp.full((B, k), d - 1, jnp.int32), visible_BTW=vis_BkW)
        logits_BkV, cache = model.apply(params, front_tok, cache, tree=block)
        # penalties, automata: each frontier node's path in the pool so far
        at_front = sampling.at_paths(jnp.concatenate(pool_tok, axis=1), jnp.concatenate(pool_parent, axis=1),
                                     front_idx)
        q_BkV = ranking_probs(logits_BkV, at_front)
        slot_BO = slot_BO.at[rows, front_idx].set((d - 1) * k + jnp.arange(k, dtype=jnp.int32)[None])
        q_BOV = q_BOV.at[rows, front_idx].set(q_BkV)
        cv_Bkk, ct_Bkk = jax.lax.top_k(jnp.log(q_BkV), k)
        cand_score = (front_score[:, :, None] + cv_Bkk).reshape(B, k * k)
        base = len(pool_depth)
        pool_tok.append(ct_Bkk.reshape(B, k * k).astype(jnp.int32))
        pool_score.append(cand_score)
        pool_parent.append(jnp.repeat(front_idx, k, axis=1))
        pool_depth += [d + 1] * (k * k)
        front_score, best = jax.lax.top_k(cand_score, k)
        front_tok = jnp.take_along_axis(pool_tok[-1], best, axis=1)
        front_idx = (base + best).astype(jnp.int32)
        anc_BkW = jnp.take_along_axis(vis_BkW, (best // k)[..., None], axis=1)   # parent's view incl. itself
    tok_BP = jnp.concatenate(pool_tok, axis=1)
    score_BO = jnp.concatenate(pool_score, axis=1)
    parent_BO = jnp.concatenate(pool_parent, axis=1)
    depth_O = jnp.asarray(pool_depth, jnp.int32)
    P = tok_BP.shape[1]
    slot_BO, q_BOV = slot_BO[:, :P], q_BOV[:, :P]
    # Keep the best `budget` (score desc, then depth asc, then pool order), then lay them out
    # breadth-first (depth asc, score desc).
    idx_O = jnp.arange(P)
    keep = jax.vmap(lambda sc: jnp.lexsort((idx_O, depth_O, -sc))[:budget])(score_BO)       # [B, N]
    kd = depth_O[keep]
    ks = jnp.take_along_axis(score_BO, keep, axis=1)
    order = jax.vmap(lambda dd, sc, ii: jnp.lexsort((ii, -sc, dd)))(kd, ks, keep)
    sel_BN = jnp.take_along_axis(keep, order, axis=1)
    new_index_BP = jnp.full((B, P), -1, jnp.int32).at[rows, sel_BN].set(jnp.arange(budget, dtype=jnp.int32)[None])
    par_pool = jnp.take_along_axis(parent_BO, sel_BN, axis=1)
    parents_BN = jnp.where(par_pool < 0, -1, jnp.take_along_axis(new_index_BP, jnp.maximum(par_pool, 0), axis=1))
    score_BN = jnp.take_along_axis(score_BO, sel_BN, axis=1)
    tree = trees_lib.DraftTree(
        tokens_BN=jnp.take_along_axis(tok_BP, sel_BN, axis=1), parents_BN=parents_BN.astype(jnp.int32),
        depths_BN=depth_O[sel_BN], valid_BN=score_BN > -jnp.inf,
        draft_slots_BN=jnp.take_along_axis(slot_BO, sel_BN, axis=1),
        mode="deterministic", max_depth=D)
    q_BN1V = jnp.concatenate([q_root_BV[:, None], jnp.take_along_axis(q_BOV, sel_BN[..., None], axis=1)], axis=1)
    return tree, q_BN1V, cache
