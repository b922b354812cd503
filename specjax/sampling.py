"""Logits processing shared by the draft and the target.

Speculative decoding is lossless only if the draft's proposal distribution ``q`` and the
target's distribution ``p`` are the distributions the tokens are *actually* sampled from and
verified against. Both sides therefore go through ONE function, :func:`probabilities`, with
the same :class:`SamplingConfig`, so temperature / top-k / top-p are applied identically.

Static vs traced
----------------
:class:`SamplingConfig` is a ``flax.struct.dataclass`` (a pytree):

* the *strategy* is static (``pytree_node=False``, part of the tree structure, so changing it
  recompiles): ``greedy`` (temperature 0), ``use_top_k``, ``use_top_p``. A static flag that is
  off means the corresponding filter is not even traced (vocab is ~49k in the real model);
* the *numbers* are traced leaves: ``temperature`` (float32), ``top_k`` (int32, 0 = off),
  ``top_p`` (float32, 1.0 = off). Changing their values does NOT recompile.

Build configs with :meth:`SamplingConfig.make`, which takes Python numbers and derives the
static flags from them.

Per-row settings (a server's batch, each request with its own): :meth:`SamplingConfig.rows`
takes one temperature, top-k and top-p per row. Its numbers are arrays [B] against the
logits' leading (batch) axis, and its static flags are the same for every mix (``per_row``
on, ``greedy`` off, both filters traced), so one compiled program serves any mix. A row with
temperature 0 is greedy: its distribution is the one-hot of the argmax, which every verifier
treats exactly as greedy decoding (a one-hot q is accepted iff the target's argmax is the
proposal, and a one-hot residual or p yields the argmax). A filter's search runs only in
calls where some row uses it (``lax.cond``). Shapes are static as usual. The filters sort nothing: their thresholds
come from a binary search (see `_filtered_logits`).

Order of operations (same as the common HF convention): temperature, then top-k, then top-p,
then softmax. A per-row config adds, before the temperature, each row's logit bias and then
its penalties, and min-p after top-p.

Penalties
---------
A per-row config made with penalties (`SamplingConfig.rows`) changes a position's logits by the
tokens before it. With ``seen`` the prompt's tokens and ``c(x)`` the count of ``x`` among the
tokens generated before the position:

* repetition ``r`` (CTRL, Keskar et al. 2019, arXiv:1909.05858; the Hugging Face convention): a
  token in the prompt or generated gets ``l / r`` if its logit ``l > 0``, else ``l * r``;
* frequency ``f`` and presence ``a`` (the OpenAI API's definition): ``l - f c(x) - a [c(x) > 0]``,
  generated tokens only (the vLLM convention: the prompt does not count).

So a position's distribution depends on the drafted tokens before it too. The history is
counted from the committed tokens once per round (`SamplingConfig.with_history`) and moved along
drafted tokens: one token at a time in a draft rollout (`SamplingConfig.advance`), along each
tree path and each row of the verification block (`SamplingConfig.along`, `at_block`). Every
position of the target's block is thus scored under the history a target-only decode would have
at that position, which is what the verifiers' exactness needs; the draft uses the same rule on
its own path, so q stays the distribution it sampled from.

Constraints
-----------
A per-row config made with a ``constraint`` (`specjax.constraints`: a JSON schema or a regular
expression compiled into a token automaton) sets to -inf, after the penalties, the logits of the
tokens its row's automaton does not allow in the position's state. The state is a function of
the tokens before the position, carried exactly like the penalties' history: the engine keeps
each row's state after its committed tokens (`LoopState.constraint_B`, advanced by what each
round commits), and `advance` / `at_paths` move it along drafted tokens, each tree path and each
row of the verification block. A drafted token the automaton does not allow has target
probability 0, so it is rejected; the positions after it (state `DEAD_STATE`, nothing allowed)
are never committed.

Temperature scaling is computed as ``(logits - max(logits)) / temperature``, which is the same
distribution as ``logits / temperature`` (softmax is shift-invariant) but cannot overflow: the
largest entry is exactly 0 and every other one is ``<= 0`` (at worst ``-inf``, an exact zero
probability), so any positive normal float32 temperature gives a finite, normalised
distribution; a tiny one tends to the greedy one-hot (ties shared), as it should. The only
temperatures rejected are those that are not a finite float32 at least ``MIN_TEMPERATURE``
(the smallest normal float32, ~1.18e-38): below it the value is subnormal or rounds to 0 in
float32, and XLA flushes subnormals to zero on CPU and GPU, so the division would be by 0. Ties: top-k keeps every token whose scaled logit is ``>=`` the k-th largest one,
and top-p keeps every token whose probability is ``>=`` the smallest kept one; so with ties at
the threshold more than k (or more than the minimal nucleus) tokens may survive. This rule is
deterministic and identical on both sides, which is what exactness needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
    "MIN_TEMPERATURE",
    "MAX_BIAS",
    "MAX_LOGIT_BIAS",
    "check_logit_bias",
    "check_penalties",
    "DEAD_STATE",
    "adjusted_logits",
    "MAX_REPETITION",
    "MAX_PRESENCE",
    "check_settings",
    "SamplingConfig",
    "probabilities",
    "log_probabilities",
    "sample",
]

MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
"""Smallest accepted positive temperature: the smallest normal float32 (~1.18e-38).

Smaller positive values are subnormal (or 0) in float32; XLA flushes subnormals to zero on
CPU/GPU, so ``x / T`` would divide by zero and give NaN. Every temperature from here up (and
finite) is safe because the scaling subtracts the max logit first (see the module docstring).
Use ``temperature = 0`` for greedy decoding."""

MAX_LOGIT_BIAS = 64      # (token id, value) pairs of a row's logit bias (a fixed shape: one program)
MAX_BIAS = 100.0         # the largest |value| of a logit bias entry (as the OpenAI API)
DEAD_STATE = -2          # an automaton state after a token it does not allow: nothing is allowed
MAX_REPETITION = 100.0   # a repetition penalty is in [1 / MAX_REPETITION, MAX_REPETITION]
MAX_PRESENCE = 2.0       # |presence| and |frequency| penalties at most this (as the OpenAI API)


@struct.dataclass
class SamplingConfig:
    """Sampling strategy (static) and its parameters (traced). See the module docstring."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    greedy: bool = struct.field(pytree_node=False, default=False)
    use_top_k: bool = struct.field(pytree_node=False, default=False)
    use_top_p: bool = struct.field(pytree_node=False, default=False)
    per_row: bool = struct.field(pytree_node=False, default=False)
    # per-row configs only (`rows`): min-p [B] (0 = off) and a logit bias, MAX_LOGIT_BIAS
    # (token id, value) pairs per row [B, M] (unused pairs: id 0, value 0)
    min_p: jax.Array | None = None
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    # configs with penalties only: repetition (1 = off), presence and frequency (0 = off), [B]
    # (`rows`) or scalars (`make`); and the token history a position's penalties read, set per round
    # by `with_history` and moved along drafted tokens by `advance` / `along`: ``counts``
    # (int32 [B, ..., V], each token's count among the generated tokens before the position)
    # and ``seen`` (bool [B, V], the prompt's tokens)
    repetition: jax.Array | None = None
    presence: jax.Array | None = None
    frequency: jax.Array | None = None
    counts: jax.Array | None = None
    seen: jax.Array | None = None
    # per-row configs with token automata only (`rows`, ``constraint``; `specjax.constraints`):
    # the stacked table ``fsm_next`` [states, classes] (-1: not allowed), each row's token classes
    # ``fsm_class`` [B, V], table offset ``fsm_offset`` [B] and start state ``fsm_start`` [B]
    # (its automaton's own numbering; -1: no automaton); and the
    # position's state ``fsm_state`` ([B, ...]), set per round by `with_history` and moved along
    # drafted tokens like the penalties' history
    fsm_next: jax.Array | None = None
    fsm_class: jax.Array | None = None
    fsm_offset: jax.Array | None = None
    fsm_start: jax.Array | None = None
    fsm_state: jax.Array | None = None

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> "SamplingConfig":
        """Build a config from Python numbers; the static flags follow from the values.

        ``greedy`` iff ``temperature == 0``; ``use_top_k`` iff ``top_k > 0`` (and not greedy);
        ``use_top_p`` iff ``top_p < 1`` (and not greedy). Greedy ignores top-k/top-p (the argmax
        survives both filters), so their flags are cleared to keep one canonical greedy config.

        ``ValueError`` unless ``temperature`` is 0 or a finite value ``>= MIN_TEMPERATURE`` (the
        smallest normal float32; see there), ``top_k >= 0`` and ``0 < top_p <= 1``.
        Penalties other than off (`check_penalties`; greedy too: the argmax of the penalized
        logits) make the config carry them as scalars (module docstring, "Penalties").
        """
        temperature, top_k, top_p = check_settings(temperature, top_k, top_p)
        rep, pres, freq = check_penalties(repetition_penalty, presence_penalty, frequency_penalty)
        extra = {} if (rep, pres, freq) == (1.0, 0.0, 0.0) else dict(
            repetition=jnp.asarray(rep, jnp.float32), presence=jnp.asarray(pres, jnp.float32),
            frequency=jnp.asarray(freq, jnp.float32))
        greedy = temperature == 0.0
        return cls(**extra,
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
            greedy=greedy,
            use_top_k=(not greedy) and top_k > 0,
            use_top_p=(not greedy) and top_p < 1.0,
        )

    @classmethod
    def rows(cls, temperature, top_k=None, top_p=None, min_p=None, logit_bias=None, repetition_penalty=None,
             presence_penalty=None, frequency_penalty=None, constraint=None) -> "SamplingConfig":
        """Per-row settings: one temperature (0 = greedy), top-k (0 = off), top-p (1 = off),
        min-p (0 = off) and logit bias (a dict token id -> value, at most `MAX_LOGIT_BIAS`
        entries; None or {} = none) per row of the batch, as sequences of equal length B (None:
        off for every row). The static flags do not depend on the values (module docstring),
        so any mix of the same B runs one compiled program. ``ValueError`` naming the row for a
        value `check_settings` or `check_logit_bias` refuses.

        Penalties (module docstring, "Penalties"): repetition (1 = off), presence and frequency
        (0 = off) per row. Given (any of the three not None), the config carries them for every
        row, a second program (the token history is counted every round); None for all three:
        the config has none (`check_penalties` says what is refused).

        ``constraint``: the rows' token automata stacked in one table (`specjax.constraints.stack`,
        a row without one has start -1); the config then masks each position by its row's
        automaton (module docstring, "Constraints"), a program of its own per table shape."""
        temperature = list(np.ravel(np.asarray(temperature, dtype=object)))
        B = len(temperature)
        column = lambda x, off: [off] * B if x is None else list(np.ravel(np.asarray(x, dtype=object)))  # noqa: E731
        top_k, top_p, min_p = column(top_k, 0), column(top_p, 1.0), column(min_p, 0.0)
        penalized = not (repetition_penalty is None and presence_penalty is None and frequency_penalty is None)
        rep, pres, freq = column(repetition_penalty, 1.0), column(presence_penalty, 0.0), column(frequency_penalty, 0.0)
        logit_bias = [None] * B if logit_bias is None else list(logit_bias)
        if B == 0 or not len(top_k) == len(top_p) == len(min_p) == len(logit_bias) == len(rep) == len(pres) \
                == len(freq) == B:
            raise ValueError(f"rows: one temperature, top_k, top_p, min_p, logit_bias and penalty per row, got {B}, "
                             f"{len(top_k)}, {len(top_p)}, {len(min_p)}, {len(logit_bias)} and "
                             f"{len(rep)}/{len(pres)}/{len(freq)} values")
        checked, ids, values = [], np.zeros((B, MAX_LOGIT_BIAS), np.int32), np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        penalties = []
        for i, row in enumerate(zip(temperature, top_k, top_p, min_p)):
            try:
                checked.append(check_settings(*row))
                bias = check_logit_bias(logit_bias[i])
                penalties.append(check_penalties(rep[i], pres[i], freq[i]))
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
            ids[i, :len(bias)], values[i, :len(bias)] = list(bias), list(bias.values())
        t, k, p, m = zip(*checked)
        extra = {}
        if penalized:
            r, pr, fr = (jnp.asarray(x, jnp.float32) for x in zip(*penalties))
            extra = dict(repetition=r, presence=pr, frequency=fr)
        if constraint is not None:
            if np.shape(constraint.start_B) != (B,):
                raise ValueError(f"rows: a constraint table for {np.shape(constraint.start_B)[0]} rows, not {B}")
            extra.update(fsm_next=jnp.asarray(constraint.next_sc, jnp.int32),
                         fsm_class=jnp.asarray(constraint.class_BV, jnp.int32),
                         fsm_offset=jnp.asarray(constraint.offset_B, jnp.int32),
                         fsm_start=jnp.asarray(constraint.start_B, jnp.int32))
        return cls(temperature=jnp.asarray(t, jnp.float32), top_k=jnp.asarray(k, jnp.int32),
                   top_p=jnp.asarray(p, jnp.float32), greedy=False, use_top_k=True, use_top_p=True, per_row=True,
                   min_p=jnp.asarray(m, jnp.float32), bias_ids=jnp.asarray(ids), bias_values=jnp.asarray(values),
                   **extra)

    @property
    def penalized(self) -> bool:
        """Whether the config has penalties (static: part of the pytree's structure)."""
        return self.repetition is not None

    @property
    def constrained(self) -> bool:
        """Whether the config has token automata (static: part of the pytree's structure)."""
        return self.fsm_next is not None

    @property
    def has_history(self) -> bool:
        """Whether a position's transform reads the tokens before it (penalties, automata)."""
        return self.penalized or self.constrained

    @property
    def moves(self) -> bool:
        """Whether the config holds a position's history (set by `with_history`): a drafter then
        moves it along its drafted tokens (`advance`, `at_paths`)."""
        return self.counts is not None or self.fsm_state is not None

    def with_history(self, tokens_BS: jax.Array, prompt_lengths_B: jax.Array, lengths_B: jax.Array, vocab: int,
                     fsm_state_B: jax.Array | None = None):
        """The config at the position after each row's committed tokens (a vocabulary of
        ``vocab``). Penalties: ``seen`` the prompt's tokens (slots < prompt length), ``counts``
        each token's count among the generated ones (slots in [prompt length, length)).
        Automata: ``fsm_state`` the row's start state if it has generated nothing yet or has no
        automaton (start -1: whatever ``fsm_state_B`` holds is another request's), else
        ``fsm_state_B`` (its state after the committed tokens, which the engine keeps). No-op
        without either."""
        out = self
        if self.constrained:
            own_B = (lengths_B > prompt_lengths_B) & (self.fsm_start >= 0)
            state_B = self.fsm_start if fsm_state_B is None else jnp.where(own_B, fsm_state_B, self.fsm_start)
            out = out.replace(fsm_state=state_B.astype(jnp.int32))
        if not self.penalized:
            return out
        B, S = tokens_BS.shape
        V = vocab
        slot_S = jnp.arange(S)[None]
        generated_BS = (slot_S >= prompt_lengths_B[:, None]) & (slot_S < lengths_B[:, None])
        prompt_BS = slot_S < prompt_lengths_B[:, None]
        rows_BS = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
        tok_BS = jnp.clip(tokens_BS, 0, V - 1)
        counts = jnp.zeros((B, V), jnp.int32).at[rows_BS, tok_BS].add(generated_BS.astype(jnp.int32))
        seen = jnp.zeros((B, V), jnp.int32).at[rows_BS, tok_BS].add(prompt_BS.astype(jnp.int32)) > 0
        return out.replace(counts=counts, seen=seen)

    def fsm_step(self, state: jax.Array, tokens: jax.Array) -> jax.Array:
        """Automaton states ``state`` [B, ...] after ``tokens`` (same shape): a row without an
        automaton (-1) stays so; a token its automaton does not allow leads to `DEAD_STATE`."""
        B = state.shape[0]
        cls = jnp.take_along_axis(self.fsm_class, jnp.clip(tokens, 0, self.fsm_class.shape[1] - 1).reshape(B, -1),
                                  axis=1).reshape(tokens.shape)
        offset = self.fsm_offset.reshape((B,) + (1,) * (state.ndim - 1))
        nxt = self.fsm_next[offset + jnp.maximum(state, 0), cls]
        return jnp.where(state < 0, state, jnp.where(nxt >= 0, nxt, DEAD_STATE))

    def advance(self, tokens_B: jax.Array, valid_B: jax.Array | None = None):
        """The config one generated token further (``counts`` [B, V] plus each row's token, the
        automaton state after it; a row with ``valid_B`` False unchanged). No-op without a
        history."""
        out = self
        if self.fsm_state is not None:
            nxt = self.fsm_step(self.fsm_state, tokens_B)
            out = out.replace(fsm_state=nxt if valid_B is None else jnp.where(valid_B, nxt, self.fsm_state))
        if self.counts is None:
            return out
        B = tokens_B.shape[0]
        add_B = jnp.ones((B,), jnp.int32) if valid_B is None else valid_B.astype(jnp.int32)
        return out.replace(counts=self.counts.at[jnp.arange(B), tokens_B].add(add_B, mode="drop"))

    def at_paths(self, tokens_BX: jax.Array, parents_X: jax.Array, rows_Y):
        """The config at Y positions at once, in a tree of drafted tokens ``tokens_BX`` with
        parents ``parents_X`` ([X] or [B, X]; an index into X, -1: the committed prefix): the
        position after node ``rows_Y[y]`` ([Y] or [B, Y]; -1: the committed prefix itself), whose
        history adds the tokens on its path (its ancestors and itself, in order). A chain is the
        tree whose node x has parent x - 1. -> ``counts`` [B, Y, V], ``fsm_state`` [B, Y]. No-op
        without a history."""
        if not self.moves:
            return self
        B, X = tokens_BX.shape
        parents_BX = jnp.broadcast_to(jnp.asarray(parents_X, jnp.int32), (B, X))
        rows_BY = jnp.broadcast_to(jnp.asarray(rows_Y, jnp.int32), (B,) + jnp.shape(rows_Y)[-1:])
        Y = rows_BY.shape[1]
        take = lambda x_BX, idx_BY: jnp.take_along_axis(x_BX, jnp.maximum(idx_BY, 0), axis=1)  # noqa: E731
        out = self
        if self.fsm_state is not None:
            # a node's state is its parent's after its token: X rounds reach every depth
            root_B1 = self.fsm_state[:, None]

            def deeper(_, s_BX):
                parent_BX = jnp.where(parents_BX < 0, root_B1, take(s_BX, parents_BX))
                return self.fsm_step(parent_BX, tokens_BX)
            s_BX = jax.lax.fori_loop(0, X, deeper, jnp.broadcast_to(root_B1, (B, X)))
            out = out.replace(fsm_state=jnp.where(rows_BY < 0, root_B1, take(s_BX, rows_BY)))
        if self.counts is None:
            return out
        # each node's path as a mask over nodes: itself, then its parent's path (X rounds)
        eye_BXX = jnp.broadcast_to(jnp.eye(X, dtype=bool), (B, X, X))

        def up(_, path_BXX):
            parent_path = jnp.take_along_axis(path_BXX, jnp.maximum(parents_BX, 0)[..., None], axis=1)
            return eye_BXX | (parent_path & (parents_BX >= 0)[..., None])
        path_BXX = jax.lax.fori_loop(0, X, up, eye_BXX)
        path_BYX = jnp.take_along_axis(path_BXX, jnp.maximum(rows_BY, 0)[..., None], axis=1) & (rows_BY >= 0)[..., None]
        b = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, Y, X))
        y = jnp.broadcast_to(jnp.arange(Y)[None, :, None], (B, Y, X))
        tok = jnp.broadcast_to(tokens_BX[:, None, :], (B, Y, X))
        base = jnp.broadcast_to(self.counts[:, None, :], (B, Y, self.counts.shape[-1]))
        return out.replace(counts=base.at[b, y, tok].add(path_BYX.astype(jnp.int32), mode="drop"))

    def at_block(self, tokens_BX: jax.Array, parents_BX: jax.Array | None = None):
        """The config at each row of a verification block ``[root, tokens_BX]`` (T = X + 1): row
        t after the drafted tokens on the path to node t - 1, a chain's first t (``parents_BX``
        None) or a tree's (`at_paths`)."""
        X = tokens_BX.shape[1]
        parents = jnp.arange(X, dtype=jnp.int32) - 1 if parents_BX is None else parents_BX
        return self.at_paths(tokens_BX, parents, jnp.arange(-1, X, dtype=jnp.int32))

    @classmethod
    def greedy_config(cls) -> "SamplingConfig":
        """Temperature 0: argmax decoding."""
        return cls.make(temperature=0.0)


def check_settings(temperature, top_k, top_p, min_p=None):
    """(temperature, top_k, top_p) as Python numbers (with ``min_p``: and min_p, in [0, 1]), or
    ``ValueError`` naming the bad one (the rules of `SamplingConfig.make`)."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"temperature must be a number, got {str(temperature)[:40]}") from None
    if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= float(np.finfo(np.float32).max)):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite float32 >= {MIN_TEMPERATURE:.6g} (the smallest "
            f"normal float32: smaller values are flushed to 0 and the scaling would divide by zero), "
            f"got {temperature!r}")
    try:
        integral = not isinstance(top_k, bool) and float(top_k) == int(top_k)
    except (TypeError, ValueError, OverflowError):
        integral = False
    if not integral:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {str(top_k)[:40]}")
    top_k = int(top_k)
    if top_k < 0 or top_k > np.iinfo(np.int32).max:
        raise ValueError(f"top_k must be an integer from 0 (off) to {np.iinfo(np.int32).max}, got {str(top_k)[:40]}")
    try:
        top_p = float(top_p)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"top_p must be a number in (0, 1], got {str(top_p)[:40]}") from None
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if min_p is None:
        return temperature, top_k, top_p
    try:
        min_p = float(min_p)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"min_p must be a number in [0, 1], got {str(min_p)[:40]}") from None
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    return temperature, top_k, top_p, min_p


def check_logit_bias(bias) -> dict[int, float]:
    """A logit bias as {token id: value}: at most `MAX_LOGIT_BIAS` entries, ids integers >= 0,
    values finite in [-`MAX_BIAS`, `MAX_BIAS`]; ``ValueError`` naming the bad entry."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> value, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: {len(bias)} entries, at most {MAX_LOGIT_BIAS}")
    out = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: {token!r} is not a token id") from None
        if token_id < 0 or token_id > np.iinfo(np.int32).max or str(token_id) != str(token):
            raise ValueError(f"logit_bias: {token!r} is not a token id")
        if token_id in out:
            raise ValueError(f"logit_bias: token id {token_id} is given twice")
        try:
            ok = not isinstance(value, bool) and isinstance(value, (int, float, np.floating, np.integer)) \
                and -MAX_BIAS <= float(value) <= MAX_BIAS
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(f"logit_bias[{token!r}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                             f"got {str(value)[:40]}")
        out[token_id] = float(value)
    return out


def check_penalties(repetition=1.0, presence=0.0, frequency=0.0) -> tuple[float, float, float]:
    """(repetition, presence, frequency) penalties as Python floats, or ``ValueError`` naming the
    bad one: repetition in [1 / `MAX_REPETITION`, `MAX_REPETITION`] (1 = off; 0 or a negative
    value is refused), presence and frequency in [-`MAX_PRESENCE`, `MAX_PRESENCE`] (0 = off)."""
    out = []
    for name, value, lo, hi in (("repetition_penalty", repetition, 1.0 / MAX_REPETITION, MAX_REPETITION),
                                ("presence_penalty", presence, -MAX_PRESENCE, MAX_PRESENCE),
                                ("frequency_penalty", frequency, -MAX_PRESENCE, MAX_PRESENCE)):
        try:
            ok = not isinstance(value, bool) and lo <= float(value) <= hi
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {str(value)[:40]}")
        out.append(float(value))
    return tuple(out)


def _penalized(x: jax.Array, cfg: SamplingConfig, ids: jax.Array | None) -> jax.Array:
    """``x`` (float32 [B, ..., V], or over a support's ids [U]) with each row's penalties at its
    position's history (module docstring, "Penalties"); unchanged without a history."""
    if cfg.counts is None:
        return x
    counts, seen = cfg.counts, cfg.seen
    if counts.ndim < x.ndim:        # one history for every position: [B, V] -> [B, 1, .., V]
        counts = counts.reshape(counts.shape[:1] + (1,) * (x.ndim - counts.ndim) + counts.shape[1:])
    seen = seen.reshape(seen.shape[:1] + (1,) * (x.ndim - 2) + seen.shape[-1:])
    if ids is not None:
        counts, seen = jnp.take(counts, ids, axis=-1), jnp.take(seen, ids, axis=-1)
    rep, pres, freq = (_per_row(v, x) for v in (cfg.repetition, cfg.presence, cfg.frequency))
    out_in = counts > 0
    x = jnp.where(seen | out_in, jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts.astype(jnp.float32) - jnp.where(out_in, pres, 0.0)


def _masked(x: jax.Array, cfg: SamplingConfig, ids: jax.Array | None) -> jax.Array:
    """``x`` (float32 [B, ..., V], or over a support's ids) with the tokens each row's automaton
    does not allow at its position's state set to -inf (module docstring, "Constraints");
    unchanged without a state."""
    if cfg.fsm_state is None:
        return x
    state = cfg.fsm_state
    if state.ndim < x.ndim - 1:        # one state for every position: [B] -> [B, 1, ..]
        state = state.reshape(state.shape + (1,) * (x.ndim - 1 - state.ndim))
    cls_BV = cfg.fsm_class if ids is None else jnp.take(cfg.fsm_class, ids, axis=1)
    cls = cls_BV.reshape(cls_BV.shape[:1] + (1,) * (x.ndim - 2) + cls_BV.shape[-1:])
    row = cfg.fsm_offset.reshape((state.shape[0],) + (1,) * (state.ndim - 1)) + jnp.maximum(state, 0)
    allowed = (state[..., None] == -1) | (cfg.fsm_next[row[..., None], cls] >= 0)
    # After a token the automaton refuses nothing is a distribution: NaN, which the engine's guard
    # sees (a drafted token's later positions are never committed; a committed prefix never gets here)
    return jnp.where(state[..., None] == DEAD_STATE, jnp.nan, jnp.where(allowed, x, -jnp.inf))


def _adjusted(x: jax.Array, cfg: SamplingConfig, ids: jax.Array | None) -> jax.Array:
    """float32 logits with the logit bias, then the penalties, then the automaton's mask."""
    return _masked(_penalized(_biased(x.astype(jnp.float32), cfg, ids), cfg, ids), cfg, ids)


def adjusted_logits(logits_V: jax.Array, cfg: SamplingConfig, ids=None) -> jax.Array:
    """The logits (float32) with each row's logit bias, penalties and automaton mask, before the
    temperature and the filters (what a greedy row's argmax reads; a tree's ranking under greedy
    decoding)."""
    return _adjusted(logits_V, cfg, ids)


def _biased(x: jax.Array, cfg: SamplingConfig, ids: jax.Array | None) -> jax.Array:
    """``x`` (float32 [B, ..., V]; over a support: [B, ..., U] with its token ids ``ids`` [U])
    plus each row's logit bias (none in a config without one)."""
    if cfg.bias_ids is None:
        return x
    _per_row(cfg.bias_values[:, 0], x)            # the batch first (raises otherwise)
    B, V = cfg.bias_ids.shape[0], x.shape[-1] if ids is None else None
    if ids is None:
        dense = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], cfg.bias_ids].add(cfg.bias_values,
                                                                                          mode="drop")
    else:       # the bias of the support's tokens: a bias id outside the support changes nothing here
        hit_BMU = cfg.bias_ids[:, :, None] == jnp.asarray(ids)[None, None, :]
        dense = jnp.sum(jnp.where(hit_BMU, cfg.bias_values[:, :, None], 0.0), axis=1)
    return x + dense.reshape((B,) + (1,) * (x.ndim - 2) + dense.shape[-1:])


def _per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """A setting against ``like`` [..., V]: a scalar as it is, a per-row [B] as [B, 1, ..., 1]
    (``like`` must have the batch first: not under a `jax.vmap` over rows with the config
    closed over)."""
    if jnp.ndim(x) == 0:
        return x
    if like.ndim < 2 or like.shape[0] != x.shape[0]:
        raise ValueError(f"a per-row sampling config of {x.shape[0]} rows against logits of shape {like.shape}: "
                         f"the batch must be the logits' leading axis")
    return x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


def _order_keys(x: jax.Array) -> jax.Array:
    """int32 keys that order float32 values as the floats do (for non-NaN values; -0.0 sorts
    just below +0.0): non-negative floats keep their bits, negative ones flip their magnitude bits."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i >= 0, i, i ^ jnp.int32(0x7FFFFFFF))


def _midpoint(a: jax.Array, b: jax.Array) -> jax.Array:
    """floor((a + b) / 2) of int32 arrays without overflow."""
    return (a & b) + ((a ^ b) >> 1)


_SEARCH_STEPS = 32          # halvings of the int32 key range: the search ends on an exact key


def _filtered_logits(logits_V: jax.Array, cfg: SamplingConfig, ids=None) -> jax.Array:
    """Temperature-scaled logits with top-k / top-p exclusions set to -inf (non-greedy only).

    ``temperature`` must be a normal positive float32 here (guaranteed by
    :meth:`SamplingConfig.make` when ``greedy`` is False). The max logit is subtracted before
    dividing, so the scaled values are ``<= 0`` with the max at exactly 0: no temperature
    overflows them to +inf (a very negative one may become -inf, an exact zero probability).
    NaN or +inf logits give NaN rows, which the engine's guard catches (`specjax.decoding`).

    The thresholds are found without sorting the vocabulary (the program holds no sort; timed
    against XLA's CPU sort in experiments/bench_speed/PROFILE.md, "Top-k / top-p without a
    sort"): a binary search over the values' order keys (`_order_keys`), 32 halvings, each one
    masked count or sum over the row.

    * top-k: the k-th largest value ``v_k = max {v : #{x : s(x) >= v} >= k}``; keep ``s >= v_k``.
    * top-p: with ``p`` the softmax over the tokens top-k kept, the smallest value
      ``v_p = min {v : sum_{x : s(x) > v} p(x) < top_p}``; keep ``s >= v_p``. This is the
      nucleus of the sorted definition (keep the most probable tokens while the mass before
      each is below ``top_p``; the top token always), ties at the threshold included; the mass
      is summed in vocabulary order rather than sorted order, so only a mass within float
      rounding of ``top_p`` can decide differently (identically on both sides).
    """
    x = _adjusted(logits_V, cfg, ids)
    # The shift is a constant for softmax/log_softmax (no gradient needed through it).
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    temperature = _per_row(cfg.temperature, x)
    if cfg.per_row:         # greedy rows (temperature 0) are scaled by 1; `probabilities` one-hots them
        temperature = jnp.where(temperature > 0, temperature, 1.0)
    scaled = (x - top) / temperature
    if not (cfg.use_top_k or cfg.use_top_p):
        return scaled
    vocab = scaled.shape[-1]
    key = jax.lax.stop_gradient(_order_keys(scaled))
    row = scaled.shape[:-1] + (1,)
    lowest = jnp.min(key, axis=-1, keepdims=True)
    keep = jnp.ones(scaled.shape, bool)
    top_k, top_p = _per_row(cfg.top_k, x), _per_row(cfg.top_p, x)
    # Per row, a filter's search runs only in calls where some row uses it.
    searched = (lambda used, search, skip: jax.lax.cond(used, search, skip)) if cfg.per_row else \
        (lambda used, search, skip: search())
    if cfg.use_top_k:
        # top_k <= 0 at run time means "off": keep everything.
        k = jnp.where(top_k <= 0, vocab, jnp.clip(top_k, 1, vocab))

        def kth(_, bounds):          # invariant: count(key >= lo) >= k > count(key >= hi)
            lo, hi = bounds
            mid = _midpoint(lo, hi)
            ok = jnp.sum(key >= mid, axis=-1, keepdims=True) >= k
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        v_k = searched(jnp.any(top_k > 0),
                       lambda: jax.lax.fori_loop(0, _SEARCH_STEPS, kth, (lowest, jnp.ones(row, jnp.int32)))[0],
                       lambda: lowest)
        keep = key >= v_k
    if cfg.use_top_p:
        p = jax.lax.stop_gradient(jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1))

        def nucleus(_, bounds):      # invariant: mass(key > lo) >= top_p > mass(key > hi)
            lo, hi = bounds
            mid = _midpoint(lo, hi)
            ok = jnp.sum(jnp.where(key > mid, p, 0.0), axis=-1, keepdims=True) < top_p
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
        v_p = searched(jnp.any(top_p < 1.0),
                       lambda: jax.lax.fori_loop(0, _SEARCH_STEPS, nucleus,
                                                 (lowest - 1, jnp.zeros(row, jnp.int32)))[1],
                       lambda: lowest)
        # top_p >= 1 at run time means "off" (guards float32 rounding of the total mass).
        keep &= key >= jnp.where(top_p >= 1.0, lowest, v_p)
    if cfg.min_p is not None:
        # p(x) >= min_p * max p  <=>  scaled(x) >= log(min_p) (the largest scaled value is 0)
        min_p = _per_row(cfg.min_p, x)
        keep &= (min_p <= 0) | (scaled >= jnp.log(jnp.where(min_p > 0, min_p, 1.0)))
    out = jnp.where(keep, scaled, -jnp.inf)
    return jnp.where(jnp.isnan(scaled).any(axis=-1, keepdims=True), jnp.nan, out)


def probabilities(logits_V: jax.Array, cfg: SamplingConfig, ids=None) -> jax.Array:
    """Sampling distribution (float32, same shape) of ``logits_...V`` under ``cfg``.

    Greedy: one-hot of the argmax (ties resolved to the lowest index, as ``jnp.argmax``).
    Otherwise: ``softmax(filter(mask(penalize(logits + bias)) / temperature))`` with the
    penalties, the automaton's mask and the top-k, top-p and min-p filters as described in the
    module docstring (a per-row greedy row: one-hot of the argmax of
    ``mask(penalize(logits + bias))``). Penalties and masks read the config's history
    (`SamplingConfig.with_history`, set by the engine each round); without one they are off. Any leading batch shape (a per-row
    config: the batch first). ``ids``: the logits are over a support of these token ids (a
    reduced-vocabulary draft), which places a per-row logit bias.
    """
    if cfg.greedy:
        vocab = logits_V.shape[-1]
        if not cfg.has_history:
            return jax.nn.one_hot(argmax(logits_V), vocab, dtype=jnp.float32)
        return _one_hot_argmax(_adjusted(logits_V, cfg, ids))
    probs = jax.nn.softmax(_filtered_logits(logits_V, cfg, ids), axis=-1)
    if cfg.per_row:
        greedy = _one_hot_argmax(_adjusted(logits_V, cfg, ids))
        probs = jnp.where(_per_row(cfg.temperature, probs) == 0, greedy, probs)
    return probs


def _one_hot_argmax(x: jax.Array) -> jax.Array:
    """The greedy distribution of ``x`` [..., V]: one-hot of its `argmax`; NaN where the row
    holds a NaN (so a broken row is seen by the engine's guard, not decoded as token 0)."""
    one = jax.nn.one_hot(argmax(x), x.shape[-1], dtype=jnp.float32)
    return jnp.where(jnp.isnan(x).any(axis=-1, keepdims=True), jnp.nan, one)


def log_probabilities(logits_V: jax.Array, cfg: SamplingConfig, ids=None) -> jax.Array:
    """``log(probabilities(logits, cfg, ids))`` computed stably (-inf on excluded tokens)."""
    if cfg.greedy:
        return jnp.log(probabilities(logits_V, cfg))
    logp = jax.nn.log_softmax(_filtered_logits(logits_V, cfg, ids), axis=-1)
    if cfg.per_row:
        greedy = jnp.log(_one_hot_argmax(_adjusted(logits_V, cfg, ids)))
        logp = jnp.where(_per_row(cfg.temperature, logp) == 0, greedy, logp)
    return logp


def sample(key: jax.Array, probs_V: jax.Array) -> jax.Array:
    """Draw one token per leading index from ``probs_...V``; returns int32 ``[...]``.

    Implemented as Gumbel-argmax on ``log(probs)``: a zero-probability token has log-prob
    -inf and the Gumbel noise is finite, so it can never be emitted (unlike inverse-CDF
    sampling, where float32 rounding of the cumulative sum can land on an empty bin).
    One key serves the whole batch (the noise is drawn with the batch shape).
    """
    logp = jnp.log(probs_V.astype(jnp.float32))
    return categorical(key, logp)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (int32), the same index bit for bit: the first maximum, or
    the first NaN when there is one (``jnp.argmax`` treats NaN as the largest value).

    Computed as a max-reduce, then min-reduces over the positions that attain it and over NaN.
    XLA:CPU lowers ``jnp.argmax`` to one variadic (value, index) reduce that it does not
    vectorize; plain reduces vectorize (timings: experiments/bench_speed/results/2026-12-03-sampler-amd-epyc/).
    The gain is in `categorical`, where the argmax reads a fused (noise + logits) operand.
    Non-float input goes to ``jnp.argmax`` unchanged."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    n = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    nan = jnp.isnan(x)
    # NaN is handled apart: XLA:CPU's vectorized max-reduce may drop NaN instead of returning it.
    m = jnp.max(jnp.where(nan, -jnp.inf, x), axis=-1, keepdims=True)
    first_nan = jnp.min(jnp.where(nan, iota, n), axis=-1)
    first_max = jnp.min(jnp.where(x == m, iota, n), axis=-1)
    return jnp.where(first_nan < n, first_nan, first_max)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits, axis=-1)`` (int32), the same token bit for bit:
    the same Gumbel noise (``jax.random.gumbel(key, logits.shape, logits.dtype)``) added to the
    logits, with `argmax` in place of ``jnp.argmax`` (reduces XLA:CPU vectorizes, see `argmax`;
    tests/test_sampling.py holds it to ``jax.random.categorical``)."""
    return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)
