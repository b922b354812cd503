"""Lookup where the text repeats itself, a model drafter elsewhere.

Retrieval and model drafts win on different text: copying from the prompt is nearly free and
long-sighted where the output quotes its input (summaries, retrieval-augmented answers, code
edits), while a draft model or feature head guesses the next words of free text. SAM-Decoding
(Hu et al., ACL 2025, arXiv:2411.10666) picks between a retrieval draft and a model draft
(EAGLE-2) each step by the length of the suffix match; `HybridDrafter` applies that rule to
specjax's n-gram drafter (`NGramDrafter`) and any model drafter (a feature head, the distilled
draft).

Rule, per row and round: if the longest suffix n-gram (n <= ``retrieval.max_ngram``) that
occurs earlier in the row's committed tokens has at least ``min_match`` tokens, the row's
proposal is the n-gram continuation (one-hot q); otherwise it is the model's (q as the model
sampled it). The choice reads only the committed tokens, never the round's random keys, so each
row's (tokens, q) is exactly what one of two exact drafters would have proposed: the
verification stays exact.

The lookup half may also be suffix decoding across requests (`SuffixDrafter`, SuffixDecoding's
rule): the match is then searched in the row's tokens and a corpus of earlier requests, and the
proposal is the continuation that followed the match most often. Its corpus travels with the
model's params as `HybridParams` (``lookup_params=True``), so it changes between requests
without recompiling; the rule still reads only committed tokens and that corpus.

The model keeps its own state across rounds it sits out, as it does across adaptive gamma = 0
rounds: its next ``propose`` catches up on the committed tokens it has not seen. When every
row takes the n-gram draft the model does not run at all (`lax.cond`); otherwise it runs for
the batch and the rows that take the n-gram draft discard its proposals (their tentative
entries are dropped at `commit`, as after any rejection). Finished rows (`DraftContext.active_B`
False) do not keep the model running: their proposals are never committed, so in the lookup-only
branch they get the lookup continuation whatever the rule says. ``forward_passes`` reports the
model's count for every round, an upper bound.

Adaptive gamma tells the two halves apart (`specjax.decoding` adaptive module doc: regimes):
``regime_B`` says which half drafts each row's next round (``MODEL`` = 0, ``LOOKUP`` = 1; a round
with any active row on the model is a model round), and the policy keeps an acceptance estimate,
a current gamma and calibrated round times per half (`for_regime` holds the drafter to one half
while `Engine.round_times` times it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters._ngram import NGramDrafter
from specjax.drafters._protocol import Capabilities, DraftContext
from specjax.drafters._registry import register_drafter
from specjax.drafters._suffix import SuffixCache, SuffixDrafter, SuffixSettings, check_cache_dir, remember


@struct.dataclass
class HybridParams:
    """A hybrid's params when its lookup half has some (a suffix drafter's corpus)."""
    model: Any
    lookup: Any


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """Chains from lookup (``retrieval``: prompt lookup, `NGramDrafter`, or suffix decoding,
    `SuffixDrafter`) when the suffix match has >= ``min_match`` tokens, else from ``model`` (a
    drafter with its own state: `FeatureHeadDrafter`, `MedusaDrafter`, `ModelDrafter`, ...). The
    params are the model's, or a `HybridParams` with ``lookup_params`` (the lookup half's too)."""
    retrieval: Any
    model: Any
    min_match: int = 3
    force: int | None = None       # None: the rule; MODEL or LOOKUP: every row drafts so (calibration)
    lookup_params: bool = False

    MODEL = 0
    LOOKUP = 1
    regimes = 2
    regime_names = ("model", "lookup")

    def __post_init__(self):
        if self.force not in (None, self.MODEL, self.LOOKUP):
            raise ValueError(f"force must be None, {self.MODEL} (model) or {self.LOOKUP} (lookup), got {self.force!r}")
        lo, hi = self.retrieval.match_range
        if not lo <= self.min_match <= hi:
            raise ValueError(f"min_match={self.min_match} must lie in [{lo}, {hi}], the suffix lengths the lookup "
                             f"drafter matches")
        if self.retrieval.vocab_size != self.model.vocab_size:
            raise ValueError(f"vocab mismatch: lookup drafter {self.retrieval.vocab_size}, model drafter "
                             f"{self.model.vocab_size}")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.capabilities.feature_layers

    @property
    def capabilities(self) -> Capabilities:
        """The model half's needs (features, its cache), two draft sources, chains only."""
        m = self.model.capabilities
        return Capabilities(feature_layers=m.feature_layers, own_cache=m.own_cache, trees=False, regimes=self.regimes)

    def _parts(self, params):
        """(the model's params, the lookup half's or None)."""
        if not self.lookup_params:
            return params, None
        if not isinstance(params, HybridParams):
            raise ValueError(f"this hybrid's lookup half ({type(self.retrieval).__name__}) has params of its own: "
                             f"give HybridParams(model=..., lookup=...), got {type(params).__name__}")
        return params.model, params.lookup

    def init(self, params, prompt_BP, prompt_lengths_B, capacity, features_BPF=None):
        params = self._parts(params)[0]
        if self.feature_layers:
            return self.model.init(params, prompt_BP, prompt_lengths_B, capacity, features_BPF=features_BPF)
        return self.model.init(params, prompt_BP, prompt_lengths_B, capacity)

    def uses_lookup(self, params, context: DraftContext):
        """[B] bool: the rows whose round drafts by lookup (the rule of the module doc)."""
        return self._match(params, context)[1]

    def _match(self, params, context: DraftContext):
        """(what the lookup continues from, whether the row drafts by lookup [B])."""
        found, n_B = self.retrieval.match(self._parts(params)[1], context.tokens_BS, context.lengths_B)
        if self.force is not None:
            return found, jnp.full(n_B.shape, self.force == self.LOOKUP)
        return found, n_B >= self.min_match

    def regime_B(self, params, context: DraftContext):
        """[B] int32: the half that drafts each row's next round (``LOOKUP`` or ``MODEL``)."""
        return jnp.where(self.uses_lookup(params, context), self.LOOKUP, self.MODEL).astype(jnp.int32)

    def for_regime(self, regime: int) -> "HybridDrafter":
        """This drafter with every row drafting from one half (``MODEL`` or ``LOOKUP``): what
        `Engine.round_times` times for each regime."""
        return dataclasses.replace(self, force=regime)

    def lookup_rounds(self, tokens, prompt_length: int, round_sizes, params=None) -> list[bool]:
        """The rule replayed after a generation for one row (`uses_lookup` itself, one call over
        all rounds): whether each round started with a suffix match, from the row's tokens
        (prompt and generated), the tokens each round committed and, for a lookup half with
        params, ``params`` (the hybrid's, as the run had them)."""
        starts = int(prompt_length) + np.concatenate([[0], np.cumsum(round_sizes, dtype=np.int64)[:-1]])
        tokens_BS = jnp.broadcast_to(jnp.asarray(tokens, jnp.int32)[None], (len(starts), len(tokens)))
        ctx = DraftContext(tokens_BS=tokens_BS, lengths_B=jnp.asarray(starts, jnp.int32), target_cache=None)
        return np.asarray(jax.jit(self.uses_lookup)(params, ctx)).tolist()

    def forward_passes(self, gamma: int) -> int:
        return self.model.forward_passes(gamma)        # an upper bound: lookup rounds run no model

    def propose(self, params, state, context: DraftContext, key_B, gamma, cfg):
        found, lookup_B = self._match(params, context)
        model_params, lookup_params = self._parts(params)
        look_BG = self.retrieval.follow(lookup_params, context.tokens_BS, context.lengths_B, found, gamma)

        def one_hot(tok_BG):
            return jax.nn.one_hot(tok_BG, self.vocab_size, dtype=jnp.float32)

        def lookup_only(state):
            return look_BG, one_hot(look_BG), state

        def with_model(state):
            tok_BG, q_BGV, state = self.model.propose(model_params, state, context, key_B, gamma, cfg)
            if lookup_B.shape[0] == 1:          # one row, and it drafts by the model in this branch
                return tok_BG, q_BGV, state
            return (jnp.where(lookup_B[:, None], look_BG, tok_BG),
                    jnp.where(lookup_B[:, None, None], one_hot(look_BG), q_BGV), state)

        # Finished rows never commit their proposals: they need not keep the model running.
        idle_B = jnp.zeros_like(lookup_B) if context.active_B is None else ~context.active_B
        return jax.lax.cond(jnp.all(lookup_B | idle_B), lookup_only, with_model, state)

    def commit(self, state, new_lengths_B, accepted=None):
        return self.model.commit(state, new_lengths_B)

    def check_gamma(self, gamma: int) -> None:
        """The model half's longest chain, if it has one (the lookup half drafts any length)."""
        if callable(getattr(self.model, "check_gamma", None)):
            self.model.check_gamma(gamma)

    def check_tree(self, tree) -> None:
        raise ValueError("the hybrid drafter (prompt lookup + a model) drafts chains: use an integer gamma, "
                         "or the model drafter on its own for trees")

    def tree_forward_passes(self, tree) -> int:
        raise ValueError("the hybrid drafter drafts chains only")

    def propose_tree(self, *args, **kwargs):
        raise NotImplementedError("the hybrid drafter drafts chains only; see check_tree")


# --------------------------------------------------------------------- the registered kind
HYBRID_MODELS = ("head", "distilled", "model", "parallel")      # the kinds the model half may be
HYBRID_LOOKUPS = ("ngram", "suffix")                            # the lookup half: prompt lookup, suffix decoding


@dataclasses.dataclass(frozen=True)
class HybridSettings:
    hybrid_model: str = "head"       # the model half: one of HYBRID_MODELS, built as its own kind
    min_match: int = 0               # suffix-match tokens that make a round prompt lookup's (0: max_ngram)
    max_ngram: int = 3
    min_ngram: int = 1
    draft_model: str = ""            # the model half's draft ("" = the one shipped for the target)
    hybrid_lookup: str = "ngram"     # the lookup half: one of HYBRID_LOOKUPS
    # suffix lookup only (the 'suffix' kind's keys and defaults): the longest suffix matched, the
    # corpus ring's slots, and the directory its corpus is loaded from and saved to ("" = none)
    suffix_max_match: int = SuffixSettings.suffix_max_match
    suffix_tokens: int = SuffixSettings.suffix_tokens
    suffix_cache_dir: str = SuffixSettings.suffix_cache_dir


def _build(s: HybridSettings, ctx):
    """Lookup (prompt lookup, or suffix decoding over the request and the cache directory's
    corpus) where the suffix match has at least ``min_match`` tokens (0: ``max_ngram``), else
    the drafter ``hybrid_model`` (built as its own kind)."""
    from specjax.drafters._registry import build_drafter
    model, params = build_drafter(s.hybrid_model, {"draft_model": s.draft_model}, ctx)
    min_match = int(s.min_match or s.max_ngram)
    vocab = ctx.target.vocab_size
    if s.hybrid_lookup == "suffix":
        lookup = SuffixDrafter(vocab, max_match=s.suffix_max_match, min_match=1)
        cache = (SuffixCache.load(s.suffix_cache_dir, s.suffix_tokens, vocab) if s.suffix_cache_dir
                 else SuffixCache(s.suffix_tokens, vocab))
        return (HybridDrafter(lookup, model, min_match=min_match, lookup_params=True),
                HybridParams(model=params, lookup=cache.corpus()))
    lookup = NGramDrafter(vocab, max_ngram=s.max_ngram, min_ngram=s.min_ngram)
    return HybridDrafter(lookup, model, min_match=min_match), params


def _check(s: HybridSettings, job) -> None:
    """The model half, a draft for it, ``min_match`` within the n-gram range; chains only."""
    from specjax.drafters._shipped import SHIPPED_DRAFTS, SHIPPED_HEADS
    if s.hybrid_model not in HYBRID_MODELS:
        raise ValueError(f"hybrid_model={s.hybrid_model!r}: expected one of {', '.join(HYBRID_MODELS)}")
    if s.hybrid_lookup not in HYBRID_LOOKUPS:
        raise ValueError(f"hybrid_lookup={s.hybrid_lookup!r}: expected one of {', '.join(HYBRID_LOOKUPS)}")
    if s.hybrid_lookup == "suffix" and s.suffix_tokens < 2:
        raise ValueError(f"suffix_tokens={s.suffix_tokens!r}: the corpus needs at least 2 slots")
    if s.hybrid_lookup == "suffix":
        check_cache_dir(s)
    if s.hybrid_model == "parallel" and not s.draft_model:
        raise ValueError("drafter='hybrid' with hybrid_model='parallel' needs draft_model (a parallel drafter "
                         "written by specjax.distill)")
    if s.hybrid_model == "model" and not s.draft_model:
        raise ValueError("drafter='hybrid' with hybrid_model='model' needs draft_model (a path or registry name)")
    shipped = {"head": SHIPPED_HEADS, "distilled": SHIPPED_DRAFTS}.get(s.hybrid_model)
    if shipped is not None and not s.draft_model and job.target not in shipped:
        raise ValueError(f"drafter='hybrid' drafts with the {s.hybrid_model} shipped for {', '.join(sorted(shipped))}, "
                         f"and none ships for target {job.target!r}: give draft_model=<a {s.hybrid_model} directory "
                         f"written by specjax.distill>, or use drafter='ngram' (prompt lookup alone)")
    m = s.min_match
    if s.hybrid_lookup == "suffix" and (m or s.max_ngram) > s.suffix_max_match:
        # the suffix lookup matches at most suffix_max_match tokens (min_match 0 means max_ngram)
        raise ValueError(f"min_match={m or s.max_ngram!r}: with hybrid_lookup='suffix' expected an integer in "
                         f"[1, suffix_max_match] = [1, {s.suffix_max_match}]")
    if m:
        if m < 1:
            raise ValueError(f"min_match={m!r}: expected an integer >= 1")
        if s.hybrid_lookup != "suffix" and not s.min_ngram <= m <= s.max_ngram:
            raise ValueError(f"min_match={m!r}: expected an integer in [min_ngram, max_ngram] = "
                             f"[{s.min_ngram}, {s.max_ngram}]")
    if job.trees:
        raise ValueError(f"{job.tree_setting}={job.tree_value!r}: drafter='hybrid' (the default) drafts chains only; "
                         f"for token trees choose a drafter that drafts them (drafter='head', 'ngram', "
                         f"'distilled', ...)")


def _describe(s: HybridSettings, drafter: HybridDrafter, record) -> tuple[str, dict]:
    """Which rounds prompt lookup drafted (replayed from the committed tokens; suffix lookups
    matched a corpus that is not replayed here: the kind and its corpus only)."""
    if drafter.lookup_params:
        text = (f"suffix decoding over the request and a corpus of {s.suffix_tokens} token slots"
                f"{f' (cache {s.suffix_cache_dir})' if s.suffix_cache_dir else ''} where the last "
                f"{drafter.min_match} tokens matched, the {s.hybrid_model} elsewhere")
        return text, {"suffix_cache_dir": s.suffix_cache_dir, "suffix_tokens": s.suffix_tokens}
    lookup = drafter.lookup_rounds(list(record.prompt_ids) + list(record.tokens), len(record.prompt_ids),
                                   list(record.round_sizes))
    text = (f"prompt lookup drafts where the last {drafter.min_match} tokens occurred earlier (they did at the start "
            f"of {sum(lookup)} of {len(lookup)} rounds), the {s.hybrid_model} elsewhere")
    return text, {"lookup_rounds": sum(lookup)}


def _after_run(s: HybridSettings, record) -> None:
    """A suffix lookup's cache directory keeps the run's prompt and output (as the 'suffix' kind's)."""
    if s.hybrid_lookup == "suffix" and s.suffix_cache_dir:
        remember(s.suffix_cache_dir, s.suffix_tokens, [tuple(record.prompt_ids) + tuple(record.tokens)])


register_drafter("hybrid", HybridSettings, _build, check=_check, describe=_describe, after_run=_after_run,
                 description="lookup (prompt lookup or suffix decoding), else a model (SAM-Decoding's rule)")
