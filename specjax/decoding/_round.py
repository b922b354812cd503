"""One draft-verify round, chain or tree, as the stages the engine's module doc lists:
`RoundStages` holds the target, the drafter and the generation config (frozen: a static
`jax.jit` argument) and runs a round on a `LoopState`; `specjax.decoding.Engine` adds the loop,
the adaptive policy, placement and the public entry points on top of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import models
from specjax import sampling as sampling_lib
from specjax import trees as trees_lib
from specjax import verify as verify_lib
from specjax.decoding import _adaptive
from specjax.decoding._state import EOS, MAX_TOKENS, NAN_LOGITS, PAD_ID, Commit, EngineParams, LoopState, Metrics
from specjax.decoding._state import _write_block, _write_rows
from specjax.drafters import CHAIN_ONLY, Capabilities, DraftContext

P_SUM_TOL = 1e-3
"""How far from 1 a target row's total probability may be before the engine treats the
position like NaN logits. A softmax row sums to 1 within a few float32 ulps per 1e4 tokens;
only broken arithmetic (NaN, overflow, all entries -inf) lands outside this."""


def _bad_probabilities(p_XV):
    """True where a distribution row cannot be verified against: a NaN/inf or negative entry,
    or a total probability off 1 by more than `P_SUM_TOL` (0 included: non-normalisable)."""
    total_X = jnp.sum(p_XV, axis=-1)
    return (~jnp.isfinite(p_XV).all(axis=-1) | (p_XV < 0).any(axis=-1)
            | ~(jnp.abs(total_X - 1.0) <= P_SUM_TOL))


def _fresh_tokens(sampling, verify_key_B, p0_BV, bad_q_B):
    """The gamma = 0 outcome for rows whose draft q was not finite: one token from p_0 with the
    row's own key (``fold_in(verify key, 1)``), int32 [B]. Drawn only in rounds where some row
    needs it (a draw over the whole vocabulary per row; rows with a finite q ignore the value,
    so skipping it changes nothing else)."""
    def draw(_):
        if sampling.greedy:
            return sampling_lib.argmax(p0_BV)
        keys_B = jax.vmap(lambda k: jax.random.fold_in(k, 1))(verify_key_B)
        return jax.vmap(sampling_lib.sample)(keys_B, p0_BV).astype(jnp.int32)
    return jax.lax.cond(bad_q_B.any(), draw, lambda _: jnp.zeros(bad_q_B.shape, jnp.int32), None)


@dataclasses.dataclass(frozen=True)
class RoundStages:
    """The stages of one round for a target, a drafter (None: target-only) and a generation
    config; `_round` runs them (chains) or `_tree_round` (trees), both ending in `_finish`."""
    target: models.DecoderModel
    drafter: Any
    config: Any          # a `specjax.decoding.GenerationConfig`

    @property
    def capabilities(self) -> Capabilities:
        """What the drafter declared it needs and offers (`specjax.drafters.Capabilities`); a
        target-only engine (no drafter, or gamma 0 only) needs nothing."""
        if self.drafter is None or self.config.max_gamma == 0:
            return CHAIN_ONLY
        caps = self.drafter.capabilities
        if not isinstance(caps, Capabilities):
            raise TypeError(f"{type(self.drafter).__name__}.capabilities must be a drafters.Capabilities, got {caps!r}")
        return caps

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features the drafter reads (empty: none kept)."""
        return self.capabilities.feature_layers

    @property
    def regimes(self) -> int:
        """The drafter's draft sources that adaptive gamma tells apart (`_adaptive` module doc)."""
        return self.capabilities.regimes



    def _regime(self, state: LoopState):
        """(the next round's batch regime, each row's regime [B]), from the committed tokens."""
        B = state.lengths_B.shape[0]
        if self.regimes == 1:
            return jnp.int32(0), jnp.zeros((B,), jnp.int32)
        context = DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B, target_cache=state.target_cache,
                               features=state.features_BSF, active_B=~state.done_B)
        regime_B = self.drafter.regime_B(context).astype(jnp.int32)
        return _adaptive.batch_regime(regime_B, ~state.done_B), regime_B

    def _target_forward(self, params, block_BT, cache, tree=None):
        """(logits, features or None, cache) of one target pass over a block; with a padded
        block size (`GenerationConfig.target_block`) the block is padded to it (padding tokens
        repeat the last one; in a tree, padding nodes see only themselves) and the outputs cut
        back to the block's own rows. The cache then holds the padding's entries past the
        committed length, which the round's truncation or path commit leaves as garbage."""
        T, N = block_BT.shape[1], self.config.target_block
        if N is None or N == T:
            return self._target_pass(params, block_BT, cache, tree)
        B = block_BT.shape[0]
        block_BN = jnp.concatenate([block_BT, jnp.broadcast_to(block_BT[:, -1:], (B, N - T))], axis=1)
        if tree is not None:
            W = tree.visible_BTW.shape[2] - T         # the window of earlier tentative entries
            vis = jnp.zeros((B, N, W + N), bool).at[:, :T, :W + T].set(tree.visible_BTW)
            vis = vis.at[:, jnp.arange(T, N), W + jnp.arange(T, N)].set(True)
            rel = jnp.concatenate([tree.rel_positions_BT, jnp.zeros((B, N - T), jnp.int32)], axis=1)
            tree = models.TreeBlock(rel_positions_BT=rel, visible_BTW=vis)
        logits, feats, cache = self._target_pass(params, block_BN, cache, tree)
        # Every row stays live: without the barrier XLA drops the rows nobody reads (a
        # target-only step reads row 0) back up through the last layers, and one-row matmuls
        # round differently from the block's.
        logits, feats = jax.lax.optimization_barrier((logits, feats))
        return logits[:, :T], None if feats is None else feats[:, :T], cache

    def _target_pass(self, params, block_BT, cache, tree=None):
        if not self.feature_layers:
            # A model without tree support takes no ``tree`` argument (chains only).
            out = (self.target.apply(params.target, block_BT, cache) if tree is None
                   else self.target.apply(params.target, block_BT, cache, tree=tree))
            return out[0], None, out[1]
        return self.target.apply_with_features(params.target, block_BT, cache, tree=tree, layers=self.feature_layers)

    def _propose(self, params, state: LoopState, key_B, gamma, sampling):
        B = state.tokens_BS.shape[0]
        if gamma == 0:
            return (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, self.target.vocab_size), jnp.float32),
                    state.draft_state)
        context = DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B,
                               target_cache=state.target_cache, features=state.features_BSF, active_B=~state.done_B)
        return self.drafter.propose(params.draft, state.draft_state, context, key_B, gamma, sampling)

    def _sanitize(self, logits_BG1V, p_BG1V, draft_BG, q_BGV):
        """Unusable inputs. (a) A draft q that is not a distribution over the vocabulary (a NaN or
        inf or negative entry, or a row that does not sum to 1 within `P_SUM_TOL`, e.g. a head
        whose vocabulary map repeats ids) cannot be verified: the row's proposals are discarded,
        the round commits one token sampled from p_0, exactly a gamma = 0 round for that row, and
        it is counted in ``invalid_draft_rounds``. (b) A bad target position -- NaN or
        +inf logits, or a p the verifier could not use (`_bad_probabilities`: a non-finite or
        negative entry, or a row that does not sum to 1, e.g. NaN from a temperature that
        bypassed `SamplingConfig.make`) -- and every later position are replaced by a uniform
        p before verifying (keeps the verifier's arithmetic finite; nothing from those
        positions is committed and the row stops with NAN_LOGITS there, see `_truncate`)."""
        V = self.target.vocab_size
        bad_p_BG1 = (jnp.isnan(logits_BG1V) | jnp.isposinf(logits_BG1V)).any(axis=-1)   # -inf is a legal mask
        bad_p_BG1 = jnp.cumsum(bad_p_BG1 | _bad_probabilities(p_BG1V), axis=1) > 0
        p_safe_BG1V = jnp.where(bad_p_BG1[..., None], 1.0 / V, p_BG1V)
        bad_q_B = _bad_probabilities(q_BGV).any(axis=1)     # False for gamma = 0 (no rows)
        q_safe_BGV = jnp.where(bad_q_B[:, None, None], jax.nn.one_hot(draft_BG, V, dtype=q_BGV.dtype), q_BGV)
        return p_safe_BG1V, q_safe_BGV, bad_p_BG1, bad_q_B

    def _verify(self, sampling, verify_key_B, draft_BG, q_BGV, p_BG1V, bad_q_B):
        """The verifier, vmapped over rows (each with its own key); bad-q rows get the gamma = 0
        outcome, one token from p_0 with their own key."""
        gamma = draft_BG.shape[1]
        verifier = self.config.verifier_for(sampling)
        res = jax.vmap(lambda k, d, q, p: jax.tree.map(lambda x: x[0], verifier(k, d[None], q[None], p[None])))(
            verify_key_B, draft_BG, q_BGV, p_BG1V)
        if gamma == 0:
            return res
        fresh_B = _fresh_tokens(sampling, verify_key_B, p_BG1V[:, 0], bad_q_B)
        fresh_BG1 = jnp.full_like(res.committed_BG1, verify_lib.PAD_TOKEN).at[:, 0].set(
            fresh_B.astype(res.committed_BG1.dtype))
        return res.replace(n_accepted_B=jnp.where(bad_q_B, 0, res.n_accepted_B),
                           committed_BG1=jnp.where(bad_q_B[:, None], fresh_BG1, res.committed_BG1),
                           degenerate_residual_B=jnp.where(bad_q_B, 0, res.degenerate_residual_B))

    def _truncate(self, state: LoopState, n_accepted_B, committed_BG1, bad_p_BG1):
        """How many of the verified tokens each row commits, and how rows end.

        Non-finite target logits: only the positions whose p the verifier used (0 ..
        n_accepted) matter. With the first one at j <= n_accepted the row keeps the j drafts
        accepted before it (exactly what target-only decoding commits before reaching it) and
        stops with NAN_LOGITS. Whatever ends the row first in token order names its status
        (EOS or the limit can come before a NaN position inside the same block)."""
        config = self.config
        G1 = committed_BG1.shape[1]
        B = state.lengths_B.shape[0]
        active_B = ~state.done_B
        j_G1 = jnp.arange(G1)
        nan_BG1 = bad_p_BG1 & (j_G1[None] <= n_accepted_B[:, None])
        nan_B = nan_BG1.any(axis=1) & active_B
        remaining_B = config.max_new_tokens - (state.lengths_B - state.prompt_lengths_B)
        n_commit_B = jnp.where(nan_B, jnp.argmax(nan_BG1, axis=1), n_accepted_B + 1)
        n_commit_B = jnp.minimum(n_commit_B, remaining_B)
        if config.eos_ids:
            is_eos_BG1 = jnp.isin(committed_BG1, jnp.asarray(config.eos_ids)) & (j_G1[None] < n_commit_B[:, None])
            hit_eos_B = is_eos_BG1.any(axis=1)
            n_commit_B = jnp.where(hit_eos_B, jnp.argmax(is_eos_BG1, axis=1) + 1, n_commit_B)
        else:
            hit_eos_B = jnp.zeros((B,), bool)
        hit_eos_B = hit_eos_B & active_B
        n_commit_B = jnp.where(active_B, n_commit_B, 0).astype(jnp.int32)
        new_L_B = state.lengths_B + n_commit_B
        reached_max_B = active_B & (new_L_B - state.prompt_lengths_B >= config.max_new_tokens)
        status_B = jnp.where(reached_max_B, MAX_TOKENS, state.status_B)
        status_B = jnp.where(nan_B & ~hit_eos_B & ~reached_max_B, NAN_LOGITS, status_B)
        status_B = jnp.where(hit_eos_B, EOS, status_B)
        done_B = state.done_B | nan_B | hit_eos_B | reached_max_B
        return n_commit_B, status_B, done_B, active_B & ~nan_B

    def _finish(self, state, choice, *, committed_BA1, n_acc_B, bad_path_BA1, bad_q_B, degenerate_B, tested_BA,
                tested_accept_BA, proposed_B, draft_passes, scored, next_key_B, commit_caches, f_block_BXF):
        """The end of every round, chain or tree: how many of the verified tokens each row commits
        (`_truncate`), the caches cut to the committed prefix (``commit_caches(n_commit_B,
        new_L_B) -> (target_cache, draft_state)``), the tokens and features written, the
        counters, and the `Commit` -> (state, Commit, tested_sum_B, tested_n_B).

        Per row: ``committed_BA1`` the verifier's tokens along the accepted path (A = gamma or
        the tree's depth), ``n_acc_B`` its accepted drafts (0 for a bad-q row), ``bad_path_BA1``
        the unusable target positions along it (`_sanitize`), ``tested_BA`` /
        ``tested_accept_BA`` which draft positions reached verification and their acceptance
        probability min(1, p/q) (what adaptive gamma learns from: E_{x~q}[min(1, p(x)/q(x))] =
        sum_x min(p, q), Leviathan et al. 2023, Def. 3.1), ``proposed_B`` the drafted tokens,
        ``f_block_BXF`` the target's features along the path (None without a feature head)."""
        n_commit_B, status_B, done_B, live_B = self._truncate(state, n_acc_B, committed_BA1, bad_path_BA1)
        L_B = state.lengths_B
        new_L_B = L_B + n_commit_B
        target_cache, draft_state = commit_caches(n_commit_B, new_L_B)

        m = state.metrics
        active_B = ~state.done_B
        drafted_B = live_B & ~bad_q_B
        n_acc_B = jnp.where(drafted_B, n_acc_B, 0)
        G = self.config.max_gamma
        accepted_at_BG = (jnp.arange(G)[None] < n_acc_B[:, None]) & drafted_B[:, None]
        tested_BA = tested_BA & drafted_B[:, None]
        metrics = Metrics(
            rounds_B=m.rounds_B + active_B.astype(jnp.int32),
            draft_passes_B=m.draft_passes_B + active_B.astype(jnp.int32) * draft_passes,
            proposed_B=m.proposed_B + jnp.where(drafted_B, proposed_B, 0).astype(jnp.int32),
            accepted_B=m.accepted_B + n_acc_B,
            committed_B=m.committed_B + n_commit_B,
            degenerate_residual_B=m.degenerate_residual_B + jnp.where(live_B, degenerate_B, 0),
            accepted_at_BG=m.accepted_at_BG + accepted_at_BG.astype(jnp.int32),
            tested_at_BG=m.tested_at_BG + jnp.pad(tested_BA.astype(jnp.int32), ((0, 0), (0, G - tested_BA.shape[1]))),
            gamma_rounds_Z=m.gamma_rounds_Z + self._onehot(choice),
            invalid_draft_rounds_B=m.invalid_draft_rounds_B + (live_B & bad_q_B).astype(jnp.int32),
            scored_B=m.scored_B + active_B.astype(jnp.int32) * scored,
        )
        tested_sum_B = jnp.sum(jnp.where(tested_BA, tested_accept_BA, 0.0), axis=1)
        tested_n_B = jnp.sum(tested_BA, axis=1).astype(jnp.int32)

        K = G + 1
        committed_BC = jnp.pad(committed_BA1, ((0, 0), (0, K - committed_BA1.shape[1])), constant_values=PAD_ID)
        new_state = state.replace(
            tokens_BS=_write_rows(state.tokens_BS, committed_BC, L_B, n_commit_B), lengths_B=new_L_B,
            done_B=done_B, status_B=status_B, target_cache=target_cache, draft_state=draft_state,
            key_B=next_key_B, metrics=metrics, round=state.round + 1,
            # The path's features land at its positions L-1 ..; those past the new committed
            # length are garbage until overwritten (never read: see LoopState.features_BSF).
            features_BSF=None if f_block_BXF is None else _write_block(state.features_BSF, f_block_BXF, L_B - 1))
        commit = Commit(tokens_BC=jnp.where(jnp.arange(K)[None] < n_commit_B[:, None], committed_BC, PAD_ID),
                        start_B=L_B, n_B=n_commit_B, done_B=done_B)
        return new_state, commit, tested_sum_B, tested_n_B

    def _onehot(self, proposal):
        """Counts one round of this candidate (`Metrics.gamma_rounds_Z`)."""
        return (jnp.arange(len(self.config.gammas)) == self.config.gammas.index(proposal)).astype(jnp.int32)

    def _choose(self, state):
        """The adaptive policy's choice for the next round: (index, probe, batch regime, rows' regimes)."""
        regime, regime_B = self._regime(state)
        chosen, probe = _adaptive.choose(self.config.gamma, state.policy, regime)
        return chosen, probe, regime, regime_B

    def _policy_round(self, params, sampling, gamma, chosen, probe, regime, regime_B, state):
        """(state, commit) of one round at ``gamma`` (the adaptive policy's choice ``chosen``,
        ``probe``, ``regime`` and ``regime_B`` as `_choose` gave them), with the round's
        acceptance folded into each regime's estimate (its rows' tested positions)."""
        state, commit, tested_sum_B, tested_n_B = self._round(params, sampling, gamma, state)
        in_BR = regime_B[:, None] == jnp.arange(self.regimes)[None]
        sum_R = jnp.sum(jnp.where(in_BR, tested_sum_B[:, None], 0.0), axis=0)
        n_R = jnp.sum(jnp.where(in_BR, tested_n_B[:, None], 0), axis=0)
        policy = _adaptive.update(self.config.gamma, state.policy, chosen, probe, sum_R, n_R, regime)
        return self._constrain(state.replace(policy=policy)), commit

    def _chosen_round(self, params, sampling, index, state):
        """`_step`'s adaptive round when the host already knows the policy's choice ``index``
        (static: the previous round's ``Commit.next_index``, or `_first_choice`): that round
        alone, compiled without the `lax.switch` over every candidate (whose copies of the
        caches cost more per round, see `_run`); the commit carries the next round's choice.
        Same keys, same policy update, same state as `_step`."""
        chosen, probe, regime, regime_B = self._choose(state)       # chosen == index
        state, commit = self._policy_round(params, sampling, self.config.gamma.gammas[index], chosen, probe,
                                           regime, regime_B, state)
        return state, commit.replace(next_index=self._choose(state)[0])

    def _first_choice(self, state):
        return self._choose(state)[0]

    def _round(self, params: EngineParams, sampling, gamma, state: LoopState):
        """One draft-verify round with a static gamma or tree -> (state, Commit, tested_sum_B,
        tested_n_B): per row, the sum and count of the tested acceptances (see `_finish`)."""
        if not isinstance(gamma, int):
            return self._tree_round(params, sampling, gamma, state)
        keys_B3 = jax.vmap(lambda k: jax.random.split(k, 3))(state.key_B)
        draft_key_B, verify_key_B, next_key_B = keys_B3[:, 0], keys_B3[:, 1], keys_B3[:, 2]
        L_B = state.lengths_B
        last_B = jnp.take_along_axis(state.tokens_BS, (L_B - 1)[:, None], axis=1)[:, 0]

        draft_BG, q_BGV, draft_state = self._propose(params, state, draft_key_B, gamma, sampling)
        block_BG1 = jnp.concatenate([last_B[:, None], draft_BG], axis=1)
        logits_BG1V, f_BG1F, target_cache = self._target_forward(params, block_BG1, state.target_cache)
        p_BG1V = sampling_lib.probabilities(logits_BG1V, sampling)
        p_BG1V, q_BGV, bad_p_BG1, bad_q_B = self._sanitize(logits_BG1V, p_BG1V, draft_BG, q_BGV)
        res = self._verify(sampling, verify_key_B, draft_BG, q_BGV, p_BG1V, bad_q_B)
        px_BG = jnp.take_along_axis(p_BG1V[:, :gamma], draft_BG[..., None], axis=-1)[..., 0]
        qx_BG = jnp.take_along_axis(q_BGV, draft_BG[..., None], axis=-1)[..., 0]

        def commit_caches(n_commit_B, new_L_B):
            # Caches see the committed prefix minus its last token (rollback = lengths only).
            return (target_cache.truncate(new_L_B - 1),
                    self.drafter.commit(draft_state, new_L_B) if gamma > 0 else draft_state)

        return self._finish(
            state, gamma, committed_BA1=res.committed_BG1, n_acc_B=res.n_accepted_B, bad_path_BA1=bad_p_BG1,
            bad_q_B=bad_q_B, degenerate_B=res.degenerate_residual_B,
            tested_BA=jnp.arange(gamma)[None] <= res.n_accepted_B[:, None],
            tested_accept_BA=jnp.minimum(1.0, px_BG / jnp.maximum(qx_BG, 1e-30)), proposed_B=gamma,
            draft_passes=0 if gamma == 0 else self.drafter.forward_passes(gamma), scored=gamma + 1,
            next_key_B=next_key_B, commit_caches=commit_caches, f_block_BXF=f_BG1F)

    def _tree_round(self, params: EngineParams, sampling, tree, state: LoopState):
        """One round with a token tree: the drafter drafts a tree, the target scores the root
        (the last committed token) and every node in one pass with tree attention, the tree
        verifier picks a path, and the caches keep exactly that path (its K/V moved to the
        committed slots). Same stages as a linear round; see `_round`."""
        keys_B3 = jax.vmap(lambda k: jax.random.split(k, 3))(state.key_B)
        draft_key_B, verify_key_B, next_key_B = keys_B3[:, 0], keys_B3[:, 1], keys_B3[:, 2]
        L_B = state.lengths_B
        B = L_B.shape[0]
        V = self.target.vocab_size
        A = tree.max_depth
        last_B = jnp.take_along_axis(state.tokens_BS, (L_B - 1)[:, None], axis=1)[:, 0]
        context = DraftContext(tokens_BS=state.tokens_BS, lengths_B=L_B, target_cache=state.target_cache,
                               features=state.features_BSF, active_B=~state.done_B)
        draft, q_BN1V, draft_state = self.drafter.propose_tree(
            params.draft, state.draft_state, context, draft_key_B, tree, sampling, self.config.tree_children)
        N = draft.num_nodes

        block_BT = jnp.concatenate([last_B[:, None], draft.tokens_BN], axis=1)
        visible_BTT = trees_lib.ancestor_mask(draft.parents_BN, draft.valid_BN, A)
        rel_BT = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), draft.depths_BN], axis=1)
        logits_BTV, f_BTF, target_cache = self._target_forward(params, block_BT, state.target_cache,
                                                               tree=models.TreeBlock(rel_BT, visible_BTT))
        p_BTV = sampling_lib.probabilities(logits_BTV, sampling)
        # _sanitize's rules per node: non-finite target logits or an unusable p -> uniform
        # stand-in (never committed from, see below); a non-finite (or NaN) q, or a q row the
        # verifier reads that is not a distribution -> the row's round becomes gamma = 0.
        bad_p_BT = (jnp.isnan(logits_BTV) | jnp.isposinf(logits_BTV)).any(axis=-1) | _bad_probabilities(p_BTV)
        p_BTV = jnp.where(bad_p_BT[..., None], 1.0 / V, p_BTV)
        bad_q_B = ~jnp.isfinite(q_BN1V).all(axis=(1, 2))
        if draft.mode != "deterministic":
            # Children drawn from q: the verifier reads the rows of the root and of the nodes with
            # a valid child (a leaf's row may be zeros); one that is not a distribution -> gamma = 0.
            # (Deterministic children carry their own one-hot q; the rows are not read.)
            parent_BN = jnp.where(draft.valid_BN, draft.parents_BN + 1, -1)      # row of each node's parent
            read_BN1 = (parent_BN[:, :, None] == jnp.arange(N + 1)[None, None]).any(axis=1).at[:, 0].set(True)
            bad_q_B |= (_bad_probabilities(q_BN1V) & read_BN1).any(axis=1)
        q_BN1V = jnp.where(bad_q_B[:, None, None], 1.0 / V, q_BN1V)

        verifier = self.config.tree_verifier_for(sampling)
        one = lambda x: x[None]
        res = jax.vmap(lambda k, t, q, p: jax.tree.map(lambda x: x[0], verifier(k, jax.tree.map(one, t), q[None], p[None])))(
            verify_key_B, draft, q_BN1V, p_BTV)
        fresh_B = _fresh_tokens(sampling, verify_key_B, p_BTV[:, 0], bad_q_B)
        fresh_BA1 = jnp.full((B, A + 1), verify_lib.PAD_TOKEN, jnp.int32).at[:, 0].set(fresh_B)
        n_acc_B = jnp.where(bad_q_B, 0, res.n_accepted_B)
        path_BA = jnp.where(bad_q_B[:, None], -1, res.path_BA)
        committed_BA1 = jnp.where(bad_q_B[:, None], fresh_BA1, res.committed_BA1)
        degenerate_B = jnp.where(bad_q_B, 0, res.degenerate_residual_B)

        # Non-finite logits along the path (root, then the accepted nodes): from the first one on.
        pos_BA1 = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(path_BA, -1) + 1], axis=1)
        bad_path_BA1 = jnp.take_along_axis(bad_p_BT, pos_BA1, axis=1) & (jnp.arange(A + 1)[None] <= n_acc_B[:, None])
        bad_path_BA1 = jnp.cumsum(bad_path_BA1, axis=1) > 0

        def commit_caches(n_commit_B, new_L_B):
            # The root and the committed nodes, in path order, to the committed slots.
            nodes_B = jnp.minimum(n_acc_B, n_commit_B)
            slots_BA = (jnp.full((B, A), -1, jnp.int32) if draft.draft_slots_BN is None else
                        jnp.where(path_BA >= 0, jnp.take_along_axis(draft.draft_slots_BN, jnp.maximum(path_BA, 0), axis=1), -1))
            accepted = trees_lib.AcceptedPath(nodes_BA=path_BA, num_B=nodes_B, draft_slots_BA=slots_BA)
            return target_cache.commit_path(pos_BA1, n_commit_B), self.drafter.commit(draft_state, new_L_B, accepted)

        # A feature head's features: the root's and the accepted nodes' (the path, in block order pos_BA1).
        f_path_BA1F = None if f_BTF is None else jnp.take_along_axis(f_BTF, pos_BA1[..., None], axis=1)
        return self._finish(
            state, tree, committed_BA1=committed_BA1, n_acc_B=n_acc_B, bad_path_BA1=bad_path_BA1, bad_q_B=bad_q_B,
            degenerate_B=degenerate_B, tested_BA=res.tested_BA, tested_accept_BA=res.tested_accept_BA,
            proposed_B=jnp.sum(draft.valid_BN, axis=1), draft_passes=self.drafter.tree_forward_passes(tree),
            scored=N + 1, next_key_B=next_key_B, commit_caches=commit_caches, f_block_BXF=f_path_BA1F)
