"""Prefill: the caches a batch of prompts starts from, for the engine's `init` and `prefill`
and for slot refills (`_slots`). Functions of an `Engine`, reading only its public fields
(target, drafter, config, feature_layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import models


def prefill_caches(engine, params, prompt_BP, prompt_lengths_B, capacity: int, with_draft: bool = True):
    """(target cache, drafter state or None, features [B, capacity, F] or None) after the
    prompts: every prompt token but the last enters the caches (the last is the first round's
    input)."""
    B = prompt_BP.shape[0]
    # The barrier keeps XLA from constant-folding the prefill over an all-zeros cache (a long
    # compile that folds attention over constants).
    cache = jax.lax.optimization_barrier(engine.target.init_cache(B, capacity))
    layers = engine.feature_layers or None
    out = models.prefill(engine.target, params.target, prompt_BP, cache, prompt_lengths_B - 1,
                         engine.config.prefill_chunk, start_bound=0, feature_layers=layers)
    cache, f_BPF = out if layers else (out, None)
    features_BSF = (None if f_BPF is None else
                    jnp.zeros((B, capacity, f_BPF.shape[-1]), f_BPF.dtype).at[:, :prompt_BP.shape[1]].set(f_BPF))
    draft_state = (init_draft(engine, params, prompt_BP, prompt_lengths_B, capacity, f_BPF)
                   if with_draft and engine.config.max_gamma > 0 else None)
    return cache, draft_state, features_BSF


def init_draft(engine, params, prompt_BP, prompt_lengths_B, capacity: int, f_BPF):
    """The drafter's state after the prompts (a feature head also reads their features ``f_BPF``)."""
    if engine.feature_layers:
        return engine.drafter.init(params.draft, prompt_BP, prompt_lengths_B, capacity, features_BPF=f_BPF)
    return engine.drafter.init(params.draft, prompt_BP, prompt_lengths_B, capacity)
