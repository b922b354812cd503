"""Structured output: a JSON schema or a regular expression as a token automaton on the device.

A constraint is compiled once, on the host, into a deterministic automaton over token ids
(`TokenAutomaton`): from each state, the tokens that keep the text a prefix of some match, and
the state each one leads to. A JSON schema becomes a regular expression with outlines-core's
`build_regex_from_schema` (the Outlines project's Rust core, as vLLM and SGLang use it); the
regular expression becomes a character automaton with interegular (the parser Outlines, vLLM and
lm-format-enforcer used before outlines-core), and the token table is built here by walking
every token's text through it (`compile_regex`). outlines-core's own token index is not used:
version 0.2.14 drops transitions of looping patterns (``(a[bc]|c)*`` over the tokens a, b, c
loses "a" from its start state), which `tests/test_constraints.py` would catch.

Why a table and not llguidance or XGrammar, which also take context-free grammars: their masks
come from a matcher object on the host, one call per token, so a draft rollout, every tree node
and every row of the verification block would each need a host round trip inside the jitted
round (slow on a CPU, very slow on a TPU). An automaton is a table: the mask of a position and
the next state are gathers, traced like every other logits transform, along a draft's steps
and every tree path, in one program. The price is that only regular languages fit (JSON schemas
without unbounded recursion, regular expressions); a context-free grammar is not taken.

Axes: ``s`` an automaton's states and ``c`` its token classes (lowercase: counts of this
module's own, apart from the package's letters), ``V`` the vocabulary, ``B`` batch rows.

The table is compressed by token classes: tokens whose columns are equal in every state (most
of a vocabulary, for a schema) share one class, so a state's row has one entry per class
(``next_sc``, -1 where the class is not allowed) and ``class_V`` maps each token to its class.
End of sequence is allowed exactly in the automaton's final states (the stop tokens given at
compile time); special tokens other than those are never allowed.

In a batch, each row has its own automaton or none (`stack`): the rows' tables are laid one
after another in one table of a fixed budget of states and classes (shapes do not depend on
the mix), each row's class map is its own, and a row's state is a state of its own automaton
(-1: no constraint), read at the row's offset in the table. States never depend on the layout,
which changes as requests come and go: the engine keeps them across rounds. `specjax.sampling.SamplingConfig.rows` takes them (``constraint``); the masking and
the state along drafted tokens are `specjax.sampling`'s ("Constraints").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np

__all__ = ["TokenAutomaton", "ConstraintError", "compile_regex", "compile_json_schema", "stack", "Stacked"]


STATE_CHUNK = 256       # states walked through the vocabulary at once (`compile_regex`)


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (a bad schema or regex, or one past the budget)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A compiled constraint: ``next_sc[s, c]`` the state after a token of class c from state s
    (-1: not allowed), ``class_V[v]`` token v's class, ``start`` the initial state, ``final_s``
    the states where the text is a complete match, ``stop_ids`` the tokens that end one,
    ``source`` what it was compiled from."""
    next_sc: np.ndarray
    class_V: np.ndarray
    start: int
    final_s: np.ndarray
    stop_ids: tuple
    source: str

    @property
    def num_states(self) -> int:
        return self.next_sc.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next_sc.shape[1]

    def allowed(self, state: int) -> np.ndarray:
        """bool [V]: the tokens allowed in ``state``."""
        return self.next_sc[state][self.class_V] >= 0

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` (-1 if it is not allowed)."""
        return int(self.next_sc[state, self.class_V[token]]) if state >= 0 else -1

    def matches(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` spell a complete match (up to the first stop token, if any)."""
        s = self.start
        for t in tokens:
            if int(t) in self.stop_ids:
                break
            s = self.step(s, t)
            if s < 0:
                return False
        return bool(self.final_s[s])


def _require(module: str):
    """Import one of the structured-output libraries, or say how to install them."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"structured output needs {module}: pip install 'specjax[structured]'") from None


def _token_symbols(fsm, token_bytes: Sequence[bytes | None], skip: set[int]):
    """Each token's text as the automaton's symbols: (symbols [V, L] padded with -1, lengths
    [V]); length 0 for a token that is not text on its own (a special token, a stop token, or
    bytes that are not whole UTF-8 characters), which no state allows."""
    interegular = _require("interegular")
    alphabet = fsm.alphabet
    other = alphabet[interegular.fsm.anything_else]
    texts = []
    for i, b in enumerate(token_bytes):
        text = None
        if b and i not in skip:
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError:
                text = None
        texts.append(text or "")
    L = max(1, max(len(t) for t in texts))
    symbols_VL = np.full((len(texts), L), -1, np.int32)
    for i, t in enumerate(texts):
        if t:
            symbols_VL[i, :len(t)] = [alphabet[c] if c in alphabet else other for c in t]
    return symbols_VL, np.asarray([len(t) for t in texts], np.int32)


def _coreachable(next_sV: np.ndarray, final_s: np.ndarray) -> np.ndarray:
    """bool [s]: the states from which some path of allowed tokens reaches a final state."""
    good = final_s.copy()
    while True:
        more = good | ((next_sV >= 0) & good[np.maximum(next_sV, 0)]).any(axis=1)
        if (more == good).all():
            return good
        good = more


def compile_regex(pattern: str, token_bytes: Sequence[bytes | None], stop_ids: Sequence[int],
                  max_states: int = 1024) -> TokenAutomaton:
    """The automaton of the texts that fully match ``pattern`` (Python regex syntax, as
    interegular parses it), over a vocabulary whose token i spells ``token_bytes[i]`` (None: a
    special token, never allowed), ending with any of ``stop_ids`` in a final state (ids past
    the vocabulary are ignored: a vocabulary without an end token has texts that never end).

    A token is allowed in a state when its whole text walks the character automaton to a state
    from which a final state can still be reached by whole tokens, so the text never runs into
    a dead end. A token whose bytes are not whole UTF-8 characters is never allowed (such text
    needs a neighbour's bytes to be read). `ConstraintError` for a pattern that does not parse,
    one with no match, or more than ``max_states`` states (counted on the character automaton
    first: it bounds the compile's memory, states x vocabulary x 2 bytes)."""
    interegular = _require("interegular")
    if not stop_ids:
        raise ConstraintError("a constraint needs at least one stop token (end of sequence)")
    V = len(token_bytes)
    stops = sorted({int(i) for i in stop_ids if 0 <= int(i) < V})
    try:
        fsm = interegular.parse_pattern(pattern).to_fsm().reduce()
    except Exception as e:          # interegular raises its own parse errors
        raise ConstraintError(f"cannot compile the pattern: {type(e).__name__}: {str(e)[:300]}") from None
    states = sorted(fsm.states, key=repr)
    number = {s: i for i, s in enumerate(states)}
    n = len(states)
    if n > max_states:      # before the token walk, whose tables are states x vocabulary
        raise ConstraintError(f"the pattern's character automaton has {n} states, more than max_states={max_states}")
    K = 1 + max([sym for row in fsm.map.values() for sym in row] + [int(v) for v in fsm.alphabet.values()])
    char_nk = np.full((n + 1, K), n, np.int32)          # row n: the dead state
    for s, row in fsm.map.items():
        for sym, t in row.items():
            char_nk[number[s], sym] = number[t]
    final_n = np.zeros(n + 1, bool)
    final_n[[number[s] for s in fsm.finals]] = True
    symbols_VL, len_V = _token_symbols(fsm, token_bytes, set(stops))
    # every state walks every token's text, the tokens sorted longest first, STATE_CHUNK states at
    # a time (int16 tables: at most 32,767 states; memory: states x vocabulary x 2 bytes)
    if n >= np.iinfo(np.int16).max:
        raise ConstraintError(f"the pattern's character automaton has {n} states, more than 32,766")
    order = np.argsort(-len_V, kind="stable")
    next_nV = np.empty((n, V), np.int16)
    for lo in range(0, n, STATE_CHUNK):
        cur_cV = np.broadcast_to(np.arange(lo, min(n, lo + STATE_CHUNK), dtype=np.int16)[:, None],
                                 (min(n, lo + STATE_CHUNK) - lo, V)).copy()
        for j in range(symbols_VL.shape[1]):
            active = int((len_V > j).sum())
            if active == 0:
                break
            idx = order[:active]
            cur_cV[:, idx] = char_nk[cur_cV[:, idx], symbols_VL[idx, j][None, :]]
        next_nV[lo:lo + STATE_CHUNK] = np.where((len_V > 0)[None, :] & (cur_cV < n), cur_cV, -1)
    next_nV[:, stops] = np.where(final_n[:n, None], np.arange(n, dtype=np.int32)[:, None], -1)
    good = _coreachable(next_nV, final_n[:n])
    start = number[fsm.initial]
    if not good[start]:
        raise ConstraintError("the constraint has no text this vocabulary can spell")
    next_nV = np.where((next_nV >= 0) & good[np.maximum(next_nV, 0)], next_nV, -1)
    # keep the states tokens reach from the start, renumbered in the order they are found
    seen, frontier = {start: 0}, [start]
    while frontier:
        nxt = np.unique(next_nV[frontier])
        frontier = [int(x) for x in nxt if x >= 0 and int(x) not in seen]
        for x in frontier:
            seen[x] = len(seen)
        if len(seen) > max_states:
            raise ConstraintError(f"the constraint has more than max_states={max_states} states")
    keep = np.asarray(sorted(seen, key=seen.get))
    renumber = np.full(n + 1, -1, np.int32)
    renumber[keep] = np.arange(len(keep), dtype=np.int32)
    dense_sV = np.where(next_nV[keep] >= 0, renumber[np.maximum(next_nV[keep], 0)], -1).astype(np.int16)
    # token classes: equal columns, found by sorting each column's bytes as one opaque value
    cols_Vs = np.ascontiguousarray(dense_sV.T)
    keys_V = cols_Vs.view(np.dtype((np.void, cols_Vs.shape[1] * cols_Vs.itemsize))).ravel()
    _, first_c, class_V = np.unique(keys_V, return_index=True, return_inverse=True)
    return TokenAutomaton(next_sc=np.ascontiguousarray(dense_sV[:, first_c], np.int32),
                          class_V=class_V.astype(np.int32).ravel(), start=0, final_s=final_n[keep],
                          stop_ids=tuple(stops), source=pattern)


def compile_json_schema(schema: Any, token_bytes: Sequence[bytes | None], stop_ids: Sequence[int],
                        max_states: int = 1024, whitespace: str | None = r"[ ]?") -> TokenAutomaton:
    """`compile_regex` of the JSON texts ``schema`` (a dict or a JSON string) accepts, as
    outlines-core writes them (``whitespace``: the pattern between tokens). `ConstraintError`
    naming what is wrong for a schema it does not take (a recursive one, an unsupported key)."""
    build_regex_from_schema = _require("outlines_core.json_schema").build_regex_from_schema
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        json.loads(text)
        pattern = build_regex_from_schema(text, whitespace)
    except Exception as e:
        raise ConstraintError(f"the schema is not one this server takes: {str(e)[:300]}") from None
    return compile_regex(pattern, token_bytes, stop_ids, max_states)


@dataclasses.dataclass(frozen=True, eq=False)
class Stacked:
    """Row automata in one fixed-shape table (`stack`): ``next_sc`` [max_states, max_classes]
    (each automaton's own state numbers, at its offset), ``class_BV`` [B, V], ``offset_B`` [B]
    (where the row's automaton starts in the table) and ``start_B`` [B] (its start state; -1: the
    row is unconstrained)."""
    next_sc: np.ndarray
    class_BV: np.ndarray
    offset_B: np.ndarray
    start_B: np.ndarray


def stack(automata: Sequence[TokenAutomaton | None], vocab: int, max_states: int, max_classes: int) -> Stacked:
    """One table for a batch: row b's automaton (None: no constraint) placed after the rows'
    before it. ``ConstraintError`` if the rows' states together pass ``max_states`` or
    one automaton has more than ``max_classes`` classes. Rows that share an automaton object
    share its states."""
    next_sc = np.full((max_states, max_classes), -1, np.int32)
    class_BV = np.zeros((len(automata), vocab), np.int32)
    offset_B = np.zeros(len(automata), np.int32)
    start_B = np.full(len(automata), -1, np.int32)
    offset, placed = 0, {}
    for b, auto in enumerate(automata):
        if auto is None:
            continue
        if auto.class_V.shape[0] != vocab:
            raise ConstraintError(f"row {b}: an automaton over {auto.class_V.shape[0]} tokens for a vocabulary of {vocab}")
        if auto.num_classes > max_classes:
            raise ConstraintError(f"row {b}: the constraint has {auto.num_classes} token classes, more than "
                                  f"max_classes={max_classes}")
        if id(auto) not in placed:
            if offset + auto.num_states > max_states:
                raise ConstraintError(f"row {b}: the batch's constraints have more than max_states={max_states} "
                                      f"states together")
            next_sc[offset:offset + auto.num_states, :auto.num_classes] = auto.next_sc
            placed[id(auto)] = offset
            offset += auto.num_states
        class_BV[b] = auto.class_V
        offset_B[b] = placed[id(auto)]
        start_B[b] = auto.start
    return Stacked(next_sc=next_sc, class_BV=class_BV, offset_B=offset_B, start_B=start_B)
