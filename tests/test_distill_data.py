"""Distillation data: second-turn prompts from Spec-Bench's multi-turn questions continue the
target's own first answer in the chat template (issue 14, item 4); prompt subsets; the teacher
forward compiled once per target."""
import numpy as np

from specjax import distill, models, specbench


def test_second_turn_prompts_continue_the_first_answer_in_the_chat_template():
    tok = models.load_tokenizer("smollm2-135m-instruct")
    qs = specbench.load(split="train")
    multi = [q for q in qs if len(q.turns) > 1][:2]
    single = [q for q in qs if len(q.turns) == 1][:1]
    picked = [multi[0], single[0], multi[1]]
    eos = (tok.eos_token_id,) if getattr(tok, "eos_token_id", None) is not None else (2,)
    seqs, plens = [], []
    answers = ["The answer is forty-two.", "Unused.", "Short reply"]
    for q, a in zip(picked, answers):
        p = tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                    tokenize=True)
        seqs.append(list(p) + list(tok.encode(a)) + [eos[0]])      # the first answer ends at EOS
        plens.append(len(p))
    first = distill.SequenceSet(seqs, plens)
    prompts, ids = distill.second_turn_prompts(tok, "train", first, [q.question_id for q in picked], eos)
    assert ids == [multi[0].question_id, multi[1].question_id]       # one-turn questions are skipped
    for p, q, a in zip(prompts, multi, [answers[0], answers[2]]):
        want = tok.apply_chat_template([{"role": "user", "content": q.turns[0]},
                                        {"role": "assistant", "content": a},
                                        {"role": "user", "content": q.turns[1]}],
                                       add_generation_prompt=True, tokenize=True)
        assert p == list(want)
        text = tok.decode(p)
        i1, ia, i2 = text.index(q.turns[0]), text.index(a), text.index(q.turns[1])
        assert i1 < ia < i2
        # The prompt ends ready for the assistant's answer, like a first-turn prompt does.
        first_turn = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             tokenize=True)
        tail = list(first_turn)[-3:]
        assert p[-3:] == tail
    assert np.all([len(p) > 0 for p in prompts])


def test_prompt_subsets_take_the_first_short_prompts_of_each_category():
    """`spec_bench_prompts` with both limits: prompts longer than max_prompt_tokens are left out
    first, then the first n of each category (question order) are kept: the subset that
    data.per_category and eval.max_prompt_tokens select."""
    from specjax import decoding
    tok = models.load_tokenizer("smollm2-135m-instruct")
    prompts, ids = distill.spec_bench_prompts(tok, "train", per_category=2, max_prompt_tokens=192)
    qs = specbench.load(split="train")
    want, seen = [], {}
    for q in qs:
        if len(decoding.encode_prompt(tok, q.prompt, chat=True)) <= 192 and seen.get(q.category, 0) < 2:
            seen[q.category] = seen.get(q.category, 0) + 1
            want.append(q.question_id)
    assert ids == want
    assert all(len(p) <= 192 for p in prompts)
    # Categories whose first questions are long still contribute their first short ones, and
    # a category with none short (summarization, RAG) contributes nothing.
    cats = {q.question_id: q.category for q in qs}
    assert "summarization" not in {cats[i] for i in ids}
    assert len(ids) == sum(min(2, sum(1 for q in qs if q.category == c and
                                      len(decoding.encode_prompt(tok, q.prompt, chat=True)) <= 192))
                           for c in {q.category for q in qs})
    # A negative limit is refused by name (it would silently select no prompt).
    import pytest
    with pytest.raises(ValueError, match="per_category must be >= 0"):
        distill.spec_bench_prompts(tok, "train", per_category=-1)
    # Without limits: the whole split, in question order.
    all_prompts, all_ids = distill.spec_bench_prompts(tok, "train")
    assert all_ids == [q.question_id for q in qs]


def test_teacher_forward_compiles_once_per_target(caplog):
    """Teacher states of a new data set made during training (on-policy refreshes) reuse the
    compiled forward of the same target and shapes: after the first set, nothing compiles
    (a fresh jitted closure per call compiled the target again every time)."""
    import logging

    import jax
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                             ffn_size=64, max_position=128)
    target = models.Llama(cfg)
    params = target.init_params(jax.random.key(0))
    rng = np.random.default_rng(0)

    def new_set():
        return distill.SequenceSet([rng.integers(0, 64, 40) for _ in range(3)], [5, 6, 7])
    distill.teacher_states(target, params, new_set(), widths=(64,), tokens_per_batch=256)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        caplog.clear()
        for _ in range(2):
            seqs = new_set()
            out = distill.teacher_states(target, params, seqs, widths=(64,), tokens_per_batch=256)
        compiled = [m for m in (r.getMessage() for r in caplog.records)
                    if m.startswith("Compiling ") or "Finished XLA compilation" in m]
    assert compiled == []
    # and the states are the target's (positions P-1 .. n-2 of the first sequence)
    h = np.asarray(target.hidden_states(params, np.asarray(seqs.tokens[0])[None], None)[0][0])
    np.testing.assert_allclose(out[:35], h[4:39], rtol=1e-5, atol=1e-5)
