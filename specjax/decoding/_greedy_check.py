"""Greedy exactness check of speculative decoding against target-only decoding.

In exact arithmetic greedy speculative decoding returns the target-only greedy tokens. In
float32 a one-token forward and a (gamma+1)-token forward round differently, so a position
whose top-2 target logits are nearly tied can flip. The rule used everywhere in specjax:

  A mismatch is allowed only where the target's top-2 logit gap (measured on the
  target-only reference prefix, one teacher-forced forward) is below `eps`. Such a near-tie
  is reported, the reference token is teacher-forced (appended to the prompt), and both runs
  continue from there. Any mismatch at a gap >= eps is a failure.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.decoding import _engine

NEAR_TIE_EPS = 1e-3   # absolute logit gap; one- vs multi-token forwards differ by ~1e-5 here


@dataclasses.dataclass
class RowReport:
    prompt_index: int
    tokens_compared: int = 0
    near_ties: list = dataclasses.field(default_factory=list)   # (position, gap)
    hard_mismatch: tuple | None = None                          # (position, gap, ref, spec)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    full_accept_rounds_lower_bound: int = 0

    @property
    def ok(self) -> bool:
        return self.hard_mismatch is None


def _top2_gaps(target, params, seq: list[int]) -> np.ndarray:
    """gap[i] = top1 - top2 of the target's logits predicting seq[i + 1] (teacher-forced)."""
    logits = target.apply(params, jnp.asarray([seq], jnp.int32), None)[0][0]
    top2 = jax.lax.top_k(logits, 2)[0]
    return np.asarray(top2[:, 0] - top2[:, 1])


def greedy_check(target, target_params, drafter, draft_params, prompts: list[list[int]], max_new_tokens: int,
                 gamma, *, batch_size: int = 1, eps: float = NEAR_TIE_EPS, pad_multiple: int = 128,
                 verifier: str = "token", max_restarts: int = 8) -> list[RowReport]:
    """Compare speculative and target-only greedy decoding on every prompt (see module doc)."""
    greedy = sampling_lib.SamplingConfig.make(temperature=0.0)
    config = _engine.GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma, verifier=verifier)
    reports = [RowReport(i) for i in range(len(prompts))]
    # Work items: (report index, prompt tokens, tokens still to generate).
    pending = [(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
    for _ in range(max_restarts + 1):
        if not pending:
            break
        next_pending = []
        for start in range(0, len(pending), batch_size):
            chunk = pending[start:start + batch_size]
            while len(chunk) < batch_size:           # keep the batch shape fixed
                chunk = chunk + [(-1, chunk[0][1], chunk[0][2])]
            prompt_BP, plens = _engine.pad_prompts([c[1] for c in chunk], target.vocab_size, pad_multiple)
            cap = _engine.capacity_for(np.asarray(plens), config, pad_multiple)
            cap = max(cap, prompt_BP.shape[1])
            keys = _engine.request_keys(jax.random.key(0), list(range(batch_size)))
            ref = _engine.autoregressive_generate(target, target_params, prompt_BP, plens, keys, greedy,
                                                  max_new_tokens, capacity=cap)
            spec = _engine.speculative_generate(target, target_params, drafter, draft_params, prompt_BP, plens,
                                                keys, greedy, config, capacity=cap)
            ref_toks, spec_toks = ref.generated(), spec.generated()
            m = jax.device_get(spec.metrics)
            for b, (idx, prompt, budget) in enumerate(chunk):
                if idx < 0:
                    continue
                rep = reports[idx]
                r, s = ref_toks[b][:budget], spec_toks[b][:budget]
                rep.rounds += int(m.rounds_B[b])
                rep.proposed += int(m.proposed_B[b])
                rep.accepted += int(m.accepted_B[b])
                if m.accepted_at_BG.shape[1]:
                    rep.full_accept_rounds_lower_bound += int(m.accepted_at_BG[b, -1])
                n = min(len(r), len(s))
                first = next((i for i in range(n) if r[i] != s[i]), None)
                if first is None:
                    rep.tokens_compared += n
                    continue
                gap = float(_top2_gaps(target, target_params, prompt + r[:first + 1])[len(prompt) + first - 1])
                rep.tokens_compared += first
                if gap < eps:
                    rep.near_ties.append((len(prompt) + first - len(prompts[idx]), gap))
                    rest = budget - first - 1
                    if rest > 0:
                        next_pending.append((idx, prompt + r[:first + 1], rest))
                else:
                    rep.hard_mismatch = (len(prompt) + first - len(prompts[idx]), gap, r[first], s[first])
        pending = next_pending
    return reports
