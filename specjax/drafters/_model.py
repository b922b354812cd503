"""A drafter that is a model: a small draft model, or the target's first layers (early exit)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import sampling as sampling_lib
from specjax import trees as trees_lib
from specjax.drafters import _tree
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.drafters._registry import register_drafter
from specjax.models import DecoderModel, Llama, prefill, truncate_layers


@struct.dataclass
class ModelDraftState:
    cache: Any


def expand(model, params, cache, root_logits_BV, key_B, tree, sampling, children):
    """Draft a tree (static or dynamic) from the root's logits; greedy decoding always drafts
    deterministic (top-k) children: greedy q is one-hot, so sampled children would repeat."""
    if isinstance(tree, trees_lib.DynamicTree):
        return _tree.expand_dynamic(model, params, cache, root_logits_BV, tree, sampling)
    mode = "deterministic" if sampling.greedy else children
    return _tree.expand_static(model, params, cache, root_logits_BV, key_B, tree, sampling, mode)


def draw(key_B, probs_BV, cfg: sampling_lib.SamplingConfig):
    """One token per row from probs, each row with its own key (argmax when greedy)."""
    if cfg.greedy:
        return sampling_lib.argmax(probs_BV)
    return jax.vmap(sampling_lib.sample)(key_B, probs_BV).astype(jnp.int32)


def support_scores(model, params, tokens_BT, cache, num_valid_B=None):
    """(scores [B, T, S], their token ids [S] or None, cache): a model's next-token logits over
    the tokens it can propose. None: the whole vocabulary (S = V, `apply`). A model whose
    support is part of the vocabulary (a reduced-vocabulary draft head) implements
    ``apply_support``: its logits are -inf off the S tokens, so q is zero there, and drawing
    from the S scores (`draw_support`) is the same law for S/V of the work."""
    if hasattr(model, "apply_support"):
        return model.apply_support(params, tokens_BT, cache, num_valid_B)
    logits, cache = model.apply(params, tokens_BT, cache, num_valid_B)
    return logits, None, cache


def to_vocab(x_BU, ids, vocab: int, fill: float):
    """Values over a support placed in the vocabulary (``fill`` elsewhere); no-op for ids None."""
    if ids is None:
        return x_BU
    return jnp.full(x_BU.shape[:-1] + (vocab,), fill, x_BU.dtype).at[..., ids].set(x_BU)


def draw_support(key_B, scores_BU, ids, cfg: sampling_lib.SamplingConfig, vocab: int):
    """(one token per row drawn from the scores over a support, q_BV over the vocabulary).

    The logits processing runs on the support: -inf elsewhere changes neither top-k (a k past
    the support keeps all of it either way) nor top-p (zero mass) nor the greedy argmax (ids
    are sorted, so ties still go to the lowest token id); q outside the support is 0."""
    q_BU = sampling_lib.probabilities(scores_BU, cfg, ids)
    idx_B = draw(key_B, q_BU, cfg)
    tok_B = idx_B if ids is None else jnp.take(ids, idx_B).astype(jnp.int32)
    return tok_B, to_vocab(q_BU, ids, vocab, 0.0)


def draw_positions(key_B, scores_BGU, ids, cfg: sampling_lib.SamplingConfig, vocab: int):
    """(tokens_BG, q_BGV): one token per position g from its own scores (a drafter that
    proposes every position at once: Medusa heads, the parallel drafter), each from the row's
    key split G ways. Position g's draw is independent of the others' given the scores, so its
    q is exactly what it was drawn from; with penalties or an automaton (``cfg.moves``) the
    draw at g sees the tokens drawn at the positions before it, as the target will."""
    G = scores_BGU.shape[1]
    keys_BG = jax.vmap(lambda k: jax.random.split(k, G))(key_B)
    if not cfg.moves:
        return jax.vmap(lambda k, s: draw_support(k, s, ids, cfg, vocab), in_axes=1, out_axes=1)(keys_BG, scores_BGU)
    tokens, qs = [], []
    for g in range(G):
        tok_B, q_BV = draw_support(keys_BG[:, g], scores_BGU[:, g], ids, cfg, vocab)
        cfg = cfg.advance(tok_B)
        tokens.append(tok_B)
        qs.append(q_BV)
    return jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)


def rollout(model, params, cache, logits_BV, key_B, gamma, cfg, ids=None):
    """Sample gamma tokens autoregressively, starting from the logits of the last seen token
    (with ``ids``: its scores over that support, see `support_scores`).

    Returns (tokens_BG, q_BGV, cache); q is recorded exactly as sampled (same processing as
    the target's, `cfg`), and the cache has gamma - 1 more entries (the last proposal is not
    fed back: the verification decides whether it is kept).
    """
    vocab = model.vocab_size
    step_keys_BG = jax.vmap(lambda k: jax.random.split(k, gamma))(key_B)
    tok_B, q_BV = draw_support(step_keys_BG[:, 0], logits_BV, ids, cfg, vocab)

    # Penalties and automata: the drafted tokens join the history, carried through the scan (a
    # config without a history stays out of the carry: the loop is then the plain one).
    moving = cfg.moves

    def step(carry, key_B):
        cache, tok_B, here = carry
        here = here.advance(tok_B) if moving else cfg
        scores_B1U, step_ids, cache = support_scores(model, params, tok_B[:, None], cache)
        nxt_B, q_BV = draw_support(key_B, scores_B1U[:, 0], step_ids, here, vocab)
        return (cache, nxt_B, here if moving else None), (nxt_B, q_BV)

    (cache, _, _), (toks_GB, qs_GBV) = jax.lax.scan(step, (cache, tok_B, cfg if moving else None),
                                                    jnp.swapaxes(step_keys_BG[:, 1:], 0, 1))
    tokens_BG = jnp.concatenate([tok_B[:, None], jnp.swapaxes(toks_GB, 0, 1)], axis=1)
    q_BGV = jnp.concatenate([q_BV[:, None], jnp.swapaxes(qs_GBV, 0, 1)], axis=1)
    return tokens_BG, q_BGV, cache


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """Proposes by sampling autoregressively from a model with its own KV cache.

    Per round the draft first ingests the committed tokens it has not seen (one, or two after
    a fully accepted round: its last proposal and the target's bonus token; more only after
    gamma = 0 rounds of an adaptive policy) in 2-slot forwards, then runs gamma - 1 one-token steps in a `lax.scan`. `q` is recorded exactly as
    sampled, after the same logits processing as the target's.
    """
    model: DecoderModel
    capabilities = Capabilities(own_cache=True, trees=True)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        # Barrier: see the target's prefill in the engine (no constant folding over zeros).
        cache = jax.lax.optimization_barrier(self.model.init_cache(prompt_BP.shape[0], capacity))
        cache = prefill(self.model, params, prompt_BP, cache, prompt_lengths_B - 1, start_bound=0)
        return ModelDraftState(cache=cache)

    def _ingest(self, params, cache, tokens_BS, num_B):
        """Feed tokens[seen : seen + num] (num <= 2 per row) into the cache -> (scores over the
        model's support, its ids or None, cache); see `support_scores`."""
        seen_B = cache.lengths_B
        idx_B2 = jnp.clip(seen_B[:, None] + jnp.arange(2)[None, :], 0, tokens_BS.shape[1] - 1)
        block_B2 = jnp.take_along_axis(tokens_BS, idx_B2, axis=1)
        return support_scores(self.model, params, block_B2, cache, num_valid_B=num_B)

    def forward_passes(self, gamma: int) -> int:
        return gamma

    def _catch_up(self, params, cache, context: DraftContext):
        """Ingest the committed tokens the cache has not seen -> (logits at the last one, cache)."""
        scores_BU, ids, cache = self._catch_up_support(params, cache, context)
        return to_vocab(scores_BU, ids, self.model.vocab_size, -jnp.inf), cache

    def _catch_up_support(self, params, cache, context: DraftContext):
        """`_catch_up` with the scores over the model's support: (scores_BU, ids or None, cache)."""
        tokens_BS, lengths_B = context.tokens_BS, context.lengths_B

        # More than two unseen tokens happen only after rounds without drafting (adaptive
        # gamma = 0): ingest them two at a time until two are left. A fixed-gamma loop never
        # enters this while_loop.
        def behind(c):
            return jnp.any(lengths_B - c.lengths_B > 2)

        def catch_up(c):
            num_B = jnp.clip(lengths_B - c.lengths_B - 2, 0, 2).astype(jnp.int32)
            return self._ingest(params, c, tokens_BS, num_B)[2]

        cache = jax.lax.while_loop(behind, catch_up, cache)
        # Unseen committed tokens: tokens[seen : lengths], 1 or 2 of them (done rows: 1).
        num_new_B = jnp.clip(lengths_B - cache.lengths_B, 1, 2).astype(jnp.int32)
        scores_B2U, ids, cache = self._ingest(params, cache, tokens_BS, num_new_B)
        scores_BU = jnp.take_along_axis(scores_B2U, (num_new_B - 1)[:, None, None], axis=1)[:, 0]
        return scores_BU, ids, cache

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        scores_BU, ids, cache = self._catch_up_support(params, state.cache, context)
        tokens_BG, q_BGV, cache = rollout(self.model, params, cache, scores_BU, key_B, gamma, cfg, ids)
        return tokens_BG, q_BGV, ModelDraftState(cache=cache)

    def propose_tree(self, params, state, context: DraftContext, key_B, tree, cfg, children):
        logits_BV, cache = self._catch_up(params, state.cache, context)
        draft, q_BN1V, cache = expand(self.model, params, cache, logits_BV, key_B, tree, cfg, children)
        return draft, q_BN1V, ModelDraftState(cache=cache)

    def tree_forward_passes(self, tree) -> int:
        return tree.max_depth          # the root's ingest + one block per level but the last

    def check_tree(self, tree) -> None:
        pass

    def commit(self, state, new_lengths_B, accepted=None):
        # The cache sees the committed prefix minus its last token. After a tree round the
        # committed nodes' tentative K/V (those the draft forwarded, a leading run of the path)
        # move to the committed slots; whatever is missing is ingested next round.
        cache = state.cache
        if accepted is not None:
            have_BA = accepted.draft_slots_BA >= 0
            num_B = jnp.sum(jnp.cumprod(have_BA, axis=1), axis=1)
            num_B = jnp.minimum(num_B, accepted.num_B).astype(jnp.int32)
            cache = cache.commit_path(jnp.maximum(accepted.draft_slots_BA, 0), num_B)
        return ModelDraftState(cache=cache.truncate(new_lengths_B - 1))


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """Self-speculative draft: the target's first k layers and its head, on the target's cache.

    The target's KV cache already holds, for every layer, the committed prefix minus its last
    token, and its first k layers' entries are exactly what this draft would compute (same
    weights, tokens and positions). So the draft keeps no cache of its own and needs no
    prefill or catch-up: each round it starts from the target cache's first k layers, feeds
    the last committed token, and drafts gamma tokens. Its speculative entries live in a
    per-round view that is dropped after proposing; the target's verification pass then
    writes the real entries for all layers. Build it with `EarlyExitDrafter.from_target`.
    """
    model: DecoderModel            # a Llama with config.num_layers = k
    capabilities = Capabilities(trees=True)        # the target's cache, none of its own

    @classmethod
    def from_target(cls, target, target_params, num_layers: int):
        params, config = truncate_layers(target_params, target.config, num_layers)
        return cls(Llama(config)), params

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return None     # no cache of its own: it reads the target's from the context

    def forward_passes(self, gamma: int) -> int:
        return gamma

    def _root(self, params, context: DraftContext):
        cache = context.target_cache.first_layers(self.model.config.num_layers)
        last_B1 = jnp.take_along_axis(context.tokens_BS, (context.lengths_B - 1)[:, None], axis=1)
        logits_B1V, cache = self.model.apply(params, last_B1, cache)
        return logits_B1V[:, 0], cache

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        logits_BV, cache = self._root(params, context)
        tokens_BG, q_BGV, _ = rollout(self.model, params, cache, logits_BV, key_B, gamma, cfg)
        return tokens_BG, q_BGV, state

    def propose_tree(self, params, state, context: DraftContext, key_B, tree, cfg, children):
        logits_BV, cache = self._root(params, context)
        draft, q_BN1V, _ = expand(self.model, params, cache, logits_BV, key_B, tree, cfg, children)
        return draft.replace(draft_slots_BN=None), q_BN1V, state

    def tree_forward_passes(self, tree) -> int:
        return tree.max_depth

    def check_tree(self, tree) -> None:
        pass

    def commit(self, state, new_lengths_B, accepted=None):
        return state


# --------------------------------------------------------------------- the registered kinds
@dataclasses.dataclass(frozen=True)
class EarlyExitSettings:
    early_exit_layers: int = 4      # the target's first layers that draft


@dataclasses.dataclass(frozen=True)
class DraftModelSettings:
    draft_model: str = ""           # a draft directory, model path or registry name; "" = the one shipped for the target


def _check_layers(s: EarlyExitSettings, ctx) -> None:
    layers = ctx.target.config.num_layers
    if not 1 <= s.early_exit_layers <= layers:
        raise ValueError(f"early_exit_layers={s.early_exit_layers}: expected 1..{layers}")


def _build_early_exit(s: EarlyExitSettings, ctx):          # shares the target's KV cache for its layers
    _check_layers(s, ctx)
    return EarlyExitDrafter.from_target(ctx.target, ctx.target_params, s.early_exit_layers)


def _build_early_exit_own_cache(s: EarlyExitSettings, ctx):  # the same draft as a model with its own cache
    _check_layers(s, ctx)
    params, cfg = truncate_layers(ctx.target_params, ctx.target.config, s.early_exit_layers)
    return ModelDrafter(Llama(cfg)), params


def _build_distilled(s: DraftModelSettings, ctx):
    from specjax.drafters._shipped import shipped_draft
    from specjax.models.draft_artifact import load_draft
    model, params = load_draft(s.draft_model or shipped_draft(ctx.target_name), ctx.target, ctx.target_params)
    return ModelDrafter(model), params


def _check_model(s: DraftModelSettings, job) -> None:
    if not s.draft_model:
        raise ValueError("drafter='model' needs draft_model (a path or registry name)")


def _build_model(s: DraftModelSettings, ctx):
    from specjax import models
    _check_model(s, None)
    model, params = models.load(s.draft_model, dtype=ctx.dtype, scan_layers=ctx.scan_layers)
    if model.vocab_size != ctx.target.vocab_size:
        raise ValueError(f"vocab mismatch: draft model {s.draft_model} has {model.vocab_size} tokens, "
                         f"the target {ctx.target.vocab_size}")
    return ModelDrafter(model), params


register_drafter("distilled", DraftModelSettings, _build_distilled, description="a draft written by specjax distill",
                 teacher_forced="distilled")
register_drafter("early_exit", EarlyExitSettings, _build_early_exit, description="the target's first layers on its cache",
                 teacher_forced="early_exit_own_cache")
register_drafter("early_exit_own_cache", EarlyExitSettings, _build_early_exit_own_cache,
                 description="the target's first layers with a cache of their own", teacher_forced="early_exit_own_cache")
register_drafter("model", DraftModelSettings, _build_model, check=_check_model,
                 description="any checkpoint with the target's vocabulary", teacher_forced="model")
