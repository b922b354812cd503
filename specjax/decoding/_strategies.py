"""Round strategies: what differs between a chain round and a tree round, and nothing else.

A strategy (`ChainRound`, `TreeRound`: tiny frozen objects, one per draft kind in `ROUNDS`)
drafts (`propose` -> `Proposal`: the drafted tokens, how the target's pass sees them, the
draft's q), reads its verifier's result (`verdict` -> `Verdict`: the accepted path in one
form for both kinds) and cuts the caches to the committed prefix (`commit_caches`). The
round pipeline (`_round.RoundPipeline`) runs the rest, the same for both: the target's pass,
sanitize, verify, truncate and finish.

Block positions: 0 is the root (the last committed token), then the drafted tokens (a chain's
in order, a tree's nodes in flattened order). Row x of q is the distribution the children of
block position x were drawn from (a chain's last position drafts nothing: G rows for G + 1
positions; a tree has a row per position).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import models
from specjax import trees as trees_lib
from specjax import verify as verify_lib
from specjax.decoding._adaptive import RowBudget
from specjax.decoding._state import LoopState
from specjax.drafters import DraftContext


def draft_context(state: LoopState) -> DraftContext:
    """What a drafter may read of the loop state (`specjax.drafters.DraftContext`)."""
    return DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B, target_cache=state.target_cache,
                        features=state.features_BSF, active_B=~state.done_B)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One round's draft as the pipeline takes it.

    draft: what the verifier reads as the draft (tokens_BG for a chain, the drafter's tree);
    tokens_BX: the drafted tokens the target scores after the root; layout: how they see each
    other in the target's pass (None: causal, a chain; a `models.TreeBlock` for a tree);
    q_BXV: the draft's distributions (module doc); q_read: the rows of q the verifier reads as
    distributions (True: all, False: none, or a bool [B, X] mask); draft_state: the drafter's
    state after drafting; proposed_B, draft_passes: the round's counters (`Metrics`); rows,
    limit_B: a round with a gamma per row (`BudgetRound`)."""
    draft: Any
    tokens_BX: jax.Array
    layout: models.TreeBlock | None
    q_BXV: jax.Array
    q_read: Any
    draft_state: Any
    proposed_B: Any
    draft_passes: int
    rows: models.PackedRows | None = None      # the positions the target's pass computes (None: all)
    limit_B: Any = None                        # each row's gamma (None: the round's)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The verifier's result in one form for chains and trees (A = the longest acceptable path:
    a chain's gamma, a tree's depth): ``n_acc_B`` accepted drafts, ``committed_BA1`` the tokens
    along the path then PAD, ``degenerate_B`` degenerate residuals used, ``path_BA`` the accepted
    nodes by depth (-1 after; None for a chain, whose path is its block), ``tested_BA`` /
    ``tested_accept_BA`` which draft positions reached verification and their acceptance
    probability min(1, p/q) (what adaptive gamma learns from)."""
    n_acc_B: jax.Array
    committed_BA1: jax.Array
    degenerate_B: jax.Array
    path_BA: jax.Array | None
    tested_BA: jax.Array
    tested_accept_BA: jax.Array


@dataclasses.dataclass(frozen=True)
class ChainRound:
    """A linear draft of ``gamma`` tokens (0: target-only, nothing drafted)."""
    gamma: int
    # A bad target position makes every later one of the block unusable too: the verifier
    # reads a chain as one path (`RoundPipeline._sanitize`).
    spreads_bad_p = True

    def propose(self, pipe, params, sampling, state: LoopState, key_B) -> Proposal:
        B, G = state.tokens_BS.shape[0], self.gamma
        if G == 0:
            draft_BG = jnp.zeros((B, 0), jnp.int32)
            q_BGV, draft_state, passes = jnp.zeros((B, 0, pipe.target.vocab_size), jnp.float32), state.draft_state, 0
        else:
            draft_BG, q_BGV, draft_state = pipe.drafter.propose(params.draft, state.draft_state, draft_context(state),
                                                                key_B, G, sampling)
            passes = pipe.drafter.forward_passes(G)
        return Proposal(draft=draft_BG, tokens_BX=draft_BG, layout=None, q_BXV=q_BGV, q_read=True,
                        draft_state=draft_state, proposed_B=G, draft_passes=passes)

    def verifier(self, config, sampling):
        return config.verifier_for(sampling)

    def verdict(self, res, prop: Proposal, q_BGV, p_BG1V) -> Verdict:
        G, draft_BG = self.gamma, prop.draft
        px_BG = jnp.take_along_axis(p_BG1V[:, :G], draft_BG[..., None], axis=-1)[..., 0]
        qx_BG = jnp.take_along_axis(q_BGV, draft_BG[..., None], axis=-1)[..., 0]
        return Verdict(n_acc_B=res.n_accepted_B, committed_BA1=res.committed_BG1,
                       degenerate_B=res.degenerate_residual_B, path_BA=None,
                       tested_BA=jnp.arange(G)[None] <= res.n_accepted_B[:, None],
                       tested_accept_BA=jnp.minimum(1.0, px_BG / jnp.maximum(qx_BG, 1e-30)))

    def commit_caches(self, pipe, prop: Proposal, verdict: Verdict, pos_BA1, target_cache, n_commit_B, new_L_B):
        # Caches see the committed prefix minus its last token (rollback = lengths only).
        return (target_cache.truncate(new_L_B - 1),
                pipe.drafter.commit(prop.draft_state, new_L_B) if self.gamma > 0 else prop.draft_state)


def cap_verdict(verdict: Verdict, limit_B) -> Verdict:
    """A chain verdict cut at each row's own gamma ``limit_B`` (a row-budget round,
    `RowBudget`): exactly the verdict of a round in which row b drafted ``limit_B[b]``
    tokens. Token verification decides position j from the draft and p, q at j alone, so the
    decisions before a row's gamma are that round's. Where the verifier reached the cut (the
    row's first ``limit_B`` drafts all accepted), its token there, the draft accepted or the
    residual's draw, is distributed as p at the cut given the prefix (speculative sampling of one
    position returns p; Leviathan et al. 2023, Appendix A.1): the token a round of gamma
    ``limit_B`` draws from p after an all-accepted draft. So the cut keeps it, drops everything
    after, and counts a degenerate residual only where the row's own token came from one (a
    rejection at or before the cut). Tested positions stop at the cut. Not for the block
    verifier, whose decisions read the whole block (`GenerationConfig` refuses the pair)."""
    j_A1 = jnp.arange(verdict.committed_BA1.shape[1])[None]
    return dataclasses.replace(
        verdict, n_acc_B=jnp.minimum(verdict.n_acc_B, limit_B),
        committed_BA1=jnp.where(j_A1 > limit_B[:, None], verify_lib.PAD_TOKEN, verdict.committed_BA1),
        degenerate_B=jnp.where(verdict.n_acc_B > limit_B, 0, verdict.degenerate_B),
        tested_BA=verdict.tested_BA & (j_A1[:, :-1] < limit_B[:, None]))


@dataclasses.dataclass(frozen=True)
class BudgetRound(ChainRound):
    """A chain round with a gamma per row (`_adaptive.RowBudget`): the drafter drafts the budget's
    gamma for every row, the target scores only each row's root and its first ``limit_B[b]``
    drafts (`models.PackedRows` in the budget's slots), and the pipeline cuts each row's verdict
    at its own gamma (`cap_verdict`). ``limit_B``: the rows' gammas (`_adaptive.allocate`)."""
    budget: Any = None
    limit_B: Any = None

    def propose(self, pipe, params, sampling, state: LoopState, key_B) -> Proposal:
        """The drafter drafts only as far as the longest row's gamma (at least one token), one
        `lax.switch` branch per length: a round whose rows get 1 or 2 positions costs the draft
        steps of a gamma-2 round, not of a gamma-``self.gamma`` one. Positions past that length
        hold token 0 drafted from a q one-hot at 0 (a draft that really sampled it, as prompt
        lookup's): the longest rows' verdict is cut just after their gamma (`cap_verdict`), where
        the token committed (the draft accepted, or the residual) must be distributed as p, which
        holds only for a token drawn from the q the verifier is given."""
        B, G, V = self.limit_B.shape[0], self.gamma, pipe.target.vocab_size
        context = draft_context(state)

        def draft(g):
            def run(_):
                toks_Bg, q_BgV, draft_state = pipe.drafter.propose(params.draft, state.draft_state, context,
                                                                   key_B, g, sampling)
                if g < G:                                   # the filler: token 0, q one-hot at 0
                    toks_Bg = jnp.concatenate([toks_Bg, jnp.zeros((B, G - g), toks_Bg.dtype)], axis=1)
                    q_BgV = jnp.concatenate([q_BgV, jax.nn.one_hot(jnp.zeros((B, G - g), jnp.int32), V,
                                                                   dtype=q_BgV.dtype)], axis=1)
                return toks_Bg, q_BgV, draft_state, jnp.int32(pipe.drafter.forward_passes(g))
            return run

        longest = jnp.clip(jnp.max(self.limit_B), 1, G)
        draft_BG, q_BGV, draft_state, passes = jax.lax.switch(longest - 1, [draft(g) for g in range(1, G + 1)], None)
        rows = models.PackedRows.leading(self.limit_B + 1, G + 1, self.budget.slots(B))
        return Proposal(draft=draft_BG, tokens_BX=draft_BG, layout=None, q_BXV=q_BGV, q_read=True,
                        draft_state=draft_state, proposed_B=self.limit_B, draft_passes=passes, rows=rows,
                        limit_B=self.limit_B)

    def verdict(self, res, prop: Proposal, q_BGV, p_BG1V) -> Verdict:
        return cap_verdict(super().verdict(res, prop, q_BGV, p_BG1V), self.limit_B)


@dataclasses.dataclass(frozen=True)
class TreeRound:
    """A token tree (`specjax.trees.TreeShape` or `DynamicTree`): the drafter drafts one per row,
    the target scores the root and every node in one pass (positions by depth, an ancestor
    mask), and the accepted path's K/V move to the committed slots."""
    tree: Any
    # Only the bad nodes themselves get the stand-in (`RoundPipeline._sanitize`).
    spreads_bad_p = False

    def propose(self, pipe, params, sampling, state: LoopState, key_B) -> Proposal:
        draft, q_BN1V, draft_state = pipe.drafter.propose_tree(params.draft, state.draft_state, draft_context(state),
                                                              key_B, self.tree, sampling, pipe.config.tree_children)
        B, N = draft.tokens_BN.shape[0], draft.num_nodes
        visible_BTT = trees_lib.ancestor_mask(draft.parents_BN, draft.valid_BN, self.tree.max_depth)
        rel_BT = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), draft.depths_BN], axis=1)
        if draft.mode == "deterministic":
            # Deterministic children carry their own one-hot q: the rows are not read.
            q_read = False
        else:
            # Children drawn from q: the verifier reads the rows of the root and of the nodes with
            # a valid child (a leaf's row may be zeros).
            parent_BN = jnp.where(draft.valid_BN, draft.parents_BN + 1, -1)      # row of each node's parent
            q_read = (parent_BN[:, :, None] == jnp.arange(N + 1)[None, None]).any(axis=1).at[:, 0].set(True)
        return Proposal(draft=draft, tokens_BX=draft.tokens_BN, layout=models.TreeBlock(rel_BT, visible_BTT),
                        q_BXV=q_BN1V, q_read=q_read, draft_state=draft_state,
                        proposed_B=jnp.sum(draft.valid_BN, axis=1),
                        draft_passes=pipe.drafter.tree_forward_passes(self.tree))

    def verifier(self, config, sampling):
        return config.tree_verifier_for(sampling)

    def verdict(self, res, prop: Proposal, q_BN1V, p_BTV) -> Verdict:
        return Verdict(n_acc_B=res.n_accepted_B, committed_BA1=res.committed_BA1,
                       degenerate_B=res.degenerate_residual_B, path_BA=res.path_BA, tested_BA=res.tested_BA,
                       tested_accept_BA=res.tested_accept_BA)

    def commit_caches(self, pipe, prop: Proposal, verdict: Verdict, pos_BA1, target_cache, n_commit_B, new_L_B):
        # The root and the committed nodes, in path order, to the committed slots.
        path_BA, slots_BN = verdict.path_BA, prop.draft.draft_slots_BN
        nodes_B = jnp.minimum(verdict.n_acc_B, n_commit_B)
        slots_BA = (jnp.full(path_BA.shape, -1, jnp.int32) if slots_BN is None else
                    jnp.where(path_BA >= 0, jnp.take_along_axis(slots_BN, jnp.maximum(path_BA, 0), axis=1), -1))
        accepted = trees_lib.AcceptedPath(nodes_BA=path_BA, num_B=nodes_B, draft_slots_BA=slots_BA)
        return target_cache.commit_path(pos_BA1, n_commit_B), pipe.drafter.commit(prop.draft_state, new_L_B, accepted)


ROUNDS = {"chain": ChainRound, "tree": TreeRound}
"""The round strategy of each draft kind (`specjax.verify.DRAFT_KINDS`)."""


def round_strategy(proposal, limit_B=None) -> ChainRound | TreeRound:
    """The strategy for a round's static proposal: a draft length (chain), a row budget (a chain
    with the rows' gammas ``limit_B``) or a tree."""
    if isinstance(proposal, RowBudget):
        if limit_B is None:
            raise ValueError(f"a {proposal} round needs each row's gamma (limit_B)")
        return BudgetRound(proposal.gamma, budget=proposal, limit_B=limit_B)
    return ROUNDS["chain" if isinstance(proposal, int) else "tree"](proposal)
