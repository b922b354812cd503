"""Greedy (temperature 0) verification."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.sampling import argmax
from specjax.verify._result import VerifyResult, assemble_result


@dataclasses.dataclass(frozen=True)
class GreedyVerifier:
    """Accept while the draft token equals the target's argmax; commit the target's choices.

    The committed tokens are exactly ``argmax p`` at positions ``0 .. n_accepted`` (ties: the
    lowest index, as ``jnp.argmax``), so the output equals plain greedy target decoding.
    Ignores ``q`` and ``key``. ``accept_prob_BG`` is ``1[x == argmax p]``, the residual is the
    one-hot argmax, uniforms are zeros, and no residual is ever degenerate.
    """

    def __call__(self, key, draft_tokens_BG, q_BGV, p_BG1V) -> VerifyResult:
        del key, q_BGV
        batch, gamma = draft_tokens_BG.shape
        vocab = p_BG1V.shape[-1]
        choice_BG1 = argmax(p_BG1V)
        match_BG = draft_tokens_BG.astype(jnp.int32) == choice_BG1[:, :gamma]
        n_accepted_B = jnp.sum(jnp.cumprod(match_BG.astype(jnp.int32), axis=1), axis=1)
        next_token_B = jnp.take_along_axis(choice_BG1, n_accepted_B[:, None], axis=1)[:, 0]
        return assemble_result(
            n_accepted_B, draft_tokens_BG, next_token_B,
            match_BG.astype(jnp.float32),
            jax.nn.one_hot(choice_BG1, vocab, dtype=jnp.float32),
            jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch, gamma), jnp.float32))
