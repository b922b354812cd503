"""Greedy exactness check of speculative decoding against target-only decoding.

In exact arithmetic greedy speculative decoding returns the target-only greedy tokens. In
float32 a one-token forward and a (gamma+1)-token forward round differently, so a position
whose top-2 target logits are nearly tied can flip. The rule used everywhere in specjax:

  A mismatch is allowed only where the target's top-2 logit gap (measured on the
  target-only reference prefix, one teacher-forced forward) is below `eps`. Such a near-tie
  is reported, the reference token is teacher-forced (appended to the prompt), and both runs
  continue from there. Any mismatch at a gap >= eps is a failure.

References (target-only greedy continuations) are computed once per prompt and shared by
every drafter and batch size checked against them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.decoding._engine import Engine, EngineParams, GenerationConfig
from specjax.decoding._request import make_batch

NEAR_TIE_EPS = 1e-3   # absolute logit gap, well above the rounding between one- and multi-token forwards


@dataclasses.dataclass
class RowReport:
    prompt_index: int
    tokens_compared: int = 0
    near_ties: list = dataclasses.field(default_factory=list)   # (new-token position, gap)
    hard_mismatch: tuple | None = None                          # (position, gap, ref, spec)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    full_accept_rounds: int = 0

    @property
    def ok(self) -> bool:
        return self.hard_mismatch is None


def _batches(items, batch_size):
    """Fixed-size chunks (the last padded by repeating its first item, marked index -1)."""
    for start in range(0, len(items), batch_size):
        chunk = list(items[start:start + batch_size])
        while len(chunk) < batch_size:
            chunk.append((-1,) + tuple(chunk[0][1:]))
        yield chunk


def _run(target, drafter, params: EngineParams, config, prompts, pad_multiple):
    engine = Engine(target, drafter, config)
    batch = make_batch(prompts, config, jax.random.key(0), pad_multiple=pad_multiple)
    out = engine.run(params, sampling_lib.SamplingConfig.greedy_config(), batch)
    return out.generated(), jax.device_get(out.metrics)


def reference_greedy(target, target_params, prompts, max_new_tokens, *, batch_size=4, pad_multiple=128,
                     block_tokens: int = 0):
    """Target-only greedy continuations, grouped by length so batches share compiled shapes;
    ``block_tokens``: every target pass scores that many tokens (`GenerationConfig.block_tokens`;
    give the speculative run's `target_block` to compare with it bit for bit)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=0, block_tokens=block_tokens)
    params = EngineParams(target=target_params)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    refs = {}
    for chunk in _batches([(i, prompts[i]) for i in order], batch_size):
        toks, _ = _run(target, None, params, config, [c[1] for c in chunk], pad_multiple)
        for (i, _), t in zip(chunk, toks):
            if i >= 0:
                refs[i] = t
    return [refs[i] for i in range(len(prompts))]


def _top2_gap(target, params, seq: list[int], pos: int) -> float:
    """top1 - top2 of the target's logits at `pos` (predicting seq[pos + 1]), teacher-forced."""
    logits = target.apply(params, jnp.asarray([seq[:pos + 1]], jnp.int32), None)[0][0, pos]
    top2 = jax.lax.top_k(logits, 2)[0]
    return float(top2[0] - top2[1])


def greedy_check(target, drafter, params: EngineParams, prompts: list[list[int]], max_new_tokens: int,
                 gamma, *, references=None, batch_size: int = 1, eps: float = NEAR_TIE_EPS,
                 pad_multiple: int = 128, verifier: str = "token", max_restarts: int = 8,
                 block_tokens: int = 0) -> list[RowReport]:
    """Compare speculative greedy decoding with target-only greedy references (module doc).

    gamma: an int or an `AdaptiveGamma`. ``block_tokens`` (`GenerationConfig.block_tokens`):
    the references must then come from `reference_greedy` with the resolved size
    (``GenerationConfig(..., block_tokens=...).target_block``), as they do when computed here."""
    target_params = params.target
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma, verifier=verifier,
                              block_tokens=block_tokens)
    if references is None:
        references = reference_greedy(target, target_params, prompts, max_new_tokens, pad_multiple=pad_multiple,
                                      block_tokens=config.target_block or 0)
    reports = [RowReport(i) for i in range(len(prompts))]
    # Work items: (prompt index, prompt tokens, reference continuation, tokens still to compare).
    pending = [(i, list(prompts[i]), list(references[i]), max_new_tokens) for i in range(len(prompts))]
    for _ in range(max_restarts + 1):
        if not pending:
            break
        pending.sort(key=lambda w: len(w[1]))
        next_pending = []
        for chunk in _batches(pending, batch_size):
            spec_toks, m = _run(target, drafter, params, config, [c[1] for c in chunk], pad_multiple)
            for b, (idx, prompt, ref, budget) in enumerate(chunk):
                if idx < 0:
                    continue
                rep = reports[idx]
                rep.rounds += int(m.rounds_B[b])
                rep.proposed += int(m.proposed_B[b])
                rep.accepted += int(m.accepted_B[b])
                if m.accepted_at_BG.shape[1]:
                    rep.full_accept_rounds += int(m.accepted_at_BG[b, -1])
                r, s = ref[:budget], spec_toks[b][:budget]
                n = min(len(r), len(s))
                first = next((i for i in range(n) if r[i] != s[i]), None)
                if first is None and len(s) != len(r):
                    # one run stopped early (e.g. a spurious NaN stop): a mismatch, never a near-tie
                    rep.tokens_compared += n
                    rep.hard_mismatch = (len(prompt) - len(prompts[idx]) + n, float("inf"),
                                         r[n] if n < len(r) else None, s[n] if n < len(s) else None)
                    continue
                if first is None:
                    rep.tokens_compared += n
                    continue
                rep.tokens_compared += first
                done_before = len(prompt) - len(prompts[idx])
                gap = _top2_gap(target, target_params, prompt + r, len(prompt) + first - 1)
                if gap >= eps:
                    rep.hard_mismatch = (done_before + first, gap, r[first], s[first])
                    continue
                rep.near_ties.append((done_before + first, gap))
                forced = prompt + r[:first + 1]
                rest = budget - first - 1
                if rest > 0:   # a fresh target-only reference from the teacher-forced prefix
                    new_ref = reference_greedy(target, target_params, [forced], max_new_tokens,
                                               batch_size=1, pad_multiple=pad_multiple,
                                               block_tokens=config.target_block or 0)[0]
                    next_pending.append((idx, forced, new_ref, rest))
        pending = next_pending
    return reports
