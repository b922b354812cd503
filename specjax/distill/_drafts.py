"""Draft choices for distillation.

- ``target_layers``: a subset of the target's layers (default its first three), with the
  target's embedding, final norm and head: the early-exit draft, as a trainable start.
- ``fresh``: a small random config of the target's width and vocabulary (its embedding and
  head shared with the target).
- ``head_vocab > 0`` on either: a reduced head over the most frequent tokens (see
  `specjax.models.reduced_head`); the draft's largest cost, the V x D output layer, shrinks
  by V / |S| while sampling stays exact (q = 0 off the head).

What is trained: the layers and the final norm; the head too with ``train_head`` (then it is
stored in the artifact; otherwise it is the target's embedding rows and is shared). The
embedding is always the target's, frozen and shared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models import Llama, ModelConfig
from specjax.models import stack_layers
from specjax.models.reduced_head import ReducedHeadLlama, reduce_head


@dataclasses.dataclass(frozen=True)
class DraftChoice:
    kind: str = "target_layers"             # 'target_layers' | 'fresh'
    layers: tuple[int, ...] = (0, 1, 2)     # target_layers: which target layers to start from
    num_layers: int = 2                     # fresh
    ffn_size: int = 1536                    # fresh
    head_vocab: int = 0                     # 0: full vocabulary
    train_head: bool = False
    # > 0: the reduced head holds the fewest most frequent continuation tokens that cover this
    # share of the training data's continuation tokens (head_vocab then caps it; 0: no cap)
    head_vocab_coverage: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.head_vocab_coverage <= 1.0:
            raise ValueError(f"config.draft.head_vocab_coverage={self.head_vocab_coverage}: a share in [0, 1] "
                             "(0: the size is head_vocab)")
        if self.head_vocab < 0:
            raise ValueError(f"config.draft.head_vocab={self.head_vocab}: must be >= 0 (0: the full vocabulary)")

    @property
    def reduced(self) -> bool:
        """Whether the head is over a subset of the vocabulary (a size or a coverage given)."""
        return bool(self.head_vocab or self.head_vocab_coverage)

    @classmethod
    def from_config(cls, c) -> "DraftChoice":
        return cls(kind=c.kind, layers=tuple(int(i) for i in c.layers), num_layers=int(c.num_layers),
                   ffn_size=int(c.ffn_size), head_vocab=int(c.head_vocab), train_head=bool(c.train_head),
                   head_vocab_coverage=float(c.get("head_vocab_coverage", 0.0)))

    @property
    def shared(self) -> tuple[str, ...]:
        """Top-level param names taken from the target (not stored with the draft)."""
        if self.head_vocab and not self.train_head:
            return ("embed", "head_from_embed")
        return ("embed",)

    @property
    def trainable(self) -> tuple[str, ...]:
        names = ("layers", "final_norm")
        if self.train_head:
            names += ("head",) if self.head_vocab else ("lm_head",)
        return names


def select_layers(params, config: ModelConfig, layer_ids) -> tuple[dict, ModelConfig]:
    """The given target layers (in order), with the same embedding, final norm and head."""
    ids = [int(i) for i in layer_ids]
    if not ids or min(ids) < 0 or max(ids) >= config.num_layers:
        raise ValueError(f"layer ids {ids} outside [0, {config.num_layers})")
    p = dict(params)
    layers = stack_layers(p["layers"])
    p["layers"] = jax.tree.map(lambda x: x[jnp.asarray(ids)], layers)
    return p, config.layers_config(ids, scan_layers=True, linear_op="xla")


def build_draft(choice: DraftChoice, target: Llama, target_params, *, key, head_ids=None):
    """(draft model, draft params) for a choice; `head_ids` required when head_vocab > 0."""
    tp = target_params
    if choice.kind == "target_layers":
        params, cfg = select_layers(tp, target.config, choice.layers)
        model = Llama(cfg)
    elif choice.kind == "fresh":
        tc = target.config
        cfg = tc.replace(num_layers=choice.num_layers, ffn_size=choice.ffn_size, scan_layers=True, linear_op="xla",
                         tie_embeddings=True)
        model = Llama(cfg)
        params = dict(model.init_params(key))
        params["embed"] = tp["embed"]
    else:
        raise ValueError(f"unknown draft kind {choice.kind!r}: expected 'target_layers' or 'fresh'")
    params = dict(params)
    if choice.train_head and not choice.head_vocab and cfg.tie_embeddings:
        # A trainable full head must not move the shared input embedding: untie it.
        params["lm_head"] = params["embed"].T
        cfg = cfg.replace(tie_embeddings=False)
        model = Llama(cfg)
    if choice.head_vocab_coverage and not choice.head_vocab:
        raise ValueError("draft.head_vocab_coverage: the head's size is chosen from the data first "
                         "(`_setup.head_vocabulary`, then `_setup.with_head_size`)")
    if choice.head_vocab:
        if head_ids is None:
            raise ValueError("head_vocab > 0 needs head_ids (the most frequent tokens)")
        if len(head_ids) != choice.head_vocab:
            raise ValueError(f"{len(head_ids)} head ids for head_vocab={choice.head_vocab}")
        model, params = reduce_head(model, params, head_ids)
    return model, params


def is_reduced(model) -> bool:
    return isinstance(model, ReducedHeadLlama)
