"""Greedy exactness on the real default target (SmolLM2-135M-Instruct), as CI runs it.

13 held-out Spec-Bench prompts (one per category), 32 new tokens, batch 1 and batch 4, each
drafter. Float near-ties are handled by the rule in `specjax.decoding._greedy_check`
(allowed only where the target-only top-2 logit gap < NEAR_TIE_EPS; reported, then the
reference token is teacher-forced). The test also asserts that rejections and fully
accepted rounds both occurred, so it exercises every rollback path.
"""

import pytest

from specjax import build, decoding, specbench
from specjax.decoding._greedy_check import NEAR_TIE_EPS, greedy_check
from specjax.models.tokenizer import load_tokenizer

MAX_NEW = 32


@pytest.fixture(scope="module")
def real():
    target, params = build.load_target("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q.prompt}], add_generation_prompt=True)
               for q in specbench.one_per_category()]
    return target, params, prompts


DRAFTERS = [
    ("ngram", 4, 1),
    ("early_exit", 3, 4),
    ("ngram", decoding.AdaptiveGamma(gammas=(0, 2, 4)), 4),
]


@pytest.mark.parametrize("kind,gamma,batch", DRAFTERS, ids=lambda x: str(x)[:20])
def test_greedy_matches_target_only(real, kind, gamma, batch):
    target, params, prompts = real
    drafter, dparams = build.make_drafter(kind, target, params, early_exit_layers=4)
    reports = greedy_check(target, params, drafter, dparams, prompts, MAX_NEW, gamma, batch_size=batch)
    for r in reports:
        for pos, gap in r.near_ties:
            print(f"prompt {r.prompt_index}: near-tie at new token {pos}, gap {gap:.2e} < {NEAR_TIE_EPS}")
    bad = [(r.prompt_index, r.hard_mismatch) for r in reports if not r.ok]
    assert not bad, f"greedy mismatches above eps={NEAR_TIE_EPS} (prompt, (pos, gap, ref, spec)): {bad}"
    assert all(r.tokens_compared + len(r.near_ties) >= MAX_NEW for r in reports)
    proposed = sum(r.proposed for r in reports)
    accepted = sum(r.accepted for r in reports)
    full = sum(r.full_accept_rounds_lower_bound for r in reports)
    print(f"{kind} gamma={gamma} batch={batch}: proposed {proposed}, accepted {accepted}, "
          f"fully accepted rounds {full}")
    assert accepted < proposed, "no rejection happened: the rollback path was not exercised"
    assert full > 0, "no fully accepted round: the bonus/catch-up path was not exercised"
