"""Traversal verification (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi: "Traversal Verification for
Speculative Tree Decoding", NeurIPS 2025, arXiv:2505.12398)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.trees import DraftTree
from specjax.verify._residual import RESIDUAL_TOL, normalize_residual
from specjax.verify._tree import (
    TreeWalk,
    TreeWalkVerifier,
    _node_inputs,
    child_proposal,
    remove_drawn,
)


@dataclasses.dataclass(frozen=True)
class TraversalVerifier(TreeWalkVerifier):
    """Traversal verification: leaf-to-root, sequence-level acceptance over the whole tree.

    Weng et al. 2025 (arXiv:2505.12398), in this codebase's notation. Every node Y carries a
    target distribution ``P_Y`` (initially ``p`` after Y's path), a draft bookkeeping
    ``Q_Y`` (initially ``q`` after Y's path) and a sequence acceptance weight ``w_Y``:

    * ``w_root = 1``; when the walk enters child c (token x, the next untried child of Y),
      ``w_c = min(1, w_Y P_Y(x) / q_c(x))`` with ``q_c`` the proposal child c was drawn from
      (``child_proposal``: the paper's ``p_alpha``, the block-verification weight of the path);
    * the walk is a depth-first traversal in sibling (index) order; a node is tested after its
      whole subtree has been rejected, i.e. when it has become a leaf -- the first node tested
      is the first deepest leaf. Test of node Y: ``eta_Y < w_Y`` (``eta_Y ~ U[0, 1)``, Y's own
      uniform). If it passes, Y's path is accepted and the final token is drawn from ``P_Y``
      (``p`` of Y -- the bonus -- if none of Y's children was rejected, else Y's residual);
    * if it fails, Y is deleted and its parent Z is updated (the paper's residual update):
      ``S = sum_x max(0, w_Z P_Z(x) - q_Y(x))``,
      ``P_Z <- norm(max(0, w_Z P_Z - q_Y))`` (``normalize_residual``; fallback: Z's own p;
      counted when used: a later child's weight (with ``w_Z > 0``) or the final draw),
      ``w_Z <- S / (S + 1 - w_Z)`` (0 if the denominator is 0, as ``BlockVerifier``; the root
      keeps ``w = 1``), ``Q_Z <- Q_Z`` with Y's token removed (without replacement); Z's
      remaining children get their weights from the updated ``w_Z, P_Z`` when entered;
    * when all of the root's children are deleted the final token is drawn from ``P_root``.

    On a chain this is exactly block verification (Sun et al. 2025, ``BlockVerifier``): the
    weights are its ``w_i``, the updated weight of node i is its ``h_i = m_i / (m_i + 1 - w_i)``,
    and testing from the deepest node up stops at ``max{i: eta_i < h_i}``; with the same
    uniforms both verifiers commit the same tokens.

    Exactness, for all three children modes. The argument (the paper's losslessness proof,
    written as the induction this implementation relies on): for every node Y with current
    ``(w_Y, P_Y)``, the walk through Y's subtree ends accepting a node of it with the continuation
    after Y distributed as ``w_Y`` times its law under ``P_Y`` (first token from ``P_Y``, then the
    target), and deletes Y with probability ``1 - w_Y``. For the first child x of Y, drawn from
    ``q_c``: accepting inside it contributes ``min(q_c(x), w_Y P_Y(x))`` per x, the shortfall is
    ``S`` times the residual's law, the child is deleted with probability ``1 - w_Y + S``, so the
    rest of Y's walk must accept with ``S / (S + 1 - w_Y)`` under the residual -- the update
    above. The step uses only that the child was drawn from ``q_c`` given the earlier siblings,
    so it holds with ``q_c`` from ``child_proposal``: the node's q (``"iid"``, duplicates
    allowed), q without the earlier siblings renormalised (``"without_replacement"``: the
    paper's update of the draft distribution, which removes a rejected token), one-hot(x)
    (``"deterministic"``). The exact-enumeration tests check each mode.

    Implemented as one ``lax.scan`` of 2N + 1 steps per row (each node entered once and tested
    once, then the root's final draw), carrying the current node and a per-depth stack of
    ``(w, P, p, Q)`` for the current path.

    Attributes:
      residual_tol: tolerance tau on the residual mass (see ``RESIDUAL_TOL``).
    """

    residual_tol: float = RESIDUAL_TOL

    def walk(self, u_BN, tree: DraftTree, q_BN1V, p_BN1V) -> TreeWalk:
        self.check_inputs(tree, q_BN1V, p_BN1V)
        B, N = tree.tokens_BN.shape
        V = p_BN1V.shape[-1]
        L = tree.max_depth + 1                      # stack levels: 0 = root, d = depth d
        mode, tol = tree.mode, self.residual_tol
        tok_BN, par_BN, valid_BN = _node_inputs(tree, V)
        depth_BN = jnp.clip(tree.depths_BN.astype(jnp.int32), 1, L - 1)
        p_BN1V = p_BN1V.astype(jnp.float32)
        q_BN1V = q_BN1V.astype(jnp.float32)
        level_A = jnp.arange(L, dtype=jnp.int32)

        def row(u_N, tok_N, par_N, valid_N, depth_N, q_N1V, p_N1V):
            def step(carry, _):
                (cur, done, last, final_V, entered_N, W_L, P_LV, Pn_LV, Q_LV, flag_A, deg,
                 tested_N, prob_N, passed_N) = carry
                cur_slot = jnp.maximum(cur, 0)
                lvl = jnp.where(cur >= 0, depth_N[cur_slot], 0)
                cand_N = valid_N & (par_N == cur) & ~entered_N
                has_next = jnp.any(cand_N)
                nxt = jnp.argmax(cand_N).astype(jnp.int32)
                enter = ~done & has_next
                leave = ~done & ~has_next & (cur >= 0)
                at_root_end = ~done & ~has_next & (cur < 0)

                # Enter child `nxt` of `cur`: its weight from cur's current (w, P, Q).
                x = tok_N[nxt]
                q_c_V = child_proposal(Q_LV[lvl], x, mode)
                num, qx = W_L[lvl] * P_LV[lvl][x], q_c_V[x]
                w_new = jnp.where(num <= 0, 0.0, jnp.where(num >= qx, 1.0,
                                                           num / jnp.where(qx > 0, qx, 1.0)))
                child_lvl = jnp.minimum(lvl + 1, L - 1)
                at_child_A = enter & (level_A == child_lvl)

                # Test `cur` (all its children are gone): eta < w.
                w_cur = W_L[lvl]
                passes = u_N[cur_slot] < w_cur
                accept = leave & passes
                reject = leave & ~passes
                # Rejection: residual update of the parent (level lvl - 1).
                plvl = jnp.maximum(lvl - 1, 0)
                xc = tok_N[cur_slot]
                q_y_V = child_proposal(Q_LV[plvl], xc, mode)
                wz = W_L[plvl]
                unnorm_V = jnp.maximum(wz * P_LV[plvl] - q_y_V, 0.0)
                mass = jnp.sum(unnorm_V)
                resid_V, degenerate = normalize_residual(unnorm_V, Pn_LV[plvl], tol)
                denom = mass + 1.0 - wz
                wz_new = jnp.where(plvl == 0, 1.0,
                                   jnp.where(denom > 0, mass / jnp.where(denom > 0, denom, 1.0), 0.0))
                at_parent_A = reject & (level_A == plvl)

                p_child_V, q_child_V = p_N1V[nxt + 1], q_N1V[nxt + 1]
                P_LV = jnp.where(at_child_A[:, None], p_child_V[None],
                                 jnp.where(at_parent_A[:, None], resid_V[None], P_LV))
                Pn_LV = jnp.where(at_child_A[:, None], p_child_V[None], Pn_LV)
                Q_LV = jnp.where(at_child_A[:, None], q_child_V[None],
                                 jnp.where(at_parent_A[:, None],
                                           remove_drawn(Q_LV[plvl], xc, mode)[None], Q_LV))
                # A degenerate residual counts once, when it is first used: a later child's
                # weight is computed from it (with w > 0), or the final token is drawn from it.
                used_A = (((enter & (W_L[lvl] > 0)) | accept) & (level_A == lvl)
                          | (at_root_end & (level_A == 0)))
                deg = deg + jnp.sum(flag_A & used_A).astype(jnp.int32)
                flag_A = jnp.where(at_parent_A, degenerate, flag_A & ~used_A & ~at_child_A)
                W_L = jnp.where(at_child_A, w_new, jnp.where(at_parent_A, wz_new, W_L))
                is_cur_N = leave & (jnp.arange(N) == cur)
                tested_N = tested_N | is_cur_N
                prob_N = jnp.where(is_cur_N, w_cur, prob_N)
                passed_N = passed_N | (is_cur_N & passes)
                entered_N = entered_N | (enter & (jnp.arange(N) == nxt))
                final_V = jnp.where(accept, P_LV[lvl], jnp.where(at_root_end, P_LV[0], final_V))
                last = jnp.where(accept, cur, last)
                done = done | accept | at_root_end
                cur = jnp.where(enter, nxt, jnp.where(reject, par_N[cur_slot], cur))
                return (cur, done, last, final_V, entered_N, W_L, P_LV, Pn_LV, Q_LV, flag_A, deg,
                        tested_N, prob_N, passed_N), None

            zeros_AV = jnp.zeros((L, V), jnp.float32)
            init = (jnp.int32(-1), jnp.bool_(False), jnp.int32(-1), p_N1V[0],
                    jnp.zeros((N,), bool),
                    jnp.zeros((L,), jnp.float32).at[0].set(1.0),
                    zeros_AV.at[0].set(p_N1V[0]), zeros_AV.at[0].set(p_N1V[0]),
                    zeros_AV.at[0].set(q_N1V[0]), jnp.zeros((L,), bool), jnp.int32(0),
                    jnp.zeros((N,), bool), jnp.zeros((N,), jnp.float32), jnp.zeros((N,), bool))
            out, _ = jax.lax.scan(step, init, None, length=2 * N + 1)
            _, _, last, final_V, _, _, _, _, _, _, deg, tested_N, prob_N, passed_N = out
            return last, final_V, deg, tested_N, prob_N, passed_N

        last, final, deg, tested, prob, passed = jax.vmap(row)(
            u_BN.astype(jnp.float32), tok_BN, par_BN, valid_BN, depth_BN, q_BN1V, p_BN1V)
        return TreeWalk(last_node_B=last, final_dist_BV=final, degenerate_B=deg, tested_BN=tested,
                        accept_prob_BN=prob, passed_BN=passed)
