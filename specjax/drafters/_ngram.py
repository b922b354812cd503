"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier match of the suffix.

Saxena (2023), "Prompt Lookup Decoding"; the same idea as transformers' prompt lookup. No
model and no state: the proposal is a deterministic function of the context, so q is one-hot
and speculative sampling stays exact (a one-hot q is accepted with probability p(x)).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import trees as trees_lib
from specjax.drafters._protocol import Capabilities
from specjax.drafters._registry import register_drafter


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 1

    capabilities = Capabilities(trees=True)       # stateless, model-free; trees from its matches

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return None     # stateless: everything it reads is in the context

    def _match_lengths(self, tokens_BS, lengths_B):
        """m_BS[b, i]: the longest n in [min_ngram, max_ngram] such that the n tokens ending at i
        equal the row's last n tokens (i < length - 1); 0 where none."""
        B, Lmax = tokens_BS.shape
        pos_S = jnp.arange(Lmax)
        m_BS = jnp.zeros((B, Lmax), jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):
            ok_BS = (pos_S[None, :] >= n - 1) & (pos_S[None, :] < lengths_B[:, None] - 1)
            for k in range(n):
                suffix_B = jnp.take_along_axis(
                    tokens_BS, jnp.clip(lengths_B - 1 - k, 0, Lmax - 1)[:, None], axis=1)
                ok_BS &= jnp.roll(tokens_BS, k, axis=1) == suffix_B
            ok_BS &= (lengths_B >= n + 1)[:, None]
            m_BS = jnp.where(ok_BS, n, m_BS)
        return m_BS

    def longest_match(self, tokens_BS, lengths_B):
        """(end_B, n_B): the index of the last token of the latest earlier occurrence of the
        longest matching suffix n-gram (n from max_ngram down to min_ngram), and that n; -1 and
        0 where nothing matches."""
        m_BS = self._match_lengths(tokens_BS, lengths_B)
        n_B = jnp.max(m_BS, axis=1)
        pos_S = jnp.arange(tokens_BS.shape[1])
        end_B = jnp.max(jnp.where((m_BS == n_B[:, None]) & (n_B[:, None] > 0), pos_S[None, :], -1), axis=1)
        return end_B.astype(jnp.int32), n_B.astype(jnp.int32)

    def match_end(self, tokens_BS, lengths_B):
        """The end index of `longest_match` (-1 where nothing matches)."""
        return self.longest_match(tokens_BS, lengths_B)[0]

    def forward_passes(self, gamma: int) -> int:
        return 0     # no model

    # -- as the lookup half of `HybridDrafter` (the interface `SuffixDrafter` shares)
    @property
    def match_range(self) -> tuple[int, int]:
        """The shortest and longest suffix it matches."""
        return self.min_ngram, self.max_ngram

    def match(self, params, tokens_BS, lengths_B):
        """(what `follow` continues from, the longest suffix match's length [B], 0: none)."""
        end_B, n_B = self.longest_match(tokens_BS, lengths_B)
        return end_B, n_B

    def follow(self, params, tokens_BS, lengths_B, found, gamma):
        """The gamma-token proposal [B, gamma] from `match`'s result."""
        return self.continuation(tokens_BS, lengths_B, found, gamma)

    @staticmethod
    def continuation(tokens_BS, lengths_B, end_B, gamma):
        """gamma tokens after the match ending at end_B (-1: none, repeat the last token),
        continuing cyclically through tokens[start:L]: a repeating pattern keeps repeating."""
        start_B = jnp.where(end_B >= 0, end_B + 1, lengths_B - 1)
        period_B = jnp.maximum(lengths_B - start_B, 1)
        idx_BG = start_B[:, None] + jnp.arange(gamma)[None, :] % period_B[:, None]
        return jnp.take_along_axis(tokens_BS, jnp.clip(idx_BG, 0, tokens_BS.shape[1] - 1), axis=1).astype(jnp.int32)

    def propose(self, params, state, context, key_B, gamma, cfg):
        tokens_BG = self.continuation(context.tokens_BS, context.lengths_B,
                                   self.match_end(context.tokens_BS, context.lengths_B), gamma)
        q_BGV = jax.nn.one_hot(tokens_BG, self.vocab_size, dtype=jnp.float32)
        return tokens_BG, q_BGV, state

    # -- trees: k branches, the continuations of the k best earlier matches ------------------
    @staticmethod
    def _branches(tree) -> tuple[int, int]:
        """(k, depth) of a tree of k chains from the root (branching (k, 1, ..., 1))."""
        if isinstance(tree, trees_lib.TreeShape):
            depth = tree.max_depth
            k = tree.level(1)[1]
            if tree == trees_lib.TreeShape.from_branching((k,) + (1,) * (depth - 1)):
                return k, depth
        raise ValueError(f"the n-gram drafter drafts k chains from the root (e.g. --config.tree=branching:3,1,1,1), "
                         f"one per earlier match; got {tree}")

    def check_tree(self, tree) -> None:
        self._branches(tree)

    def tree_forward_passes(self, tree) -> int:
        return 0

    def propose_tree(self, params, state, context, key_B, tree, cfg, children):
        """Branch i continues the i-th best earlier match of the suffix (longer n-gram first,
        then the latest); branches that share a prefix are merged (the later copy is padding
        and its children hang from the earlier one), so siblings are distinct. Deterministic."""
        k, D = self._branches(tree)
        tokens_BS, lengths_B = context.tokens_BS, context.lengths_B
        B, Lmax = tokens_BS.shape
        m_BS = self._match_lengths(tokens_BS, lengths_B)
        score_BS = jnp.where(m_BS > 0, m_BS * Lmax + jnp.arange(Lmax)[None], -1)
        best_v_Bk, end_Bk = jax.lax.top_k(score_BS, k)
        found_Bk = best_v_Bk >= 0
        # Branch 0 always exists (no match: repeat the last token, as the linear proposal does).
        end_Bk = jnp.where(found_Bk, end_Bk, -1).astype(jnp.int32)
        branch_ok_Bk = found_Bk.at[:, 0].set(True)
        toks_BkD = jax.vmap(lambda e: self.continuation(tokens_BS, lengths_B, e, D), in_axes=1, out_axes=1)(end_Bk)
        # canon[b, i, d]: the first branch j with the same first d+1 tokens (and a valid branch).
        same_prefix_Bkk = jnp.ones((B, k, k), bool)
        nodes_tok, nodes_par, nodes_ok = [], [], []
        canon_prev_Bk = None
        for d in range(D):
            same_prefix_Bkk &= toks_BkD[:, :, None, d] == toks_BkD[:, None, :, d]
            cand_Bkk = same_prefix_Bkk & branch_ok_Bk[:, None, :]
            canon_Bk = jnp.argmax(cand_Bkk, axis=2).astype(jnp.int32)      # first j matching i
            ok_Bk = branch_ok_Bk & (canon_Bk == jnp.arange(k)[None])
            parent_Bk = (jnp.full((B, k), -1, jnp.int32) if d == 0
                         else (d - 1) * k + canon_prev_Bk)
            nodes_tok.append(toks_BkD[:, :, d])
            nodes_par.append(parent_Bk)
            nodes_ok.append(ok_Bk)
            canon_prev_Bk = canon_Bk
        N = k * D
        draft = trees_lib.DraftTree(
            tokens_BN=jnp.concatenate(nodes_tok, axis=1), parents_BN=jnp.concatenate(nodes_par, axis=1),
            depths_BN=jnp.broadcast_to(jnp.repeat(jnp.arange(1, D + 1, dtype=jnp.int32), k)[None], (B, N)),
            valid_BN=jnp.concatenate(nodes_ok, axis=1), mode="deterministic", max_depth=D)
        # Deterministic children: each child's q is its own one-hot (the verifier builds it); the
        # rows here are informative only.
        return draft, jnp.zeros((B, N + 1, self.vocab_size), jnp.float32), state

    def commit(self, state, new_lengths_B, accepted=None):
        return state


# --------------------------------------------------------------------- the registered kind
@dataclasses.dataclass(frozen=True)
class NGramSettings:
    max_ngram: int = 3      # the longest suffix n-gram looked up in the context
    min_ngram: int = 1      # the shortest


def _build(s: NGramSettings, ctx):
    return NGramDrafter(ctx.target.vocab_size, max_ngram=s.max_ngram, min_ngram=s.min_ngram), None


def check_lookup_trees(job) -> None:
    """Refuse, before any weight loads, a tree prompt lookup cannot draft (it drafts k chains
    from the root only, `NGramDrafter.check_tree`): ValueError naming ``tree`` or
    ``adaptive_trees``."""
    lookup = NGramDrafter(vocab_size=1)
    for tree in job.trees:
        try:
            lookup.check_tree(tree)
        except ValueError as e:
            raise ValueError(f"{job.tree_setting}={job.tree_value!r}: {e}") from None


def _check(s: NGramSettings, job) -> None:
    check_lookup_trees(job)


register_drafter("ngram", NGramSettings, _build, check=_check, description="prompt lookup")
