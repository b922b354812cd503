"""The round pipeline: one draft-verify round, chain or tree, as the stages the engine's module
doc lists. `RoundPipeline` holds the target, the drafter and the generation config (frozen and
hashable: a static `jax.jit` argument, held by `specjax.decoding.Engine`); its `run` takes a
round strategy (`_strategies`: what differs between a chain and a tree) through one shared
pipeline:

    strategy.propose      draft -> tokens, q, the block's attention layout
    score                 target.apply(root + drafted tokens) -> logits, p    one pass
    _sanitize             non-finite or unusable q (row becomes gamma = 0), p (uniform stand-in)
    _verify               the kind's verifier per row with its own key -> `Verdict`
    _finish               `_truncate` (EOS, max_new_tokens, NaN positions), caches cut to the
                          committed prefix (strategy.commit_caches), tokens, features, metrics
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import models
from specjax import sampling as sampling_lib
from specjax import verify as verify_lib
from specjax.decoding._state import EOS, MAX_TOKENS, NAN_LOGITS, PAD_ID, Commit, EngineParams, LoopState, Metrics
from specjax.decoding._state import _write_block, _write_rows
from specjax.decoding._adaptive import RowBudget, allocate
from specjax.decoding._strategies import Proposal, Verdict, round_strategy
from specjax.drafters import CHAIN_ONLY, Capabilities

P_SUM_TOL = 1e-3
"""How far from 1 a target row's total probability may be before the engine treats the
position like NaN logits. A softmax row sums to 1 up to float32 rounding; only broken
arithmetic (NaN, overflow, all entries -inf) lands outside this."""


def _bad_probabilities(p_XV):
    """True where a distribution row cannot be verified against: a NaN/inf or negative entry,
    or a total probability off 1 by more than `P_SUM_TOL` (0 included: non-normalisable)."""
    total_X = jnp.sum(p_XV, axis=-1)
    return (~jnp.isfinite(p_XV).all(axis=-1) | (p_XV < 0).any(axis=-1)
            | ~(jnp.abs(total_X - 1.0) <= P_SUM_TOL))


def _fresh_tokens(sampling, verify_key_B, p0_BV, bad_q_B):
    """The gamma = 0 outcome for rows whose draft q was not usable: one token from p_0 with the
    row's own key (``fold_in(verify key, 1)``), int32 [B]. Drawn only in rounds where some row
    needs it (a draw over the whole vocabulary per row; rows with a usable q ignore the value,
    so skipping it changes nothing else)."""
    def draw(_):
        if sampling.greedy:
            return sampling_lib.argmax(p0_BV)
        keys_B = jax.vmap(lambda k: jax.random.fold_in(k, 1))(verify_key_B)
        return jax.vmap(sampling_lib.sample)(keys_B, p0_BV).astype(jnp.int32)
    return jax.lax.cond(bad_q_B.any(), draw, lambda _: jnp.zeros(bad_q_B.shape, jnp.int32), None)


def _along(pos_BA1, x_BT):
    """``x_BT``'s entries along the accepted path (block positions ``pos_BA1``; None: the block
    itself, a chain)."""
    if pos_BA1 is None or x_BT is None:
        return x_BT
    return jnp.take_along_axis(x_BT, pos_BA1.reshape(pos_BA1.shape + (1,) * (x_BT.ndim - 2)), axis=1)


@dataclasses.dataclass(frozen=True)
class RoundPipeline:
    """One round for a target, a drafter (None: target-only) and a generation config: `run`."""
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

    def run(self, params: EngineParams, sampling, proposal, state: LoopState, alpha_B=None):
        """One draft-verify round with a static ``proposal`` (a draft length, a row budget or a
        tree) -> (state, Commit, tested_sum_B, tested_n_B): per row, the sum and count of the
        tested acceptances (`_finish`). A row budget hands out the rows' gammas by their
        acceptance estimates ``alpha_B`` (`_adaptive.allocate`; None: the policy's, every row
        alike)."""
        limit_B = None
        if isinstance(proposal, RowBudget):
            if alpha_B is None:
                alpha_B = jnp.broadcast_to(state.policy.alpha_R[0], state.lengths_B.shape)
            limit_B = allocate(proposal, alpha_B, ~state.done_B)
        strategy = round_strategy(proposal, limit_B)
        # Penalties and automata read each position's token history (`specjax.sampling`).
        sampling = sampling.with_history(state.tokens_BS, state.prompt_lengths_B, state.lengths_B,
                                         self.target.vocab_size, state.constraint_B)
        keys_B3 = jax.vmap(lambda k: jax.random.split(k, 3))(state.key_B)
        draft_key_B, verify_key_B, next_key_B = keys_B3[:, 0], keys_B3[:, 1], keys_B3[:, 2]
        prop = strategy.propose(self, params, sampling, state, draft_key_B)
        L_B = state.lengths_B
        last_B = jnp.take_along_axis(state.tokens_BS, (L_B - 1)[:, None], axis=1)[:, 0]
        block_BT = jnp.concatenate([last_B[:, None], prop.tokens_BX], axis=1)
        logits_BTV, f_BTF, target_cache = self.score(params, block_BT, state.target_cache, prop.layout, prop.rows)
        at_block = sampling.at_block(prop.tokens_BX, None if prop.layout is None else prop.draft.parents_BN)
        p_BTV = sampling_lib.probabilities(logits_BTV, at_block)
        p_BTV, q_BXV, bad_p_BT, bad_q_B = self._sanitize(logits_BTV, p_BTV, prop, strategy.spreads_bad_p)
        verdict = self._verify(strategy, prop, sampling, verify_key_B, q_BXV, p_BTV, bad_q_B)

        B, A1 = verdict.committed_BA1.shape
        pos_BA1 = (None if verdict.path_BA is None else
                   jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(verdict.path_BA, -1) + 1], axis=1))
        # Unusable target positions along the path (the root, then the accepted drafts): from
        # the first one on.
        bad_path_BA1 = _along(pos_BA1, bad_p_BT) & (jnp.arange(A1)[None] <= verdict.n_acc_B[:, None])
        bad_path_BA1 = jnp.cumsum(bad_path_BA1, axis=1) > 0

        def commit_caches(n_commit_B, new_L_B):
            return strategy.commit_caches(self, prop, verdict, pos_BA1, target_cache, n_commit_B, new_L_B)

        new_state, commit, tested_sum_B, tested_n_B = self._finish(
            state, proposal, verdict, prop, bad_path_BA1=bad_path_BA1, bad_q_B=bad_q_B,
            next_key_B=next_key_B, commit_caches=commit_caches, f_path_BA1F=_along(pos_BA1, f_BTF),
            scored=block_BT.shape[1] if prop.limit_B is None else prop.limit_B + 1)
        if sampling.fsm_state is not None:
            # each row's automaton state after what it committed (`specjax.sampling`, "Constraints")
            def step(i, s_B):
                return jnp.where(i < commit.n_B, sampling.fsm_step(s_B, commit.tokens_BC[:, i]), s_B)
            s_B = jax.lax.fori_loop(0, commit.tokens_BC.shape[1], step, sampling.fsm_state)
            new_state = new_state.replace(constraint_B=s_B)
        return new_state, commit, tested_sum_B, tested_n_B

    def score(self, params, block_BT, cache, tree=None, rows=None):
        """(logits, features or None, cache) of one target pass over a block; with a padded
        block size (`GenerationConfig.target_block`) the block is padded to it (padding tokens
        repeat the last one; in a tree, padding nodes see only themselves) and the outputs cut
        back to the block's own rows. The cache then holds the padding's entries past the
        committed length, which the round's truncation or path commit leaves as garbage. With
        ``rows`` (`models.PackedRows`, a row-budget round) only the listed positions are
        computed (`GenerationConfig` refuses a padded block size beside row budgets)."""
        T, N = block_BT.shape[1], self.config.target_block
        if rows is not None:
            return self._target_pass(params, block_BT, cache, rows=rows)
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

    def _target_pass(self, params, block_BT, cache, tree=None, rows=None):
        # A model without tree or packing support takes no ``tree`` or ``rows`` argument.
        extra = {k: v for k, v in (("tree", tree), ("rows", rows)) if v is not None}
        if not self.feature_layers:
            out = self.target.apply(params.target, block_BT, cache, **extra)
            return out[0], None, out[1]
        return self.target.apply_with_features(params.target, block_BT, cache, layers=self.feature_layers, **extra)

    def _sanitize(self, logits_BTV, p_BTV, prop: Proposal, spreads_bad_p: bool):
        """Unusable inputs. (a) A draft q that is not finite, or a q row the verifier reads that
        is not a distribution over the vocabulary (a negative entry, or a row that does not sum
        to 1 within `P_SUM_TOL`, e.g. a head whose vocabulary map repeats ids) cannot be
        verified: the row's proposals are discarded, the round commits one token sampled from
        p_0, exactly a gamma = 0 round for that row (`_verify`), and it is counted in
        ``invalid_draft_rounds``. (b) A bad target position -- NaN or +inf logits, or a p the
        verifier could not use (`_bad_probabilities`, e.g. NaN from a temperature that bypassed
        `SamplingConfig.make`) -- gets a uniform p before verifying (with ``spreads_bad_p``, a
        chain's, every later position too); this keeps the verifier's arithmetic finite, nothing
        from those positions is committed and the row stops with NAN_LOGITS there (`_truncate`).
        The rejected q rows get a uniform stand-in too (the verifier's result for them is
        replaced). -> (p, q, bad_p_BT, bad_q_B)."""
        V = self.target.vocab_size
        bad_p_BT = (jnp.isnan(logits_BTV) | jnp.isposinf(logits_BTV)).any(axis=-1)   # -inf is a legal mask
        bad_p_BT = bad_p_BT | _bad_probabilities(p_BTV)
        if spreads_bad_p:
            bad_p_BT = jnp.cumsum(bad_p_BT, axis=1) > 0
        p_BTV = jnp.where(bad_p_BT[..., None], 1.0 / V, p_BTV)
        q_BXV = prop.q_BXV
        bad_q_B = ~jnp.isfinite(q_BXV).all(axis=(1, 2))
        if prop.q_read is not False:
            bad_q_B |= (_bad_probabilities(q_BXV) & prop.q_read).any(axis=1)
        q_BXV = jnp.where(bad_q_B[:, None, None], 1.0 / V, q_BXV)
        return p_BTV, q_BXV, bad_p_BT, bad_q_B

    def _verify(self, strategy, prop: Proposal, sampling, verify_key_B, q_BXV, p_BTV, bad_q_B) -> Verdict:
        """The kind's verifier, vmapped over rows (each with its own key); bad-q rows get the
        gamma = 0 outcome, one token from p_0 with their own key."""
        verifier = strategy.verifier(self.config, sampling)
        one = lambda x: x[None]      # noqa: E731
        res = jax.vmap(lambda k, d, q, p: jax.tree.map(lambda x: x[0], verifier(k, jax.tree.map(one, d), q[None],
                                                                                p[None])))(
            verify_key_B, prop.draft, q_BXV, p_BTV)
        verdict = strategy.verdict(res, prop, q_BXV, p_BTV)
        if p_BTV.shape[1] == 1:      # nothing drafted: no q to reject
            return verdict
        fresh_B = _fresh_tokens(sampling, verify_key_B, p_BTV[:, 0], bad_q_B)
        committed_BA1 = verdict.committed_BA1
        fresh_BA1 = jnp.full_like(committed_BA1, verify_lib.PAD_TOKEN).at[:, 0].set(fresh_B.astype(committed_BA1.dtype))
        return dataclasses.replace(
            verdict, n_acc_B=jnp.where(bad_q_B, 0, verdict.n_acc_B),
            committed_BA1=jnp.where(bad_q_B[:, None], fresh_BA1, committed_BA1),
            degenerate_B=jnp.where(bad_q_B, 0, verdict.degenerate_B),
            path_BA=None if verdict.path_BA is None else jnp.where(bad_q_B[:, None], -1, verdict.path_BA))

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

    def _finish(self, state, proposal, verdict: Verdict, prop: Proposal, *, bad_path_BA1, bad_q_B, scored,
                next_key_B, commit_caches, f_path_BA1F):
        """The end of every round, chain or tree: how many of the verified tokens each row commits
        (`_truncate`), the caches cut to the committed prefix (``commit_caches(n_commit_B,
        new_L_B) -> (target_cache, draft_state)``), the tokens and features written, the
        counters, and the `Commit` -> (state, Commit, tested_sum_B, tested_n_B).

        Per row: the `Verdict` along the accepted path (A = gamma or the tree's depth; its
        ``n_acc_B`` 0 for a bad-q row), ``bad_path_BA1`` the unusable target positions along
        it, ``tested_BA`` / ``tested_accept_BA`` (what adaptive gamma learns from:
        E_{x~q}[min(1, p(x)/q(x))] = sum_x min(p, q), Leviathan et al. 2023, Def. 3.1),
        ``f_path_BA1F`` the target's features along the path (None without a feature head),
        ``scored`` the target positions each row's pass scored (an int, or int [B] in a
        row-budget round)."""
        committed_BA1 = verdict.committed_BA1
        n_commit_B, status_B, done_B, live_B = self._truncate(state, verdict.n_acc_B, committed_BA1, bad_path_BA1)
        L_B = state.lengths_B
        new_L_B = L_B + n_commit_B
        target_cache, draft_state = commit_caches(n_commit_B, new_L_B)

        m = state.metrics
        active_B = ~state.done_B
        drafted_B = live_B & ~bad_q_B
        n_acc_B = jnp.where(drafted_B, verdict.n_acc_B, 0)
        G = self.config.max_gamma
        accepted_at_BG = (jnp.arange(G)[None] < n_acc_B[:, None]) & drafted_B[:, None]
        tested_BA = verdict.tested_BA & drafted_B[:, None]
        metrics = Metrics(
            rounds_B=m.rounds_B + active_B.astype(jnp.int32),
            draft_passes_B=m.draft_passes_B + active_B.astype(jnp.int32) * prop.draft_passes,
            proposed_B=m.proposed_B + jnp.where(drafted_B, prop.proposed_B, 0).astype(jnp.int32),
            accepted_B=m.accepted_B + n_acc_B,
            committed_B=m.committed_B + n_commit_B,
            degenerate_residual_B=m.degenerate_residual_B + jnp.where(live_B, verdict.degenerate_B, 0),
            accepted_at_BG=m.accepted_at_BG + accepted_at_BG.astype(jnp.int32),
            tested_at_BG=m.tested_at_BG + jnp.pad(tested_BA.astype(jnp.int32), ((0, 0), (0, G - tested_BA.shape[1]))),
            gamma_rounds_Z=m.gamma_rounds_Z + self._onehot(proposal),
            invalid_draft_rounds_B=m.invalid_draft_rounds_B + (live_B & bad_q_B).astype(jnp.int32),
            scored_B=m.scored_B + active_B.astype(jnp.int32) * scored,
        )
        tested_sum_B = jnp.sum(jnp.where(tested_BA, verdict.tested_accept_BA, 0.0), axis=1)
        tested_n_B = jnp.sum(tested_BA, axis=1).astype(jnp.int32)

        K = G + 1
        committed_BC = jnp.pad(committed_BA1, ((0, 0), (0, K - committed_BA1.shape[1])), constant_values=PAD_ID)
        new_state = state.replace(
            tokens_BS=_write_rows(state.tokens_BS, committed_BC, L_B, n_commit_B), lengths_B=new_L_B,
            done_B=done_B, status_B=status_B, target_cache=target_cache, draft_state=draft_state,
            key_B=next_key_B, metrics=metrics, round=state.round + 1,
            # The path's features land at its positions L-1 ..; those past the new committed
            # length are garbage until overwritten (never read: see LoopState.features_BSF).
            features_BSF=None if f_path_BA1F is None else _write_block(state.features_BSF, f_path_BA1F, L_B - 1))
        commit = Commit(tokens_BC=jnp.where(jnp.arange(K)[None] < n_commit_B[:, None], committed_BC, PAD_ID),
                        start_B=L_B, n_B=n_commit_B, done_B=done_B)
        return new_state, commit, tested_sum_B, tested_n_B

    def _onehot(self, proposal):
        """Counts one round of this candidate (`Metrics.gamma_rounds_Z`)."""
        return (jnp.arange(len(self.config.gammas)) == self.config.gammas.index(proposal)).astype(jnp.int32)
