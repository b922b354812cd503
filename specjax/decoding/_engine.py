"""The engine: target-only and speculative decoding as one frozen object with one round.

`Engine(target, drafter, config)` holds the statics (models, drafter, generation config) and
is hashable, so its methods are jitted with ``self`` static; weights travel as arguments
(`EngineParams`), never as closure constants. Every entry point runs the same round, that of
the `RoundPipeline` the engine holds (``engine.pipeline``):

    prefill(params, batch)              target cache (and drafter state) -> Prefill   jitted
    init(params, batch, prefill=)       prefill (or take one) -> LoopState          jitted
    step(params, sampling, state)       one round, state donated -> (state, Commit)  jitted
    run(params, sampling, batch)        init + lax.while_loop over step -> GenerateOutput
    stream(params, sampling, batch)     init + step per host call, yields StreamEvents
    round_times(params, sampling, batch)  measured seconds of one round per gamma (adaptive)

Modules: the round pipeline (`_round`) and its chain and tree strategies (`_strategies`), the
prefill (`_prefill`), the loop state and outputs (`_state`), slot refilling (`_slots`), round
timing (`_timing`), the adaptive policy (`_adaptive`); placement on a mesh is
`specjax.sharding`'s, round-time tables `specjax.calibration`'s.

One round, in named stages (all on device, no host round trip):

    key_B -> (draft, verify, next) per row              explicit split, every round
    propose      the strategy (chain or tree) drafts -> tokens, q as sampled
    score        target.apply([last, drafted tokens]) -> p, one pass
    _sanitize    unusable q (round becomes gamma = 0), non-finite p (uniform stand-in)
    _verify      the kind's verifier per row with its own key -> accepted path, committed tokens
    _finish      (shared by chain and tree rounds) `_truncate`: EOS, max_new_tokens, NaN
                 positions -> tokens committed, status, done; caches cut to the committed
                 prefix; tokens, features and metrics written; the Commit

Token trees (`gamma` a `specjax.trees.TreeShape` or `DynamicTree`) run the same pipeline with
the tree strategy: the drafter's `propose_tree` drafts one tree per row, the target scores the
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
import inspect
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax import calibration, models
from specjax import sampling as sampling_lib
from specjax import trees as trees_lib
from specjax import verify as verify_lib
from specjax.decoding import _adaptive, _slots, _timing
from specjax.decoding._prefill import init_draft, prefill_caches
from specjax.decoding._round import RoundPipeline
from specjax.decoding._state import (PAD_ID, under_engine_mesh, Batch, Commit, EngineParams, GenerateOutput, LoopState, Metrics,
                                     Prefill, StreamEvent, check_batch, constrain_state)
from specjax.decoding._strategies import draft_context
from specjax.drafters import Capabilities, Drafter


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
    # Tokens every target pass of a round scores, the real ones first and padding after (their
    # logits unused, their cache entries past the committed length): 0 = each pass its own
    # size; -1 = the largest block this config drafts (gamma + 1, a tree's nodes + 1); N >= that.
    # One shape for every pass, target-only rounds included (`Generator.target_only` keeps the
    # number), so a block's row t and a one-token step are the same computation
    # (tests/test_block_step_bitwise.py).
    block_tokens: int = 0

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
        if not isinstance(self.block_tokens, int) or self.block_tokens < -1 or \
                0 < self.block_tokens < self.max_block + 1:
            raise ValueError(f"block_tokens must be 0 (each pass its own size), -1 (the largest block, "
                             f"{self.max_block + 1} here) or at least {self.max_block + 1}, got {self.block_tokens!r}")
        if self.has_budgets and self.verifier != "token":
            raise ValueError(f"row budgets (a gamma per row) cut each row's verdict at its own gamma, which is exact "
                             f"for token verification only; got verifier={self.verifier!r}")
        if self.has_budgets and self.block_tokens != 0:
            raise ValueError(f"row budgets score only the positions the rows use; a padded block size "
                             f"(block_tokens={self.block_tokens}) cannot be combined with them")
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
        return any(isinstance(g, (trees_lib.TreeShape, trees_lib.DynamicTree)) for g in self.gammas)

    @property
    def has_budgets(self) -> bool:
        """Whether a candidate gives each row its own gamma (`_adaptive.RowBudget`)."""
        return any(isinstance(g, _adaptive.RowBudget) for g in self.gammas)

    @property
    def max_gamma(self) -> int:
        """The longest run of drafted tokens a round can accept (a chain's gamma, a tree's depth)."""
        return max(g if isinstance(g, int) else g.max_depth for g in self.gammas)

    @property
    def max_block(self) -> int:
        """The most drafted tokens one target pass scores (gamma, or a tree's node count)."""
        return max(g if isinstance(g, int) else g.num_nodes for g in self.gammas)

    @property
    def target_block(self) -> int | None:
        """Tokens every target pass scores (`block_tokens` resolved), or None: each its own."""
        if self.block_tokens == 0:
            return None
        return self.max_block + 1 if self.block_tokens == -1 else self.block_tokens

    def slots_needed(self, prompt_length: int) -> int:
        """Cache slots for a prompt: prompt + max_new_tokens + the largest verification block
        (or the padded block every pass scores)."""
        return int(prompt_length) + self.max_new_tokens + max(self.max_block + 1, self.target_block or 0)

    def verifier_for(self, sampling: sampling_lib.SamplingConfig) -> verify_lib.Verifier:
        """The chain verifier for this sampling mode (`verify.get_verifier`)."""
        return verify_lib.get_verifier("chain", self.verifier, greedy=sampling.greedy)

    def tree_verifier_for(self, sampling: sampling_lib.SamplingConfig):
        """The tree verifier for this sampling mode (`verify.get_verifier`)."""
        return verify_lib.get_verifier("tree", self.tree_verifier, greedy=sampling.greedy)

    def _tree_verifier(self):
        return verify_lib.get_verifier("tree", self.tree_verifier)


@dataclasses.dataclass(frozen=True)
class Engine:
    """Target, drafter (None for target-only decoding) and generation config; see the module doc.
    Holds the round (`pipeline`, a `RoundPipeline` of the same three) and runs the loop around it."""
    target: models.DecoderModel
    drafter: Drafter | None
    config: GenerationConfig
    # Optional device mesh ("data", "model" axes, see `specjax.sharding`): the loop state is
    # constrained to it (rows on "data", cache heads on "model"); `place` puts weights and
    # batches on it. Sampling keys are per request, so tokens do not depend on the mesh.
    mesh: Any = None
    rules: Any = None
    # The round every entry point runs; made from (target, drafter, config), so it takes no part
    # in the engine's equality and hash.
    pipeline: RoundPipeline = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "pipeline", RoundPipeline(self.target, self.drafter, self.config))
        if self.config.max_gamma > 0 and self.drafter is None:
            raise ValueError("gamma > 0 needs a drafter")
        if self.drafter is not None and self.drafter.vocab_size != self.target.vocab_size:
            raise ValueError(f"vocab mismatch: the drafter has {self.drafter.vocab_size} tokens, the target "
                             f"{self.target.vocab_size}; speculative sampling needs a shared vocabulary")
        caps = self.capabilities
        for g in self.config.gammas:
            chain = g if isinstance(g, int) else g.gamma if isinstance(g, _adaptive.RowBudget) else None
            if chain and callable(getattr(self.drafter, "check_gamma", None)):
                self.drafter.check_gamma(chain)     # a drafter with a longest chain (a block, Medusa's heads)
            if chain is None:
                if not caps.trees:
                    raise ValueError(f"the drafter {type(self.drafter).__name__} drafts chains only "
                                     f"(capabilities.trees=False); got the tree {g}")
                self.drafter.check_tree(g)
        if caps.regimes > 1 and not all(callable(getattr(self.drafter, a, None)) for a in ("regime_B", "for_regime")):
            raise ValueError(f"the drafter declares {caps.regimes} regimes (capabilities.regimes) but lacks regime_B "
                             f"or for_regime (see the drafter protocol: draft sources)")
        if self.config.has_budgets and "rows" not in inspect.signature(self.target.apply).parameters:
            raise ValueError(f"row budgets score only the positions each row uses (apply(..., rows=), "
                             f"`models.PackedRows`); the target model {type(self.target).__name__} takes no rows")
        if self.feature_layers and not hasattr(self.target, "apply_with_features"):
            raise ValueError(f"the drafter reads the target's hidden features (layers {self.feature_layers}) "
                             f"but the target model {type(self.target).__name__} cannot return them")

    @property
    def capabilities(self) -> Capabilities:
        """What the drafter declared it needs and offers (`specjax.drafters.Capabilities`); a
        target-only engine (no drafter, or gamma 0 only) needs nothing."""
        return self.pipeline.capabilities

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features the drafter reads (empty: none kept)."""
        return self.pipeline.feature_layers

    @property
    def regimes(self) -> int:
        """The drafter's draft sources that adaptive gamma tells apart (`_adaptive` module doc)."""
        return self.capabilities.regimes

    # ------------------------------------------------------------------ the loop (traced)

    def _step(self, params, sampling, state):
        """One round, with gamma fixed or chosen by the adaptive policy."""
        if not self.config.adaptive:
            state, commit, _, _ = self.pipeline.run(params, sampling, self.config.gamma, state)
            return self._constrain(state), commit
        chosen, probe, regime, regime_B, alpha_B = self._choose(params, state)
        branches = [functools.partial(self._policy_round, params, sampling, g, chosen, probe, regime, regime_B, alpha_B)
                    for g in self.config.gamma.gammas]
        return jax.lax.switch(chosen, branches, state)

    def _prefill(self, params, prompt_BP, prompt_lengths_B, capacity, with_draft=True):
        """(target cache, drafter state or None, features or None) after the prompts (`_prefill`)."""
        return prefill_caches(self, params, prompt_BP, prompt_lengths_B, capacity, with_draft)

    def _init(self, params, prompt_BP, prompt_lengths_B, key_B, round_time_RZ, capacity, pre=None):
        """The loop state after prefill; ``pre`` = (target cache, drafter state or None) from
        `prefill` skips the target's prefill (and the drafter's, when its state is given)."""
        B, P = prompt_BP.shape
        tokens_BS = jnp.full((B, capacity), PAD_ID, jnp.int32).at[:, :P].set(prompt_BP)
        if pre is None:
            cache, draft_state, features_BSF = self._prefill(params, prompt_BP, prompt_lengths_B, capacity)
        else:
            cache, draft_state, features_BSF = pre
            if self.config.max_gamma == 0:
                draft_state = None
            elif draft_state is None:
                f_BPF = None if features_BSF is None else features_BSF[:, :P]
                draft_state = init_draft(self, params, prompt_BP, prompt_lengths_B, capacity, f_BPF)
            if not self.feature_layers:
                features_BSF = None
        policy = _adaptive.init_policy(self.config.gamma, round_time_RZ) if self.config.adaptive else None
        return self._constrain(LoopState(tokens_BS=tokens_BS, lengths_B=prompt_lengths_B, prompt_lengths_B=prompt_lengths_B,
                         done_B=jnp.zeros((B,), bool), status_B=jnp.zeros((B,), jnp.int32), target_cache=cache,
                         draft_state=draft_state, key_B=key_B,
                         metrics=Metrics.zeros(B, self.config.max_gamma, len(self.config.gammas)),
                         policy=policy, round=jnp.int32(0), features_BSF=features_BSF,
                         constraint_B=jnp.full((B,), -1, jnp.int32)))

    def _constrain(self, state):
        """The loop state pinned to the mesh (identity without one; `_state.constrain_state`)."""
        return constrain_state(state, self.mesh, self.rules)

    def _run(self, params, sampling, prompt_BP, prompt_lengths_B, key_B, round_time_RZ, capacity, pre=None,
             with_state: bool = False):
        state = self._init(params, prompt_BP, prompt_lengths_B, key_B, round_time_RZ, capacity=capacity, pre=pre)
        max_rounds = self.config.max_rounds or self.config.max_new_tokens

        def cond(s):
            return (~jnp.all(s.done_B)) & (s.round < max_rounds)

        policy = self.config.gamma if self.config.adaptive else None
        if policy is None or not _adaptive._is_zero(policy.gammas[0]) or len(policy.gammas) == 1:
            state = jax.lax.while_loop(cond, lambda s: self._step(params, sampling, s)[0], state)
            return (GenerateOutput.from_state(state), state) if with_state else GenerateOutput.from_state(state)

        # Adaptive gamma with gamma 0 among the choices: the rounds the policy runs at gamma 0
        # go through an inner loop of plain gamma-0 rounds, and only the others through the
        # `lax.switch` of `_step`. The same rounds in the same order (same keys, same policy
        # updates), but a switch carries copies of the caches that a plain round does not
        # (measured: experiments/bench_speed/results/2026-12-02-head-intel-xeon/NOTES.md), and
        # most rounds of a draft that does not pay are at gamma 0.
        def zero_cond(s):
            return cond(s) & (self._choose(params, s)[0] == 0)

        def zero_round(s):
            regime, regime_B = self._regime(params, s)
            return self._policy_round(params, sampling, 0, jnp.int32(0), jnp.zeros((), bool), regime, regime_B, None,
                                      s)[0]

        def body(s):
            s = jax.lax.while_loop(zero_cond, zero_round, s)
            # Then one round at the gamma the policy chooses now (not 0: a probe or a better
            # gamma), as `_step` runs it, or nothing when the loop has ended (branch 0).
            chosen, probe, regime, regime_B, alpha_B = self._choose(params, s)
            branches = [lambda s: s] + [
                lambda s, g=g: self._policy_round(params, sampling, g, chosen, probe, regime, regime_B, alpha_B, s)[0]
                for g in policy.gammas]
            return jax.lax.switch(jnp.where(cond(s), chosen + 1, 0), branches, s)

        state = jax.lax.while_loop(cond, body, state)
        return (GenerateOutput.from_state(state), state) if with_state else GenerateOutput.from_state(state)

    def _run_consuming(self, params, sampling, prompt_BP, prompt_lengths_B, key_B, round_time_RZ, capacity, pre):
        # `_run` that also returns the final caches: with ``pre`` donated, the loop's caches then
        # alias the prefill's buffers (updated in place) instead of a copy beside them.
        out, state = self._run(params, sampling, prompt_BP, prompt_lengths_B, key_B, round_time_RZ, capacity,
                               pre=pre, with_state=True)
        return out, (state.target_cache, state.draft_state if pre[1] is not None else None,
                     state.features_BSF if pre[2] is not None else None)

    def _steps(self, params, sampling, state, n: int):
        return jax.lax.scan(lambda s, _: self._step(params, sampling, s), state, None, length=n)

    # ------------------------------------------------------------------ adaptive gamma (traced)

    def _regime(self, params, state: LoopState):
        """(the next round's batch regime, each row's regime [B]), from the committed tokens (and
        the draft params: a lookup source may search a corpus held there)."""
        B = state.lengths_B.shape[0]
        if self.regimes == 1:
            return jnp.int32(0), jnp.zeros((B,), jnp.int32)
        regime_B = self.drafter.regime_B(params.draft, draft_context(state)).astype(jnp.int32)
        return _adaptive.batch_regime(regime_B, ~state.done_B), regime_B

    def _choose(self, params, state):
        """The adaptive policy's choice for the next round: (index, probe, batch regime, rows' regimes,
        rows' acceptance estimates)."""
        regime, regime_B = self._regime(params, state)
        m = state.metrics
        alpha_B = _adaptive.row_alphas(self.config.gamma, state.policy, jnp.sum(m.accepted_at_BG, axis=1),
                                       jnp.sum(m.tested_at_BG, axis=1), regime_B)
        chosen, probe = _adaptive.choose(self.config.gamma, state.policy, regime, alpha_B, ~state.done_B)
        return chosen, probe, regime, regime_B, alpha_B

    def _policy_round(self, params, sampling, gamma, chosen, probe, regime, regime_B, alpha_B, state):
        """(state, commit) of one round at ``gamma`` (the adaptive policy's choice ``chosen``,
        ``probe``, ``regime``, ``regime_B`` and ``alpha_B`` as `_choose` gave them; a row budget
        hands out its rows' gammas by ``alpha_B``), with the round's acceptance folded into each
        regime's estimate (its rows' tested positions)."""
        state, commit, tested_sum_B, tested_n_B = self.pipeline.run(params, sampling, gamma, state, alpha_B)
        in_BR = regime_B[:, None] == jnp.arange(self.regimes)[None]
        sum_R = jnp.sum(jnp.where(in_BR, tested_sum_B[:, None], 0.0), axis=0)
        n_R = jnp.sum(jnp.where(in_BR, tested_n_B[:, None], 0), axis=0)
        policy = _adaptive.update(self.config.gamma, state.policy, chosen, probe, sum_R, n_R, regime)
        return self._constrain(state.replace(policy=policy)), commit

    def _chosen_round(self, params, sampling, index, state):
        """`_step`'s adaptive round when the host already knows the policy's choice ``index``
        (static: the previous round's ``Commit.next_index``, or `_first_choice`): that round
        alone, compiled without the `lax.switch` over every candidate (and its copies of the
        caches, see `_run`); the commit carries the next round's choice. Same keys, same policy
        update, same state as `_step`."""
        chosen, probe, regime, regime_B, alpha_B = self._choose(params, state)       # chosen == index
        state, commit = self._policy_round(params, sampling, self.config.gamma.gammas[index], chosen, probe,
                                           regime, regime_B, alpha_B, state)
        return state, commit.replace(next_index=self._choose(params, state)[0])

    def _first_choice(self, params, state):
        return self._choose(params, state)[0]

    # ------------------------------------------------------------------ compiled entry points

    _prefill_jit = functools.partial(jax.jit, static_argnums=0, static_argnames=("capacity", "with_draft"))(under_engine_mesh(_prefill))
    _init_jit = functools.partial(jax.jit, static_argnums=0, static_argnames="capacity")(under_engine_mesh(_init))
    _run_jit = functools.partial(jax.jit, static_argnums=0, static_argnames="capacity")(under_engine_mesh(_run))
    _run_consuming_jit = functools.partial(jax.jit, static_argnums=0, static_argnames="capacity",
                                           donate_argnames="pre")(under_engine_mesh(_run_consuming))
    _step_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames="state")(under_engine_mesh(_step))
    _steps_jit = functools.partial(jax.jit, static_argnums=(0, 4), donate_argnames="state")(under_engine_mesh(_steps))
    _chosen_round_jit = functools.partial(jax.jit, static_argnums=(0, 3), donate_argnames="state")(under_engine_mesh(_chosen_round))
    _first_choice_jit = functools.partial(jax.jit, static_argnums=0)(under_engine_mesh(_first_choice))

    # ------------------------------------------------------------------ compiling without running

    def state_shapes(self, params, batch_size: int, prompt_len: int, capacity: int):
        """The loop state's shapes and dtypes (`jax.ShapeDtypeStruct`s) for a batch of
        ``batch_size`` prompts padded to ``prompt_len`` in caches of ``capacity`` slots; ``params``
        may be abstract. What `lower_step` takes (after a placement, `specjax.aot`)."""
        prompt = jax.ShapeDtypeStruct((batch_size, prompt_len), jnp.int32)
        lengths = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch_size))
        return jax.eval_shape(functools.partial(self._init, capacity=capacity), params, prompt, lengths, keys,
                              self._round_time_RZ(None))

    def lower_step(self, params, sampling, state):
        """`step`'s program lowered for these (possibly abstract, sharded) arguments, to compile
        without running it (`specjax.aot`)."""
        return Engine._step_jit.lower(self, params, sampling, state)

    def lower_prefill(self, params, prompt_BP, prompt_lengths_B, capacity: int):
        """The target's prefill (`prefill`, without the drafter) lowered for these arguments."""
        return Engine._prefill_jit.lower(self, params, prompt_BP, prompt_lengths_B, capacity=capacity, with_draft=False)

    # ------------------------------------------------------------------ placement on a mesh

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

    # ------------------------------------------------------------------ the public entry points

    def _round_time_RZ(self, round_time_s):
        """[regimes, gammas] round times for the policy (`calibration.round_time_table`)."""
        return jnp.asarray(calibration.round_time_table(round_time_s, self.config.gammas, self.regimes))

    def _check(self, batch: Batch):
        check_batch(self.target, self.config, batch)

    def check(self, batch: Batch) -> None:
        """Raise ValueError / `CacheCapacityError` for a batch this engine cannot run (`check_batch`)."""
        self._check(batch)

    def _pre(self, batch: Batch, prefill: Prefill | None):
        return None if prefill is None else prefill.parts(self.target, self.drafter, self.feature_layers, batch)

    def prefill(self, params: EngineParams, batch: Batch) -> Prefill:
        """The batch's prompts in the target's cache (and the drafter's state): pass it as
        ``prefill=`` to `init` / `run` / `stream` / `round_times` of this engine or of another
        with the same target (e.g. `Generator.target_only`), so a prompt is prefilled once."""
        self._check(batch)
        cache, draft_state, features_BSF = self._prefill_jit(params, batch.prompt_BP, batch.prompt_lengths_B,
                                                             capacity=batch.capacity, with_draft=True)
        return Prefill(batch=batch, target=self.target,
                       drafter=self.drafter if self.config.max_gamma > 0 else None,
                       target_cache=cache, draft_state=draft_state, features_BSF=features_BSF)

    def init(self, params: EngineParams, batch: Batch, round_time_s=None, prefill: Prefill | None = None) -> LoopState:
        """Prefill the target (and the drafter) on the batch, or take ``prefill``: the state
        `step` advances."""
        self._check(batch)
        return self._init_jit(params, batch.prompt_BP, batch.prompt_lengths_B, batch.key_B,
                              self._round_time_RZ(round_time_s), capacity=batch.capacity,
                              pre=self._pre(batch, prefill))

    def step(self, params: EngineParams, sampling, state: LoopState) -> tuple[LoopState, Commit]:
        """One round; ``state`` is donated (its buffers are updated in place, do not reuse it).

        Under adaptive gamma the policy's choice is read first (a small program) and the chosen
        round runs compiled on its own (`_chosen_round`, as `stream` runs it): the same round as
        the traced `lax.switch` over every candidate, without the switch's copies of the caches."""
        if self.config.adaptive:
            index = int(jax.device_get(self._first_choice_jit(params, state)))
            return self._chosen_round_jit(params, sampling, index, state)
        return self._step_jit(params, sampling, state)

    def precompile(self, params: EngineParams, sampling, state: LoopState) -> None:
        """Compile `step`'s programs for this state's shapes, so no round waits for compilation:
        under adaptive gamma every candidate's round (each run once on a copy of the state, so
        its memory is briefly held twice) and the policy's choice; else the one round (on a copy)."""
        if not self.config.adaptive:
            jax.block_until_ready(self._step_jit(params, sampling, jax.tree.map(jnp.copy, state)))
            return
        for i in range(len(self.config.gammas)):
            jax.block_until_ready(self._chosen_round_jit(params, sampling, i, jax.tree.map(jnp.copy, state)))
        jax.block_until_ready(self._first_choice_jit(params, state))

    def steps(self, params: EngineParams, sampling, state: LoopState, n: int) -> tuple[LoopState, Commit]:
        """`n` rounds in one jitted call (one host round trip instead of `n`): the same rounds as
        `n` calls of `step`, their commits stacked on a leading axis ([n, B, ...]); a row that is
        done commits nothing in the later ones. ``state`` is donated."""
        if n < 1:
            raise ValueError(f"steps: n must be >= 1, got {n}")
        return self._steps_jit(params, sampling, state, int(n))

    def run(self, params: EngineParams, sampling, batch: Batch, round_time_s=None,
            prefill: Prefill | None = None, consume_prefill: bool = False) -> GenerateOutput:
        """The whole generation in one jitted `lax.while_loop`, fully on device.

        ``consume_prefill`` (with ``prefill``): the run takes the prefill's buffers over (they
        are donated: the loop updates its caches in place in them), so a batch's caches are in
        memory once, not twice; the prefill cannot be used again. Without it the loop works on
        a copy and the prefill stays valid for other runs. The same tokens either way."""
        self._check(batch)
        pre = self._pre(batch, prefill)
        args = (params, sampling, batch.prompt_BP, batch.prompt_lengths_B, batch.key_B,
                self._round_time_RZ(round_time_s))
        if consume_prefill and pre is not None:
            return self._run_consuming_jit(*args, capacity=batch.capacity, pre=pre)[0]
        return self._run_jit(*args, capacity=batch.capacity, pre=pre)

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
            self.precompile(params, sampling, state)
        index = int(jax.device_get(self._first_choice_jit(params, state))) if self.config.adaptive else None
        for r in range(1, max_rounds + 1):
            if index is None:
                state, commit = self.step(params, sampling, state)
            else:
                state, commit = self._chosen_round_jit(params, sampling, index, state)
            c = jax.device_get(commit)
            index = None if c.next_index is None else int(c.next_index)
            new_tokens = [c.tokens_BC[b, :c.n_B[b]].tolist() for b in range(c.n_B.shape[0])]
            last = bool(np.all(c.done_B)) or r == max_rounds
            yield StreamEvent(round=r, new_tokens=new_tokens, done=[bool(d) for d in c.done_B],
                              elapsed_s=time.perf_counter() - t0,
                              output=GenerateOutput.from_state(state) if last else None)
            if last:
                return


    # ------------------------------------------------------------------ slots and round timing (own modules)

    def empty_state(self, params: EngineParams, slots: int, capacity: int, round_time_s=None,
                    key: jax.Array | None = None) -> LoopState:
        """A state of ``slots`` empty rows for `refill` (`_slots.empty_state`)."""
        return _slots.empty_state(self, params, slots, capacity, round_time_s, key)

    def resize(self, state: LoopState, rows, round_time_s=None) -> LoopState:
        """The state with ``len(rows)`` rows, new row i old row ``rows[i]`` (None or -1: an empty
        done row) (`_slots.resize`)."""
        return _slots.resize(self, state, rows, round_time_s)

    def refill(self, params: EngineParams, state: LoopState, slot: int, prompt: Batch) -> LoopState:
        """Row ``slot`` of ``state`` replaced by the one-row request ``prompt`` (`_slots.refill`)."""
        return _slots.refill(self, params, state, slot, prompt)

    def round_times(self, params: EngineParams, sampling, batch: Batch, repeats: int = 5,
                    prefill: Prefill | None = None) -> list[float]:
        """Median seconds of one round per gamma (and draft source) on this batch (`_timing.round_times`)."""
        return _timing.round_times(self, params, sampling, batch, repeats, prefill)
