"""Greedy exactness on the real default target (SmolLM2-135M-Instruct), as CI runs it.

The shortest held-out Spec-Bench question of 4 categories (prompts of different lengths that pad
to one width, so every case compiles one program), 32 new tokens: linear prompt lookup and the
distilled draft's dynamic tree at batch 4, the n-gram static tree at batch 1 on 2 of them (see
CASES). Long prompts (up to 664 tokens, all 13
categories) are checked on the real target at full size by experiments/greedy_exactness
(48 prompts x 128 tokens, batch 1 and 4); in the suite, the engine with a long prompt by
tests/test_long_prompt.py (tiny Llama) and SmolLM2's logits on the 664-token RAG prompt against
transformers by tests/test_gguf_parity.py. Batch 1 with linear drafts on the real target is the
main command's path (tests/test_cli.py, and tests/test_kernels.py on 4 prompts). Float near-ties
are handled by the rule of `specjax.decoding.greedy_check` (allowed only where the target-only
top-2 logit gap < NEAR_TIE_EPS; reported, then the reference token is teacher-forced). The test
also asserts that rejections and fully accepted rounds both occurred, so it exercises every
rollback path.
"""

import pytest

from specjax import build, decoding, specbench, trees
from specjax.decoding import NEAR_TIE_EPS, greedy_check, reference_greedy
from specjax.models import load_tokenizer

MAX_NEW = 32


@pytest.fixture(scope="module")
def real():
    target, params = build.load_target("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    shortest = {}
    for q in specbench.load(split="held_out"):
        if q.category not in SHORT:
            continue
        ids = decoding.encode_prompt(tok, q.prompt)
        if q.category not in shortest or len(ids) < len(shortest[q.category]):
            shortest[q.category] = ids
    prompts = [shortest[c] for c in SHORT]
    refs = reference_greedy(target, params, prompts, MAX_NEW, batch_size=4)
    return target, params, prompts, refs


# Prompt lookup with a long block (no draft state: it exercises the target's rollback alone);
# token trees: the n-gram drafter's k-branch tree and an EAGLE-2 dynamic tree for the shipped
# distilled draft (its own cache: rollback, catch-up and path compaction on the real target).
# The early-exit drafter (shared cache) is checked greedy-exact on a real-architecture tiny Llama
# (tests/test_drafters.py, tests/test_engine_tree.py), sampled-exact on SmolLM2
# (tests/test_sampled_exactness.py), and at full size by experiments/greedy_exactness.
# Categories whose shortest prompts all pad to one width (128 tokens): one batch of 4 rows, one
# compiled program per case.
SHORT = ("translation", "math", "math_reasoning", "writing")
# (drafter, gamma or tree, batch, categories): the linear draft and the dynamic tree at batch 4, the
# static tree at batch 1 (one call per prompt) on translation and math, whose continuations the
# n-gram tree fully accepts in some round (3 such rounds; writing and math_reasoning have none).
CASES = [("ngram", 4, 4, SHORT),
         ("ngram", trees.TreeShape.from_branching((3, 1, 1, 1)), 1, SHORT[:2]),
         ("distilled", trees.DynamicTree(depth=3, topk=3, node_budget=8), 4, SHORT)]


@pytest.mark.parametrize("kind,gamma,batch,categories", CASES,
                         ids=lambda x: x if isinstance(x, (str, int)) else f"{len(x)}cat" if isinstance(x, tuple)
                         else x.describe())
def test_greedy_matches_target_only(real, kind, gamma, batch, categories):
    target, params, prompts, refs = real
    keep = [SHORT.index(c) for c in categories]
    prompts, refs = [prompts[i] for i in keep], [refs[i] for i in keep]
    drafter, dparams = build.make_drafter(kind, target, params, early_exit_layers=4, target_name="smollm2-135m-instruct")
    reports = greedy_check(target, drafter, decoding.EngineParams(target=params, draft=dparams), prompts, MAX_NEW,
                           gamma, references=refs, batch_size=batch)
    for r in reports:
        for pos, gap in r.near_ties:
            print(f"prompt {r.prompt_index}: near-tie at new token {pos}, gap {gap:.2e} < {NEAR_TIE_EPS}")
    bad = [(r.prompt_index, r.hard_mismatch) for r in reports if not r.ok]
    assert not bad, f"greedy mismatches above eps={NEAR_TIE_EPS} (prompt, (pos, gap, ref, spec)): {bad}"
    assert all(r.tokens_compared + len(r.near_ties) >= MAX_NEW for r in reports)
    proposed = sum(r.proposed for r in reports)
    accepted = sum(r.accepted for r in reports)
    full = sum(r.full_accept_rounds for r in reports)
    print(f"{kind} gamma={gamma} batch={batch}: proposed {proposed}, accepted {accepted}, "
          f"fully accepted rounds {full}")
    assert accepted < proposed, "no rejection happened: the rollback path was not exercised"
    assert full > 0, "no fully accepted round: the bonus/catch-up path was not exercised"
