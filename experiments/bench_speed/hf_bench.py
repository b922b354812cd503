"""transformers measurements on the same model and the same prompt token ids.

`model.generate` under `torch.inference_mode()` with `torch.set_num_threads(threads)`, batch 1,
float32, plain decoding and assisted generation with prompt lookup
(`prompt_lookup_num_tokens`, `max_matching_ngram_size`). Greedy: `do_sample=False`;
temperature T > 0: `do_sample=True, temperature=T, top_k=0, top_p=1.0` (pure sampling, as
specjax), with `torch.manual_seed` fixed per prompt so every repeat samples the same tokens.
Stop tokens are the workload's (or none); tokens/s counts the tokens actually generated.

Warm-up: each configuration runs once untimed (on the first prompt) before any timing.
Prefill: one `model(prompt, use_cache=True, logits_to_keep=1)` forward timed separately
(what generate's first step does); decode time = median generate time - median prefill time.
"""

from __future__ import annotations

import time

from experiments.bench_speed.common import median
from experiments.bench_speed.workload import Workload


def _generate_kwargs(method: str, temperature: float, max_new_tokens: int, eos_ids, ignore_eos: bool,
                     lookup_tokens: int, max_ngram: int) -> dict:
    kw = dict(max_new_tokens=max_new_tokens, num_beams=1)
    if temperature == 0:
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    if eos_ids:
        kw.update(eos_token_id=list(eos_ids), pad_token_id=int(eos_ids[0]))
        if ignore_eos:
            kw.update(min_new_tokens=max_new_tokens)
    if method == "prompt_lookup":
        kw.update(prompt_lookup_num_tokens=int(lookup_tokens), max_matching_ngram_size=int(max_ngram))
    return kw


def run_transformers(workload: Workload, *, temperatures, max_new_tokens: int, repeats: int, threads: int,
                     lookup_tokens: int, max_ngram: int, seed: int, ignore_eos: bool = False,
                     on_record=None) -> list[dict]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    model = workload.hf_factory()
    load_s = time.perf_counter() - t0
    eos_ids = () if ignore_eos and not workload.eos_ids else workload.eos_ids
    results = []
    prompts = [(p, torch.tensor([list(p.ids)], dtype=torch.long)) for p in workload.prompts]

    with torch.inference_mode():
        def prefill(ids):
            t = time.perf_counter()
            model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t

        def generate(ids, kw, qid):
            torch.manual_seed(seed * 1_000_003 + qid)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            return time.perf_counter() - t, out[0, ids.shape[1]:].tolist()

        for temperature in temperatures:
            for method in ("target_only", "prompt_lookup"):
                kw = _generate_kwargs(method, temperature, max_new_tokens, eos_ids, ignore_eos, lookup_tokens,
                                      max_ngram)
                p0, ids0 = prompts[0]
                warm_s, _ = generate(ids0, kw, p0.question_id)
                prefill(ids0)
                for p, ids in prompts:
                    pre_s, full_s, gen = [], [], None
                    for _ in range(repeats):
                        pre_s.append(prefill(ids))
                        t, gen = generate(ids, kw, p.question_id)
                        full_s.append(t)
                    total, pre = median(full_s), median(pre_s)
                    decode = total - pre if total > pre else float("nan")   # <= 0: timing noise
                    n = len(gen)
                    rec = {
                        "framework": "transformers", "method": method, "temperature": float(temperature),
                        "question_id": p.question_id, "category": p.category, "prompt_tokens": len(p.ids),
                        "new_tokens": n, "total_s": total, "prefill_s": pre, "decode_s": decode,
                        "total_s_all": full_s, "prefill_s_all": pre_s,
                        "tokens_per_s": n / decode if decode > 0 else float("nan"),
                        "e2e_tokens_per_s": n / total if total > 0 else float("nan"),
                        "warmup_s": warm_s, "model_load_s": load_s, "torch_threads": torch.get_num_threads(),
                        "generate_kwargs": {k: v for k, v in kw.items()},
                        "generated_ids": gen,
                    }
                    results.append(rec)
                    if on_record is not None:
                        on_record(rec)
    return results
