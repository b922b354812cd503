"""The engine: target-only and speculative decoding as one frozen object with one round.

`Engine(target, drafter, config)` holds the statics (models, drafter, generation config) and
is hashable, so its methods are jitted with ``self`` static; weights travel as arguments
(`EngineParams`), never as closure constants. Every entry point runs the same `_round`:

    prefill(params, batch)              target cache (and drafter state) -> Prefill   jitted
    init(params, batch, prefill=)       prefill (or take one) -> LoopState          jitted
    step(params, sampling, state)       one round, state donated -> (state, Commit)  jitted
    run(params, sampling, batch)        init + lax.while_loop over step -> GenerateOutput
    stream(params, sampling, batch)     init + step per host call, yields StreamEvents
    round_times(params, sampling, batch)  measured seconds of one round per gamma (adaptive)

One round, in named stages (all on device, no host round trip):

    key_B -> (draft, verify, next) per row              explicit split, every round
    _propose     drafter.propose(context) -> tokens_BG, q_BGV as sampled
    forward      target.apply([last, d_1..d_gamma])  -> p_BG1V, one (gamma+1)-token pass
    _sanitize    non-finite q (round becomes gamma = 0), non-finite p (uniform stand-in)
    _verify      verifier per row with its own key -> n_accepted_B, committed tokens
    _finish      (shared by chain and tree rounds) `_truncate`: EOS, max_new_tokens, NaN
                 positions -> tokens committed, status, done; caches cut to the committed
                 prefix; tokens, features and metrics written; the Commit

Token trees (`gamma` a `specjax.trees.TreeShape` or `DynamicTree`) run `_tree_round`, the same
stages over a tree: the drafter's `propose_tree` drafts one tree per row, the target scores the
root and every node in one pass (`models.TreeBlock`: positions by depth, an ancestor mask),
the tree verifier picks a path, `_finish` cuts it as a linear block, and the accepted path's
K/V move to the committed slots (`KVCache.commit_path`; the drafter's own cache through
`commit(..., accepted)`), so both caches again hold exactly the committed prefix.

Target-only decoding is the same round with gamma = 0 (no draft; the verifier samples the one
committed token from p), so both paths share prefill, logits processing, stopping and
bookkeeping. A row whose target logits hold a NaN (or +inf), or whose target probabilities are
not a usable distribution, at a verified position stops with status NAN_LOGITS and keeps what it
had committed; other rows go on.

Randomness: every row carries its own key (normally `fold_in(key, request_id)`, see
`specjax.decoding.request_keys`), so with a fixed gamma a row's sample does not depend on its
batch position or the batch size. With adaptive gamma the choice of gamma is batch-wide, so
the realised sample (not its distribution, which is always the target's) can depend on the
other rows.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax import calibration, models
from specjax import sampling as sampling_lib
from specjax import trees as trees_lib
from specjax import verify as verify_lib
from specjax.decoding import _adaptive
from specjax.decoding._state import (EOS, MAX_TOKENS, NAN_LOGITS, PAD_ID, RUNNING, Batch, Commit, EngineParams,
                                     GenerateOutput, LoopState, Metrics, Prefill, StreamEvent, _set_rows,
                                     _write_block, _write_rows)
from specjax.drafters import CHAIN_ONLY, Capabilities, DraftContext, Drafter



P_SUM_TOL = 1e-3
"""How far from 1 a target row's total probability may be before the engine treats the
position like NaN logits. A softmax row sums to 1 within a few float32 ulps per 1e4 tokens;
only broken arithmetic (NaN, overflow, all entries -inf) lands outside this."""


def _host(x) -> np.ndarray:
    """A (possibly multi-process, sharded) array's global value on the host."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from specjax import sharding
        return sharding.to_host(x)
    return np.asarray(x)


def _bad_probabilities(p_XV):
    """True where a distribution row cannot be verified against: a NaN/inf or negative entry,
    or a total probability off 1 by more than `P_SUM_TOL` (0 included: non-normalisable)."""
    total_X = jnp.sum(p_XV, axis=-1)
    return (~jnp.isfinite(p_XV).all(axis=-1) | (p_XV < 0).any(axis=-1)
            | ~(jnp.abs(total_X - 1.0) <= P_SUM_TOL))


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Static settings (shapes and strategy choices); numeric sampling knobs live in
    `SamplingConfig` as traced values.

    gamma: what the drafter proposes each round: a draft length (0 = target-only), a token tree
      (`specjax.trees.TreeShape` or `DynamicTree`), or `AdaptiveGamma` for a per-round choice
      among draft lengths and static trees.
    verifier: for linear drafts, 'token' (Leviathan/Chen) or 'block' (Sun et al. 2025).
    tree_verifier: for trees, 'traversal' (Weng et al. 2025) or 'recursive' (SpecInfer's
      recursive rejection sampling, Miao et al. 2024).
    tree_children: how a sampled tree draws the children of a node ('iid', 'without_replacement'
      or 'deterministic' top-k; `specjax.trees.CHILDREN_MODES`); the tree verifier must be exact
      for it. Greedy decoding always drafts deterministic children and uses the greedy verifiers,
      which the others reduce to at temperature 0.
    """
    max_new_tokens: int
    gamma: int | _adaptive.AdaptiveGamma | trees_lib.TreeShape | trees_lib.DynamicTree = 4
    verifier: str = "token"
    eos_ids: tuple[int, ...] = ()
    max_rounds: int | None = None   # safety bound; default max_new_tokens (every round commits >= 1)
    tree_verifier: str = "traversal"
    tree_children: str = "iid"
    prefill_chunk: int | None = models.PREFILL_CHUNK   # prompt tokens per prefill call (None: one call)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.gamma, int) and self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")
        if not isinstance(self.gamma, (int, _adaptive.AdaptiveGamma, trees_lib.TreeShape, trees_lib.DynamicTree)):
            raise ValueError(f"gamma must be an int, an AdaptiveGamma or a tree, got {self.gamma!r}")
        if self.verifier not in verify_lib.verifier_names("chain"):
            raise ValueError(f"verifier must be one of {verify_lib.verifier_names('chain')}, got {self.verifier!r}")
        if self.tree_verifier not in verify_lib.verifier_names("tree"):
            raise ValueError(f"tree_verifier must be one of {verify_lib.verifier_names('tree')}, "
                             f"got {self.tree_verifier!r}")
        if self.tree_children not in trees_lib.CHILDREN_MODES:
            raise ValueError(f"tree_children must be one of {trees_lib.CHILDREN_MODES}, got {self.tree_children!r}")
        if self.has_trees:
            # Fails here, before anything runs, when the verifier is not exact for the children.
            verifier = self._tree_verifier()
            if self.tree_children not in verifier.MODES:
                raise ValueError(f"tree_verifier={self.tree_verifier!r} is not exact for tree_children="
                                 f"{self.tree_children!r} (it supports {verifier.MODES})")

    @property
    def adaptive(self) -> bool:
        return isinstance(self.gamma, _adaptive.AdaptiveGamma)

    @property
    def gammas(self) -> tuple:
        """The candidate proposals: draft lengths and trees (one, unless adaptive)."""
        return self.gamma.gammas if self.adaptive else (self.gamma,)

    @property
    def has_trees(self) -> bool:
        return any(not isinstance(g, int) for g in self.gammas)

    @property
    def max_gamma(self) -> int:
        """The longest run of drafted tokens a round can accept (a chain's gamma, a tree's depth)."""
        return max(g if isinstance(g, int) else g.max_depth for g in self.gammas)

    @property
    def max_block(self) -> int:
        """The most drafted tokens one target pass scores (gamma, or a tree's node count)."""
        return max(g if isinstance(g, int) else g.num_nodes for g in self.gammas)

    def slots_needed(self, prompt_length: int) -> int:
        """Cache slots for a prompt: prompt + max_new_tokens + the largest verification block."""
        return int(prompt_length) + self.max_new_tokens + self.max_block + 1

    def verifier_for(self, sampling: sampling_lib.SamplingConfig) -> verify_lib.Verifier:
        """The chain verifier for this sampling mode (`verify.get_verifier`)."""
        return verify_lib.get_verifier("chain", self.verifier, greedy=sampling.greedy)

    def tree_verifier_for(self, sampling: sampling_lib.SamplingConfig):
        """The tree verifier for this sampling mode (`verify.get_verifier`)."""
        return verify_lib.get_verifier("tree", self.tree_verifier, greedy=sampling.greedy)

    def _tree_verifier(self):
        return verify_lib.get_verifier("tree", self.tree_verifier)


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
class Engine:
    """Target, drafter (None for target-only decoding) and generation config; see the module doc."""
    target: models.DecoderModel
    drafter: Drafter | None
    config: GenerationConfig
    # Optional device mesh ("data", "model" axes, see `specjax.sharding`): the loop state is
    # constrained to it (rows on "data", cache heads on "model"); `place` puts weights and
    # batches on it. Sampling keys are per request, so tokens do not depend on the mesh.
    mesh: Any = None
    rules: Any = None

    def __post_init__(self):
        if self.config.max_gamma > 0 and self.drafter is None:
            raise ValueError("gamma > 0 needs a drafter")
        if self.drafter is not None and self.drafter.vocab_size != self.target.vocab_size:
            raise ValueError(f"vocab mismatch: the drafter has {self.drafter.vocab_size} tokens, the target "
                             f"{self.target.vocab_size}; speculative sampling needs a shared vocabulary")
        caps = self.capabilities
        for g in self.config.gammas:
            if not isinstance(g, int):
                if not caps.trees:
                    raise ValueError(f"the drafter {type(self.drafter).__name__} drafts chains only "
                                     f"(capabilities.trees=False); got the tree {g}")
                self.drafter.check_tree(g)
        if self.feature_layers and not hasattr(self.target, "apply_with_features"):
            raise ValueError(f"the drafter reads the target's hidden features (layers {self.feature_layers}) "
                             f"but the target model {type(self.target).__name__} cannot return them")

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
        context = DraftContext(tokens_BL=state.tokens_BL, lengths_B=state.lengths_B, target_cache=state.target_cache,
                               features=state.features_BLF, active_B=~state.done_B)
        regime_B = self.drafter.regime_B(context).astype(jnp.int32)
        return _adaptive.batch_regime(regime_B, ~state.done_B), regime_B

    def _target_forward(self, params, block_BT, cache, tree=None):
        """(logits, features or None, cache) of one target pass over a block."""
        if not self.feature_layers:
            # A model without tree support takes no ``tree`` argument (chains only).
            out = (self.target.apply(params.target, block_BT, cache) if tree is None
                   else self.target.apply(params.target, block_BT, cache, tree=tree))
            return out[0], None, out[1]
        return self.target.apply_with_features(params.target, block_BT, cache, tree=tree, layers=self.feature_layers)

    # ------------------------------------------------------------------ stages of one round

    def _propose(self, params, state: LoopState, key_B, gamma, sampling):
        B = state.tokens_BL.shape[0]
        if gamma == 0:
            return (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, self.target.vocab_size), jnp.float32),
                    state.draft_state)
        context = DraftContext(tokens_BL=state.tokens_BL, lengths_B=state.lengths_B,
                               target_cache=state.target_cache, features=state.features_BLF, active_B=~state.done_B)
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

    def _finish(self, state, choice, *, committed_BD1, n_acc_B, bad_path_BD1, bad_q_B, degenerate_B, tested_BD,
                tested_accept_BD, proposed_B, draft_passes, scored, next_key_B, commit_caches, f_block_BXF):
        """The end of every round, chain or tree: how many of the verified tokens each row commits
        (`_truncate`), the caches cut to the committed prefix (``commit_caches(n_commit_B,
        new_L_B) -> (target_cache, draft_state)``), the tokens and features written, the
        counters, and the `Commit` -> (state, Commit, tested_sum_B, tested_n_B).

        Per row: ``committed_BD1`` the verifier's tokens along the accepted path (D = gamma or
        the tree's depth), ``n_acc_B`` its accepted drafts (0 for a bad-q row), ``bad_path_BD1``
        the unusable target positions along it (`_sanitize`), ``tested_BD`` /
        ``tested_accept_BD`` which draft positions reached verification and their acceptance
        probability min(1, p/q) (what adaptive gamma learns from: E_{x~q}[min(1, p(x)/q(x))] =
        sum_x min(p, q), Leviathan et al. 2023, Def. 3.1), ``proposed_B`` the drafted tokens,
        ``f_block_BXF`` the target's features along the path (None without a feature head)."""
        n_commit_B, status_B, done_B, live_B = self._truncate(state, n_acc_B, committed_BD1, bad_path_BD1)
        L_B = state.lengths_B
        new_L_B = L_B + n_commit_B
        target_cache, draft_state = commit_caches(n_commit_B, new_L_B)

        m = state.metrics
        active_B = ~state.done_B
        drafted_B = live_B & ~bad_q_B
        n_acc_B = jnp.where(drafted_B, n_acc_B, 0)
        G = self.config.max_gamma
        accepted_at_BG = (jnp.arange(G)[None] < n_acc_B[:, None]) & drafted_B[:, None]
        tested_BD = tested_BD & drafted_B[:, None]
        metrics = Metrics(
            rounds_B=m.rounds_B + active_B.astype(jnp.int32),
            draft_passes_B=m.draft_passes_B + active_B.astype(jnp.int32) * draft_passes,
            proposed_B=m.proposed_B + jnp.where(drafted_B, proposed_B, 0).astype(jnp.int32),
            accepted_B=m.accepted_B + n_acc_B,
            committed_B=m.committed_B + n_commit_B,
            degenerate_residual_B=m.degenerate_residual_B + jnp.where(live_B, degenerate_B, 0),
            accepted_at_BG=m.accepted_at_BG + accepted_at_BG.astype(jnp.int32),
            tested_at_BG=m.tested_at_BG + jnp.pad(tested_BD.astype(jnp.int32), ((0, 0), (0, G - tested_BD.shape[1]))),
            gamma_rounds_K=m.gamma_rounds_K + self._onehot(choice),
            invalid_draft_rounds_B=m.invalid_draft_rounds_B + (live_B & bad_q_B).astype(jnp.int32),
            scored_B=m.scored_B + active_B.astype(jnp.int32) * scored,
        )
        tested_sum_B = jnp.sum(jnp.where(tested_BD, tested_accept_BD, 0.0), axis=1)
        tested_n_B = jnp.sum(tested_BD, axis=1).astype(jnp.int32)

        K = G + 1
        committed_BK = jnp.pad(committed_BD1, ((0, 0), (0, K - committed_BD1.shape[1])), constant_values=PAD_ID)
        new_state = state.replace(
            tokens_BL=_write_rows(state.tokens_BL, committed_BK, L_B, n_commit_B), lengths_B=new_L_B,
            done_B=done_B, status_B=status_B, target_cache=target_cache, draft_state=draft_state,
            key_B=next_key_B, metrics=metrics, round=state.round + 1,
            # The path's features land at its positions L-1 ..; those past the new committed
            # length are garbage until overwritten (never read: see LoopState.features_BLF).
            features_BLF=None if f_block_BXF is None else _write_block(state.features_BLF, f_block_BXF, L_B - 1))
        commit = Commit(tokens_BK=jnp.where(jnp.arange(K)[None] < n_commit_B[:, None], committed_BK, PAD_ID),
                        start_B=L_B, n_B=n_commit_B, done_B=done_B)
        return new_state, commit, tested_sum_B, tested_n_B

    def _onehot(self, proposal):
        """Counts one round of this candidate (`Metrics.gamma_rounds_K`)."""
        return (jnp.arange(len(self.config.gammas)) == self.config.gammas.index(proposal)).astype(jnp.int32)

    def _round(self, params: EngineParams, sampling, gamma, state: LoopState):
        """One draft-verify round with a static gamma or tree -> (state, Commit, tested_sum_B,
        tested_n_B): per row, the sum and count of the tested acceptances (see `_finish`)."""
        if not isinstance(gamma, int):
            return self._tree_round(params, sampling, gamma, state)
        keys_B3 = jax.vmap(lambda k: jax.random.split(k, 3))(state.key_B)
        draft_key_B, verify_key_B, next_key_B = keys_B3[:, 0], keys_B3[:, 1], keys_B3[:, 2]
        L_B = state.lengths_B
        last_B = jnp.take_along_axis(state.tokens_BL, (L_B - 1)[:, None], axis=1)[:, 0]

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
            state, gamma, committed_BD1=res.committed_BG1, n_acc_B=res.n_accepted_B, bad_path_BD1=bad_p_BG1,
            bad_q_B=bad_q_B, degenerate_B=res.degenerate_residual_B,
            tested_BD=jnp.arange(gamma)[None] <= res.n_accepted_B[:, None],
            tested_accept_BD=jnp.minimum(1.0, px_BG / jnp.maximum(qx_BG, 1e-30)), proposed_B=gamma,
            draft_passes=0 if gamma == 0 else self.drafter.forward_passes(gamma), scored=gamma + 1,
            next_key_B=next_key_B, commit_caches=commit_caches, f_block_BXF=f_BG1F)

    # ------------------------------------------------------------------ tree rounds

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
        D = tree.max_depth
        last_B = jnp.take_along_axis(state.tokens_BL, (L_B - 1)[:, None], axis=1)[:, 0]
        context = DraftContext(tokens_BL=state.tokens_BL, lengths_B=L_B, target_cache=state.target_cache,
                               features=state.features_BLF, active_B=~state.done_B)
        draft, q_BN1V, draft_state = self.drafter.propose_tree(
            params.draft, state.draft_state, context, draft_key_B, tree, sampling, self.config.tree_children)
        N = draft.num_nodes

        block_BT = jnp.concatenate([last_B[:, None], draft.tokens_BN], axis=1)
        visible_BTT = trees_lib.ancestor_mask(draft.parents_BN, draft.valid_BN, D)
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
        fresh_BD1 = jnp.full((B, D + 1), verify_lib.PAD_TOKEN, jnp.int32).at[:, 0].set(fresh_B)
        n_acc_B = jnp.where(bad_q_B, 0, res.n_accepted_B)
        path_BD = jnp.where(bad_q_B[:, None], -1, res.path_BD)
        committed_BD1 = jnp.where(bad_q_B[:, None], fresh_BD1, res.committed_BD1)
        degenerate_B = jnp.where(bad_q_B, 0, res.degenerate_residual_B)

        # Non-finite logits along the path (root, then the accepted nodes): from the first one on.
        pos_BD1 = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(path_BD, -1) + 1], axis=1)
        bad_path_BD1 = jnp.take_along_axis(bad_p_BT, pos_BD1, axis=1) & (jnp.arange(D + 1)[None] <= n_acc_B[:, None])
        bad_path_BD1 = jnp.cumsum(bad_path_BD1, axis=1) > 0

        def commit_caches(n_commit_B, new_L_B):
            # The root and the committed nodes, in path order, to the committed slots.
            nodes_B = jnp.minimum(n_acc_B, n_commit_B)
            slots_BD = (jnp.full((B, D), -1, jnp.int32) if draft.draft_slots_BN is None else
                        jnp.where(path_BD >= 0, jnp.take_along_axis(draft.draft_slots_BN, jnp.maximum(path_BD, 0), axis=1), -1))
            accepted = trees_lib.AcceptedPath(nodes_BD=path_BD, num_B=nodes_B, draft_slots_BD=slots_BD)
            return target_cache.commit_path(pos_BD1, n_commit_B), self.drafter.commit(draft_state, new_L_B, accepted)

        # A feature head's features: the root's and the accepted nodes' (the path, in block order pos_BD1).
        f_path_BD1F = None if f_BTF is None else jnp.take_along_axis(f_BTF, pos_BD1[..., None], axis=1)
        return self._finish(
            state, tree, committed_BD1=committed_BD1, n_acc_B=n_acc_B, bad_path_BD1=bad_path_BD1, bad_q_B=bad_q_B,
            degenerate_B=degenerate_B, tested_BD=res.tested_BD, tested_accept_BD=res.tested_accept_BD,
            proposed_B=jnp.sum(draft.valid_BN, axis=1), draft_passes=self.drafter.tree_forward_passes(tree),
            scored=N + 1, next_key_B=next_key_B, commit_caches=commit_caches, f_block_BXF=f_path_BD1F)

    def _step(self, params, sampling, state):
        """One round, with gamma fixed or chosen by the adaptive policy."""
        if not self.config.adaptive:
            state, commit, _, _ = self._round(params, sampling, self.config.gamma, state)
            return self._constrain(state), commit
        chosen, probe, regime, regime_B = self._choose(state)
        branches = [functools.partial(self._policy_round, params, sampling, g, chosen, probe, regime, regime_B)
                    for g in self.config.gamma.gammas]
        return jax.lax.switch(chosen, branches, state)

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

    def _prefill(self, params, prompt_BP, prompt_lengths_B, capacity, with_draft=True):
        """(target cache, drafter state or None) after the prompts: every prompt token but the
        last enters the caches (the last is the first round's input)."""
        B = prompt_BP.shape[0]
        # The barrier keeps XLA from constant-folding the prefill over an all-zeros cache (it
        # otherwise spends tens of seconds of compile time folding attention over constants).
        cache = jax.lax.optimization_barrier(self.target.init_cache(B, capacity))
        layers = self.feature_layers or None
        out = models.prefill(self.target, params.target, prompt_BP, cache, prompt_lengths_B - 1,
                             self.config.prefill_chunk, start_bound=0, feature_layers=layers)
        cache, f_BPF = out if layers else (out, None)
        features_BLF = (None if f_BPF is None else
                        jnp.zeros((B, capacity, f_BPF.shape[-1]), f_BPF.dtype).at[:, :prompt_BP.shape[1]].set(f_BPF))
        draft_state = (self._drafter_init(params, prompt_BP, prompt_lengths_B, capacity, f_BPF)
                       if with_draft and self.config.max_gamma > 0 else None)
        return cache, draft_state, features_BLF

    def _drafter_init(self, params, prompt_BP, prompt_lengths_B, capacity, f_BPF):
        if self.feature_layers:
            return self.drafter.init(params.draft, prompt_BP, prompt_lengths_B, capacity, features_BPF=f_BPF)
        return self.drafter.init(params.draft, prompt_BP, prompt_lengths_B, capacity)

    def _init(self, params, prompt_BP, prompt_lengths_B, key_B, round_time_RG, capacity, pre=None):
        """The loop state after prefill; ``pre`` = (target cache, drafter state or None) from
        `prefill` skips the target's prefill (and the drafter's, when its state is given)."""
        B, P = prompt_BP.shape
        tokens_BL = jnp.full((B, capacity), PAD_ID, jnp.int32).at[:, :P].set(prompt_BP)
        if pre is None:
            cache, draft_state, features_BLF = self._prefill(params, prompt_BP, prompt_lengths_B, capacity)
        else:
            cache, draft_state, features_BLF = pre
            if self.config.max_gamma == 0:
                draft_state = None
            elif draft_state is None:
                f_BPF = None if features_BLF is None else features_BLF[:, :P]
                draft_state = self._drafter_init(params, prompt_BP, prompt_lengths_B, capacity, f_BPF)
            if not self.feature_layers:
                features_BLF = None
        policy = _adaptive.init_policy(self.config.gamma, round_time_RG) if self.config.adaptive else None
        return self._constrain(LoopState(tokens_BL=tokens_BL, lengths_B=prompt_lengths_B, prompt_lengths_B=prompt_lengths_B,
                         done_B=jnp.zeros((B,), bool), status_B=jnp.zeros((B,), jnp.int32), target_cache=cache,
                         draft_state=draft_state, key_B=key_B,
                         metrics=Metrics.zeros(B, self.config.max_gamma, len(self.config.gammas)),
                         policy=policy, round=jnp.int32(0), features_BLF=features_BLF))

    def _constrain(self, state):
        """The loop state pinned to the mesh (identity without one; `sharding.constrain_loop_state`)."""
        if self.mesh is None:
            return state
        from specjax import sharding
        return sharding.constrain_loop_state(state, self.mesh, self.rules or sharding.DEFAULT_RULES)

    def place(self, params: "EngineParams", batch: "Batch") -> tuple["EngineParams", "Batch"]:
        """Weights and batch on this engine's mesh (`place_params`, `place_batch`)."""
        return self.place_params(params), self.place_batch(batch)

    def place_params(self, params: "EngineParams") -> "EngineParams":
        """A Llama target's (and a model draft's) parameters by the logical-axis rules, other
        drafter weights (heads, n-gram: none) replicated (`sharding.place_weights`)."""
        if self.mesh is None:
            raise ValueError("Engine.place needs an engine built with mesh=")
        from specjax import sharding
        rules = self.rules or sharding.DEFAULT_RULES
        draft_model = getattr(self.drafter, "model", None)
        return EngineParams(target=sharding.place_weights(self.target, params.target, self.mesh, rules),
                            draft=sharding.place_weights(draft_model, params.draft, self.mesh, rules))

    def place_batch(self, batch: "Batch") -> "Batch":
        """The batch's rows over the mesh's batch axes (`sharding.place_rows`)."""
        if self.mesh is None:
            raise ValueError("Engine.place needs an engine built with mesh=")
        from specjax import sharding
        prompt, lengths, keys = sharding.place_rows((batch.prompt_BP, batch.prompt_lengths_B, batch.key_B),
                                                    self.mesh, self.rules or sharding.DEFAULT_RULES)
        return Batch(prompt, lengths, keys, batch.capacity)

    def _run(self, params, sampling, prompt_BP, prompt_lengths_B, key_B, round_time_RG, capacity, pre=None):
        state = self._init(params, prompt_BP, prompt_lengths_B, key_B, round_time_RG, capacity=capacity, pre=pre)
        max_rounds = self.config.max_rounds or self.config.max_new_tokens

        def cond(s):
            return (~jnp.all(s.done_B)) & (s.round < max_rounds)

        policy = self.config.gamma if self.config.adaptive else None
        if policy is None or not _adaptive._is_zero(policy.gammas[0]) or len(policy.gammas) == 1:
            state = jax.lax.while_loop(cond, lambda s: self._step(params, sampling, s)[0], state)
            return GenerateOutput.from_state(state)

        # Adaptive gamma with gamma 0 among the choices: the rounds the policy runs at gamma 0
        # go through an inner loop of plain gamma-0 rounds, and only the others through the
        # `lax.switch` of `_step`. The same rounds in the same order (same keys, same policy
        # updates), but a switch carrying the caches costs more per round than a plain round
        # under the main command's XLA options (its copies; experiments/bench_speed/
        # results/2026-12-02-head-intel-xeon/NOTES.md), and most rounds of a draft that does
        # not pay are at gamma 0.
        def zero_cond(s):
            return cond(s) & (self._choose(s)[0] == 0)

        def zero_round(s):
            regime, regime_B = self._regime(s)
            return self._policy_round(params, sampling, 0, jnp.int32(0), jnp.zeros((), bool), regime, regime_B, s)[0]

        def body(s):
            s = jax.lax.while_loop(zero_cond, zero_round, s)
            # Then one round at the gamma the policy chooses now (not 0: a probe or a better
            # gamma), as `_step` runs it, or nothing when the loop has ended (branch 0).
            chosen, probe, regime, regime_B = self._choose(s)
            branches = [lambda s: s] + [
                lambda s, g=g: self._policy_round(params, sampling, g, chosen, probe, regime, regime_B, s)[0]
                for g in policy.gammas]
            return jax.lax.switch(jnp.where(cond(s), chosen + 1, 0), branches, s)

        state = jax.lax.while_loop(cond, body, state)
        return GenerateOutput.from_state(state)

    def _refill(self, params, state: LoopState, slot, prompt_1P, prompt_lengths_1, key_1):
        """The state with row ``slot`` (traced) holding a fresh request: its prompt prefilled into
        that row of the target cache (and the drafter's state, and the features), its tokens,
        lengths, status, key and per-row counters reset; other rows and the batch-wide entries
        (adaptive policy, round, gamma_rounds_K) untouched."""
        capacity = state.tokens_BL.shape[1]
        P = prompt_1P.shape[1]
        cache_1, draft_1, features_1 = self._prefill(params, prompt_1P, prompt_lengths_1, capacity)
        row = lambda big, one: None if one is None else _set_rows(big, one, slot)    # noqa: E731
        set_at = lambda x_B, v: x_B.at[slot].set(v)                                    # noqa: E731
        m = state.metrics
        metrics = m.replace(**{f.name: getattr(m, f.name).at[slot].set(0) for f in dataclasses.fields(m)
                               if f.name != "gamma_rounds_K"})       # the batch-wide count stays
        return self._constrain(state.replace(
            tokens_BL=row(state.tokens_BL, jnp.full((1, capacity), PAD_ID, jnp.int32).at[:, :P].set(prompt_1P)),
            lengths_B=set_at(state.lengths_B, prompt_lengths_1[0]),
            prompt_lengths_B=set_at(state.prompt_lengths_B, prompt_lengths_1[0]),
            done_B=set_at(state.done_B, False), status_B=set_at(state.status_B, RUNNING),
            target_cache=row(state.target_cache, cache_1),
            draft_state=row(state.draft_state, draft_1) if self.config.max_gamma > 0 else state.draft_state,
            key_B=row(state.key_B, key_1), metrics=metrics,
            features_BLF=row(state.features_BLF, features_1) if self.feature_layers else state.features_BLF))

    # ------------------------------------------------------------------ compiled entry points

    _prefill_jit = functools.partial(jax.jit, static_argnums=0, static_argnames=("capacity", "with_draft"))(_prefill)
    _init_jit = functools.partial(jax.jit, static_argnums=0, static_argnames="capacity")(_init)
    _run_jit = functools.partial(jax.jit, static_argnums=0, static_argnames="capacity")(_run)
    _step_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames="state")(_step)

    def _steps(self, params, sampling, state, n: int):
        return jax.lax.scan(lambda s, _: self._step(params, sampling, s), state, None, length=n)

    _steps_jit = functools.partial(jax.jit, static_argnums=(0, 4), donate_argnames="state")(_steps)
    _round_jit = functools.partial(jax.jit, static_argnums=(0, 3), donate_argnames="state")(_round)
    _chosen_round_jit = functools.partial(jax.jit, static_argnums=(0, 3), donate_argnames="state")(_chosen_round)
    _first_choice_jit = functools.partial(jax.jit, static_argnums=0)(_first_choice)
    _refill_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames="state")(_refill)

    def _round_time_RG(self, round_time_s):
        """[regimes, gammas] round times for the policy (`calibration.round_time_table`)."""
        return jnp.asarray(calibration.round_time_table(round_time_s, self.config.gammas, self.regimes))

    def _check(self, batch: Batch):
        """Host-side checks of a batch against this engine before anything runs: XLA clamps
        out-of-range gathers and writes silently, so a bad length, id or capacity would
        otherwise give wrong tokens without an error."""
        prompt_BP, lengths_B = _host(batch.prompt_BP), _host(batch.prompt_lengths_B)
        B, P = prompt_BP.shape
        if lengths_B.shape != (B,) or lengths_B.min() < 1 or lengths_B.max() > P:
            raise ValueError(f"prompt lengths must be one per row in [1, {P}] (the padded width), got {lengths_B}")
        V = self.target.vocab_size
        valid_BP = np.arange(P)[None, :] < lengths_B[:, None]
        bad_B = (valid_BP & ((prompt_BP < 0) | (prompt_BP >= V))).any(axis=1)
        if bad_B.any():
            b = int(np.argmax(bad_B))
            row = prompt_BP[b, :lengths_B[b]]
            raise ValueError(f"prompt {b} has token ids outside [0, {V}) (the target's vocabulary): "
                             f"min {row.min()}, max {row.max()}")
        # The target's context length: every committed token's position must be one the model
        # is defined for, prompt + max_new_tokens <= max_position. Drafted tokens scored past
        # the end (up to a verification block) are scratch whose outputs are discarded.
        context = getattr(getattr(self.target, "config", None), "max_position", None)
        longest = int(lengths_B.max())
        if context is not None and longest >= context:
            b = int(lengths_B.argmax())
            raise ValueError(f"prompt {b} is too long: {longest} tokens, the target's context length is {context} "
                             f"(no position is left for a new token); shorten it to at most {context - 1} tokens")
        if context is not None and longest + self.config.max_new_tokens > context:
            b = int(lengths_B.argmax())
            raise ValueError(
                f"prompt {b} has {longest} tokens and max_new_tokens={self.config.max_new_tokens}: "
                f"{longest + self.config.max_new_tokens} positions exceed the target's context length "
                f"{context} (verification block of {self.config.max_block + 1} not counted; it is scratch). "
                f"Shorten the prompt or use max_new_tokens <= {max(context - longest, 0)}.")
        need = self.config.slots_needed(longest)
        if need > batch.capacity:
            raise models.CacheCapacityError(
                f"cache capacity {batch.capacity} is too small: the longest prompt has {int(lengths_B.max())} "
                f"tokens, max_new_tokens={self.config.max_new_tokens} and a verification block of "
                f"gamma+1={self.config.max_gamma + 1} need {need} slots. Raise the capacity or shorten the prompt.")
        if P > batch.capacity:
            raise models.CacheCapacityError(f"padded prompt width {P} exceeds the cache capacity {batch.capacity}")

    def check(self, batch: Batch) -> None:
        """Raise ValueError / `CacheCapacityError` for a batch this engine cannot run (see `_check`)."""
        self._check(batch)

    def prefill(self, params: EngineParams, batch: Batch) -> Prefill:
        """The batch's prompts in the target's cache (and the drafter's state): pass it as
        ``prefill=`` to `init` / `run` / `stream` / `round_times` of this engine or of another
        with the same target (e.g. `Generator.target_only`), so a prompt is prefilled once."""
        self._check(batch)
        cache, draft_state, features_BLF = self._prefill_jit(params, batch.prompt_BP, batch.prompt_lengths_B,
                                                             capacity=batch.capacity, with_draft=True)
        return Prefill(batch=batch, target=self.target,
                       drafter=self.drafter if self.config.max_gamma > 0 else None,
                       target_cache=cache, draft_state=draft_state, features_BLF=features_BLF)

    def _pre(self, batch: Batch, prefill: Prefill | None):
        """(target cache, drafter state or None) of a `Prefill` checked against this engine and
        batch, or None (prefill inside the run)."""
        if prefill is None:
            return None
        if prefill.target != self.target:
            raise ValueError("this prefill was made with a different target model than the engine's")
        b = prefill.batch
        if b is not batch and (b.capacity != batch.capacity
                               or np.shape(b.prompt_BP) != np.shape(batch.prompt_BP)
                               or not np.array_equal(_host(b.prompt_BP), _host(batch.prompt_BP))
                               or not np.array_equal(_host(b.prompt_lengths_B), _host(batch.prompt_lengths_B))):
            raise ValueError("this prefill was made for a different batch (prompts, lengths or capacity differ); "
                             "make one with engine.prefill(params, batch) for this batch")
        same_drafter = prefill.drafter is not None and prefill.drafter == self.drafter
        if self.feature_layers and (prefill.features_BLF is None or not same_drafter):
            raise ValueError("this prefill was not made for this engine's feature head (it holds no target "
                             "features, or features for another drafter): make it with this engine's prefill "
                             "(or let the run prefill)")
        return prefill.target_cache, (prefill.draft_state if same_drafter else None), prefill.features_BLF

    def init(self, params: EngineParams, batch: Batch, round_time_s=None, prefill: Prefill | None = None) -> LoopState:
        """Prefill the target (and the drafter) on the batch, or take ``prefill``: the state
        `step` advances."""
        self._check(batch)
        return self._init_jit(params, batch.prompt_BP, batch.prompt_lengths_B, batch.key_B,
                              self._round_time_RG(round_time_s), capacity=batch.capacity,
                              pre=self._pre(batch, prefill))

    def step(self, params: EngineParams, sampling, state: LoopState) -> tuple[LoopState, Commit]:
        """One round; ``state`` is donated (its buffers are updated in place, do not reuse it)."""
        return self._step_jit(params, sampling, state)

    def steps(self, params: EngineParams, sampling, state: LoopState, n: int) -> tuple[LoopState, Commit]:
        """`n` rounds in one jitted call (one host round trip instead of `n`): the same rounds as
        `n` calls of `step`, their commits stacked on a leading axis ([n, B, ...]); a row that is
        done commits nothing in the later ones. ``state`` is donated."""
        if n < 1:
            raise ValueError(f"steps: n must be >= 1, got {n}")
        return self._steps_jit(params, sampling, state, int(n))

    def run(self, params: EngineParams, sampling, batch: Batch, round_time_s=None,
            prefill: Prefill | None = None) -> GenerateOutput:
        """The whole generation in one jitted `lax.while_loop`, fully on device."""
        self._check(batch)
        return self._run_jit(params, sampling, batch.prompt_BP, batch.prompt_lengths_B, batch.key_B,
                             self._round_time_RG(round_time_s), capacity=batch.capacity,
                             pre=self._pre(batch, prefill))

    def stream(self, params: EngineParams, sampling, batch: Batch, round_time_s=None,
               prefill: Prefill | None = None, precompile: bool = False) -> Iterator[StreamEvent]:
        """Yields each round's committed tokens per row with host timestamps; only the round's
        `Commit` is copied to the host. The last event carries the `GenerateOutput`. Times
        count from the call (prefill included, unless ``prefill`` was made beforehand).

        Under adaptive gamma the policy's choice comes back with each commit and the host
        dispatches the chosen round, compiled on its own (`_chosen_round`): the same rounds
        as `step` and `run`, without `step`'s switch over every candidate. Each candidate's
        round compiles when first chosen, in the middle of the stream; ``precompile`` compiles
        them all before the first round instead (each runs once on a copy of the initial
        state, so the state's memory is briefly held twice), so compilation lands in the time
        to the first token, not between tokens."""
        t0 = time.perf_counter()
        state = self.init(params, batch, round_time_s, prefill=prefill)
        max_rounds = self.config.max_rounds or self.config.max_new_tokens
        if self.config.adaptive and precompile:
            for i in range(len(self.config.gammas)):
                jax.block_until_ready(self._chosen_round_jit(params, sampling, i, jax.tree.map(jnp.copy, state)))
        index = int(jax.device_get(self._first_choice_jit(state))) if self.config.adaptive else None
        for r in range(1, max_rounds + 1):
            if index is None:
                state, commit = self.step(params, sampling, state)
            else:
                state, commit = self._chosen_round_jit(params, sampling, index, state)
            c = jax.device_get(commit)
            index = None if c.next_index is None else int(c.next_index)
            new_tokens = [c.tokens_BK[b, :c.n_B[b]].tolist() for b in range(c.n_B.shape[0])]
            last = bool(np.all(c.done_B)) or r == max_rounds
            yield StreamEvent(round=r, new_tokens=new_tokens, done=[bool(d) for d in c.done_B],
                              elapsed_s=time.perf_counter() - t0,
                              output=GenerateOutput.from_state(state) if last else None)
            if last:
                return

    # ------------------------------------------------------------------ slots (continuous batching)

    def empty_state(self, params: EngineParams, slots: int, capacity: int, round_time_s=None,
                    key: jax.Array | None = None) -> LoopState:
        """A loop state of ``slots`` empty rows (done, holding a one-token placeholder) for
        `refill`: the start of a slot-refilling scheduler (`specjax.serving`). `step` on it
        commits nothing until a row is refilled; done rows cost a round like active ones.
        ``key``: of the kind the requests' keys will be (a typed `jax.random.key`, the default,
        or a legacy uint32 `PRNGKey`); refills must match it."""
        key = jax.random.key(0) if key is None else key
        placeholder = Batch(prompt_BP=jnp.zeros((slots, 1), jnp.int32), prompt_lengths_B=jnp.ones((slots,), jnp.int32),
                            key_B=jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(slots)),
                            capacity=int(capacity))
        if self.mesh is not None:
            placeholder = self.place_batch(placeholder)
        state = self.init(params, placeholder, round_time_s)
        return state.replace(done_B=jnp.ones_like(state.done_B))

    def refill(self, params: EngineParams, state: LoopState, slot: int, prompt: Batch) -> LoopState:
        """Row ``slot`` of ``state`` replaced by the one-row request ``prompt`` (a `Batch` of one
        row with the state's capacity, its key the request's own): its prompt is prefilled into
        that row while the other rows keep their caches and progress. ``state`` is donated.
        With a fixed gamma the row then decodes as the request would alone (same key, same
        tokens, up to float rounding that depends on the batch shape: a greedy near-tie or a
        uniform draw at a CDF boundary can flip); the request's checks (ids, context length,
        capacity) run first."""
        capacity = int(state.tokens_BL.shape[1])
        if np.shape(prompt.prompt_BP)[0] != 1:
            raise ValueError(f"refill takes a one-row batch, got {np.shape(prompt.prompt_BP)[0]} rows")
        if prompt.capacity != capacity:
            raise ValueError(f"refill: the request's capacity {prompt.capacity} differs from the state's {capacity}")
        if not 0 <= int(slot) < state.lengths_B.shape[0]:
            raise ValueError(f"slot {slot} outside [0, {state.lengths_B.shape[0]})")
        self._check(prompt)
        return self._refill_jit(params, state, jnp.int32(slot), prompt.prompt_BP, prompt.prompt_lengths_B,
                                prompt.key_B)

    def round_times(self, params: EngineParams, sampling, batch: Batch, repeats: int = 5,
                    prefill: Prefill | None = None) -> list[float]:
        """Median wall time of one round for each gamma in `config.gammas`, on this batch; for a
        drafter with several regimes (`regimes`), for each (regime, gamma), regime-major, each
        regime timed with the drafter held to it (``drafter.for_regime(r)``).

        Feeds adaptive gamma (``round_time_s=``); run once per model pair and machine. Each
        gamma is compiled and warmed up first. Rounds run as in the loop: the state is donated
        (caches updated in place) and each round continues from the previous one's state, so a
        timed round does exactly the work of a round of `run` (rows that finish keep running
        masked, at the same cost; the capacity check of `init` covers every round's writes)."""
        if self.regimes > 1:
            out = []
            for r in range(self.regimes):
                held = self.drafter.for_regime(r)      # same state and weights as the drafter's
                pre = (prefill if prefill is None or prefill.drafter != self.drafter
                       else dataclasses.replace(prefill, drafter=held))
                out += dataclasses.replace(self, drafter=held)._time_rounds(params, sampling, batch, repeats, pre)
            return out
        return self._time_rounds(params, sampling, batch, repeats, prefill)

    def _time_rounds(self, params, sampling, batch, repeats, prefill):
        state = self.init(params, batch, prefill=prefill)
        out = []
        for g in self.config.gammas:
            state = jax.block_until_ready(self._round_jit(params, sampling, g, state)[0])
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                state = jax.block_until_ready(self._round_jit(params, sampling, g, state)[0])
                ts.append(time.perf_counter() - t0)
            out.append(float(np.median(ts)))
        return out
