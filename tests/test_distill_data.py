"""Distillation data built from Spec-Bench's multi-turn questions (issue 14, item 4): the
second-turn prompts continue the target's own first answer in the chat template."""
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
