"""A Llama decoder whose output head covers a subset S of the vocabulary.

The embedding still takes every token id (the target may commit any token), but the head
scores only the |S| tokens in ``params['head_ids']``; every other token gets logit -inf, so the
draft's q is exactly zero there. Speculative sampling stays exact: the verifier only needs
q to be the distribution the draft sampled from. The acceptance rate is at most p(S), so S is
chosen as the tokens the target emits most often. For SmolLM2-135M the full head
(49152 x 576) is a fifth of the weights; an 8192-token head costs a sixth of that.

Params: the Llama params (``embed`` [V, D] full vocabulary, ``layers``, ``final_norm``) plus
``head_ids`` [S] int32 (ascending) and ``head`` [S, D] (row i scores token head_ids[i]; for a
head tied to the target's embedding, ``embed[head_ids]``, materialized once).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.models.config import CorruptCheckpointError, ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Llama


@dataclasses.dataclass(frozen=True)
class ReducedHeadLlama:
    """Protocol model (`specjax.models.DecoderModel`): full-vocabulary logits, -inf off S."""
    config: ModelConfig        # vocab_size = the full vocabulary
    head_size: int

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def base(self) -> Llama:
        return Llama(self.config)

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        return self.base.init_cache(batch_size, capacity)

    def hidden_states(self, params, tokens_BT, cache, num_valid_B=None, tree=None):
        return self.base.hidden_states(params, tokens_BT, cache, num_valid_B, tree=tree)

    def head_logits(self, params, h_BTD):
        """float32 logits [B, T, S] over the head's tokens (soft-capped as the target's)."""
        from specjax.models.llama import softcap
        return softcap(jnp.einsum("btd,sd->bts", h_BTD, params["head"].astype(h_BTD.dtype),
                                  preferred_element_type=jnp.float32), self.base.config.final_softcap)

    def scatter(self, params, logits_BTS):
        """Full-vocabulary logits [B, T, V]: the head's logits at head_ids, -inf elsewhere."""
        B, T, _ = logits_BTS.shape
        full = jnp.full((B, T, self.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, :, params["head_ids"]].set(logits_BTS)

    def apply(self, params, tokens_BT, cache, num_valid_B=None, tree=None):
        h, cache = self.hidden_states(params, tokens_BT, cache, num_valid_B, tree=tree)
        return self.scatter(params, self.head_logits(params, h)), cache


def check_vocab_map(ids, vocab_size: int, size: int, where: str) -> np.ndarray:
    """`ids` (int64) when it is a vocabulary map a draft can score through: one dimension of
    `size` integers, each in [0, vocab_size), none repeated. Else `CorruptCheckpointError` naming
    `where` and the fault: a repeated id would give the draft a q that sums to less than 1 (its
    probability split between two rows, one of them read), an id outside the vocabulary a NaN q."""
    a = np.asarray(ids)
    if a.ndim != 1 or a.shape[0] != size:
        raise CorruptCheckpointError(f"{where}: a vocabulary map of shape {a.shape}, the draft declares {size} ids")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise CorruptCheckpointError(f"{where}: the vocabulary map holds non-integer ids ({a.dtype})")
    a = a.astype(np.int64)
    bad = a[(a < 0) | (a >= vocab_size)]
    if bad.size:
        raise CorruptCheckpointError(f"{where}: {bad.size} vocabulary-map ids outside [0, {vocab_size}) "
                                     f"(e.g. {int(bad[0])})")
    uniq, counts = np.unique(a, return_counts=True)
    if uniq.size != a.size:
        raise CorruptCheckpointError(f"{where}: {a.size - uniq.size} repeated vocabulary-map ids "
                                     f"(e.g. {int(uniq[counts > 1][0])}); each token must appear once")
    return a


def check_draft_vocab_maps(d2t, t2d, vocab_size: int, draft_vocab_size: int, where: str) -> np.ndarray:
    """The target ids (int64 [draft_vocab_size], in draft-row order) of an EAGLE-3 draft
    vocabulary stored as the reference code stores it: ``d2t`` (draft row i is target token
    ``i + d2t[i]``) and ``t2d`` (bool [vocab_size], true exactly at those target tokens; None when
    the file has none). The ids must be a vocabulary map (`check_vocab_map`: in range, none
    repeated) and ``t2d`` must mark exactly them; else `CorruptCheckpointError` naming `where`
    (the file) and the fault."""
    d = np.asarray(d2t)
    if d.ndim != 1 or d.shape[0] != draft_vocab_size:
        raise CorruptCheckpointError(f"{where}: 'd2t' has shape {d.shape}, the draft vocabulary has "
                                     f"{draft_vocab_size} rows (draft_vocab_size)")
    if d.dtype == bool:
        raise CorruptCheckpointError(f"{where}: 'd2t' holds booleans; it must hold integer offsets")
    with np.errstate(over="ignore", invalid="ignore"):
        ids = np.arange(draft_vocab_size, dtype=np.int64) + (d if d.dtype.kind == "f" else d.astype(np.int64))
    ids = check_vocab_map(ids, vocab_size, draft_vocab_size, f"{where}: 'd2t' (row i -> target token i + d2t[i])")
    if t2d is None:
        return ids
    t = np.asarray(t2d)
    if t.ndim != 1 or t.shape[0] != vocab_size:
        raise CorruptCheckpointError(f"{where}: 't2d' has shape {t.shape}, the target vocabulary has "
                                     f"{vocab_size} tokens")
    if t.dtype != bool:
        if t.dtype.kind not in "iu" or np.any((t != 0) & (t != 1)):
            raise CorruptCheckpointError(f"{where}: 't2d' must hold booleans (or 0/1), got {t.dtype} values")
        t = t.astype(bool)
    want = np.zeros(vocab_size, bool)
    want[ids] = True
    wrong = np.flatnonzero(t != want)
    if wrong.size:
        i = int(wrong[0])
        raise CorruptCheckpointError(
            f"{where}: 't2d' disagrees with 'd2t' at {wrong.size} target tokens (e.g. token {i}: t2d says "
            f"{bool(t[i])}, d2t {'maps a draft row to it' if want[i] else 'maps no row to it'}); t2d must be "
            f"true exactly at the tokens d2t maps to")
    return ids


def reduce_head(model: Llama, params, head_ids) -> tuple[ReducedHeadLlama, dict]:
    """A `ReducedHeadLlama` whose head is `model`'s head restricted to `head_ids`."""
    ids = np.unique(np.asarray(head_ids, np.int64))
    if ids.size == 0 or ids[0] < 0 or ids[-1] >= model.vocab_size:
        raise ValueError(f"head_ids must be non-empty ids in [0, {model.vocab_size})")
    p = dict(params)
    ids_j = jnp.asarray(ids, jnp.int32)
    if model.config.tie_embeddings:
        head = jnp.take(p["embed"], ids_j, axis=0)
    else:
        head = jnp.take(p.pop("lm_head"), ids_j, axis=1).T
    p["head"] = head
    p["head_ids"] = ids_j
    return ReducedHeadLlama(model.config, int(ids.size)), p


def full_head(model: ReducedHeadLlama, params) -> tuple[Llama, dict]:
    """The same decoder with a full-vocabulary head, for formats that cannot express a reduced
    one (a Hugging Face checkpoint has no -inf logits). The head rows of S are kept; every other
    row is the embedding's (tied heads: exactly the original full head; a trained head: its S
    rows plus the embedding's rows elsewhere, so the result differs off S)."""
    p = dict(params)
    ids = p.pop("head_ids")
    head = p.pop("head")
    embed = p["embed"]
    if bool(jnp.array_equal(head, jnp.take(embed, ids, axis=0))):
        return Llama(model.config.replace(tie_embeddings=True)), p
    p["lm_head"] = embed.at[ids].set(head.astype(embed.dtype)).T
    return Llama(model.config.replace(tie_embeddings=False)), p
