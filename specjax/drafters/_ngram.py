"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier match of the suffix.

Saxena (2023), "Prompt Lookup Decoding"; the same idea as transformers' prompt lookup. No
model and no state: the proposal is a deterministic function of the context, so q is one-hot
and speculative sampling stays exact (a one-hot q is accepted with probability p(x)).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return None     # stateless: everything it reads is in the context

    def match_end(self, tokens_BL, lengths_B):
        """Index of the last token of the latest earlier occurrence of the longest matching
        suffix n-gram (n from max_ngram down to min_ngram); -1 where nothing matches."""
        B, Lmax = tokens_BL.shape
        pos_L = jnp.arange(Lmax)
        best_B = jnp.full((B,), -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer n overrides shorter
            ok_BL = (pos_L[None, :] >= n - 1) & (pos_L[None, :] < lengths_B[:, None] - 1)
            for k in range(n):
                suffix_B = jnp.take_along_axis(
                    tokens_BL, jnp.clip(lengths_B - 1 - k, 0, Lmax - 1)[:, None], axis=1)
                shifted_BL = jnp.roll(tokens_BL, k, axis=1)  # shifted[i] = tokens[i - k]
                ok_BL &= shifted_BL == suffix_B
            ok_BL &= (lengths_B >= n + 1)[:, None]
            last_B = jnp.max(jnp.where(ok_BL, pos_L[None, :], -1), axis=1).astype(jnp.int32)
            best_B = jnp.where(last_B >= 0, last_B, best_B)
        return best_B

    def forward_passes(self, gamma: int) -> int:
        return 0     # no model

    def propose(self, params, state, context, key_B, gamma, cfg):
        tokens_BL, lengths_B = context.tokens_BL, context.lengths_B
        end_B = self.match_end(tokens_BL, lengths_B)
        found_B = end_B >= 0
        start_B = jnp.where(found_B, end_B + 1, lengths_B - 1)
        # Continue cyclically through tokens[start:L]: a repeating pattern keeps repeating.
        period_B = jnp.maximum(lengths_B - start_B, 1)
        idx_BG = start_B[:, None] + jnp.arange(gamma)[None, :] % period_B[:, None]
        tokens_BG = jnp.take_along_axis(tokens_BL, jnp.clip(idx_BG, 0, tokens_BL.shape[1] - 1), axis=1)
        q_BGV = jax.nn.one_hot(tokens_BG, self.vocab_size, dtype=jnp.float32)
        return tokens_BG.astype(jnp.int32), q_BGV, state

    def commit(self, state, new_lengths_B):
        return state
