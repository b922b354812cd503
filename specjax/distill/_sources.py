"""Where distillation data comes from: Spec-Bench prompts (never the held-out split for
training), the target's generations, the draft's own (on-policy) generations, fixed JSONL."""

from __future__ import annotations

import pathlib
from typing import Callable

import jax
import numpy as np

from specjax import decoding, specbench
from specjax import sampling as sampling_lib
from specjax.distill import _data


def spec_bench_prompts(tokenizer, split: str, *, per_category: int = 0, chat: bool = True,
                       max_prompt_tokens: int = 0) -> tuple[list[list[int]], list[int]]:
    """Token lists of Spec-Bench first turns from `split` ('train' or 'held_out'), chat-templated.
    max_prompt_tokens > 0 leaves out longer prompts; then per_category > 0 keeps the first n
    (in question order) of each category. Returns (prompts, question_ids)."""
    for name, value in (("per_category", per_category), ("max_prompt_tokens", max_prompt_tokens)):
        if int(value) < 0:
            raise ValueError(f"{name} must be >= 0 (0 = no limit), got {value}")
    prompts, ids, seen = [], [], {}
    for q in specbench.load(split=split):
        if per_category and seen.get(q.category, 0) >= per_category:
            continue
        t = decoding.encode_prompt(tokenizer, q.prompt, chat=chat)
        if max_prompt_tokens and len(t) > max_prompt_tokens:
            continue
        seen[q.category] = seen.get(q.category, 0) + 1
        prompts.append(t)
        ids.append(q.question_id)
    return prompts, ids


def second_turn_prompts(tokenizer, split: str, first: "_data.SequenceSet", first_ids, eos) -> tuple[list, list]:
    """Chat prompts of the second turns of `split`'s multi-turn questions (MT-bench): [user turn
    1, assistant = the continuation in `first` of that question's first turn (end-of-turn tokens
    stripped), user turn 2], ready for the assistant. `first` holds one sequence per id of
    `first_ids`, in that order. Returns (prompts, question_ids)."""
    by_id = {q.question_id: q for q in specbench.load(split=split)}
    stop = set(int(e) for e in eos)
    prompts, ids = [], []
    for i, qid in enumerate(first_ids):
        q = by_id[qid]
        if len(q.turns) < 2:
            continue
        answer = [int(t) for t in first.tokens[i][first.prompt_lengths[i]:]]
        while answer and answer[-1] in stop:
            answer.pop()
        messages = [{"role": "user", "content": q.turns[0]},
                    {"role": "assistant", "content": tokenizer.decode(answer)},
                    {"role": "user", "content": q.turns[1]}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)))
        ids.append(qid)
    return prompts, ids


def generated_data(directory, generator, generator_params, target, target_params, prompts, *, key,
                   temperature: float, samples_per_prompt: int, max_new_tokens: int, batch_size: int,
                   eos_ids, widths, tokens_per_batch: int = 8192, source: str = "target",
                   features: tuple | None = None,
                   log: Callable[[str], None] | None = None) -> _data.TeacherData:
    """Continuations of `prompts` by `generator` (target or draft) with the teacher's states,
    cached under `directory` (reused when complete). ``features`` = (layers, file name, dtype):
    the target's features for a head come from the same teacher pass, stored in the directory
    (read back by the caller, see `_prepare.with_features`)."""
    def build():
        cfg = sampling_lib.SamplingConfig.make(temperature=temperature)
        seqs = _data.generate(generator, generator_params, prompts, key=key, sampling=cfg,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, eos_ids=tuple(eos_ids),
                              samples_per_prompt=samples_per_prompt, source=source, log=log)
        if features is not None:
            layers, name, dtype = features
            _, hidden = _data.feature_states(target, target_params, seqs, layers, path=pathlib.Path(directory) / name,
                                             tokens_per_batch=tokens_per_batch, widths=widths, dtype=dtype,
                                             with_teacher=True, log=log)
        else:
            hidden = _data.teacher_states(target, target_params, seqs, tokens_per_batch=tokens_per_batch,
                                          widths=widths, log=log)
        return _data.TeacherData(seqs, hidden, max(widths))
    return _data.cached(directory, build, log=log)


def fixed_data(directory, path, tokenizer, target, target_params, *, widths, tokens_per_batch: int = 8192,
               log=None) -> _data.TeacherData:
    def build():
        seqs = _data.from_jsonl(path, tokenizer)
        hidden = _data.teacher_states(target, target_params, seqs, tokens_per_batch=tokens_per_batch,
                                      widths=widths, log=log)
        return _data.TeacherData(seqs, hidden, max(widths))
    return _data.cached(directory, build, log=log)


def token_frequencies(datas, vocab_size: int) -> np.ndarray:
    """Counts of each token id over the continuations (loss targets) of the given data."""
    counts = np.zeros((vocab_size,), np.int64)
    for d in datas:
        for t, p in zip(d.seqs.tokens, d.seqs.prompt_lengths):
            np.add.at(counts, t[p:], 1)
    return counts


def data_dir(root, name: str, **spec) -> pathlib.Path:
    return pathlib.Path(root) / f"{name}-{_data.cache_key(**spec)}"


def key_for(seed: int, stream: str):
    """A named PRNG stream derived once from the run's seed."""
    import zlib
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(stream.encode()) & 0x7FFFFFFF)
