"""transformers measurements on the same model and the same prompt token ids.

`model.generate` under `torch.inference_mode()` with `torch.set_num_threads(threads)`, batch 1,
float32, plain decoding (`target_only`), assisted generation with prompt lookup
(`prompt_lookup`: `prompt_lookup_num_tokens`, `max_matching_ngram_size`) and, when a distilled
draft exists for the model, assisted generation with that draft exported to a Hugging Face
checkpoint (`assisted_distilled`: `assistant_model=`, see `export_distilled_assistant`; its
number of draft tokens per round pinned to specjax's gamma for the draft, constant schedule,
no confidence-based early stop). Greedy: `do_sample=False`;
temperature T > 0: `do_sample=True, temperature=T, top_k=0, top_p=1.0` (pure sampling, as
specjax), with `torch.manual_seed` fixed per prompt so every repeat samples the same tokens.
Stop tokens are the workload's (or none); tokens/s counts the tokens actually generated.

Warm-up: each configuration runs once untimed (on the first prompt) before any timing.
Prefill: one `model(prompt, use_cache=True, logits_to_keep=1)` forward timed separately
(what generate's first step does); decode time = median generate time - median prefill time.
Greedy records of the assisted methods carry their common prefix with transformers' own
greedy `generate` output of the same prompt (`common_prefix_with_transformers_greedy`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

from experiments.bench_speed.common import median
from experiments.bench_speed.workload import Workload


METHODS = ("target_only", "prompt_lookup", "assisted_distilled")


@dataclasses.dataclass(frozen=True)
class Assistant:
    """A draft model for transformers' assisted generation: a Hugging Face checkpoint directory
    and the number of draft tokens per round (`num_assistant_tokens`)."""
    path: pathlib.Path
    num_tokens: int
    source: str = ""                 # the specjax draft directory it was exported from

    def settings(self) -> dict:
        """What is pinned on the assistant's `generation_config` (transformers reads these there):
        `num_assistant_tokens` fixed per round ("constant" schedule) and confidence threshold 0,
        which turns off the dynamic early stop of a round (and its threshold tuning)."""
        return {"num_assistant_tokens": int(self.num_tokens), "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}

    def load(self):
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32).eval()
        for key, value in self.settings().items():
            setattr(model.generation_config, key, value)
        return model


def export_distilled_assistant(workload: Workload, draft_dir, work_dir, num_tokens: int) -> Assistant:
    """Writes the specjax draft in `draft_dir` (it borrows the target's embedding) as a standalone
    Hugging Face Llama checkpoint under `work_dir` (`draft_artifact.export_draft_hf`: a reduced
    head becomes a full-vocabulary one) and returns it as an `Assistant`."""
    from specjax.models.draft_artifact import export_draft_hf

    draft_dir = pathlib.Path(draft_dir)
    out = pathlib.Path(work_dir) / f"{draft_dir.name}_hf"
    export_draft_hf(draft_dir, workload.target, workload.params, out)
    return Assistant(out, num_tokens, str(draft_dir))


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
                     assistant: Assistant | None = None, on_record=None) -> list[dict]:
    """Every method (`assisted_distilled` only with an `assistant`) at every temperature, per prompt;
    returns the per-prompt records (also passed to `on_record` as they come)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    model = workload.hf_factory()
    load_s = time.perf_counter() - t0
    assistant_model = None
    if assistant is not None:
        t0 = time.perf_counter()
        assistant_model = assistant.load()
        assistant_info = {"path": str(assistant.path), "exported_from": assistant.source,
                          "load_s": time.perf_counter() - t0, **assistant.settings()}
    methods = [m for m in METHODS if m != "assisted_distilled" or assistant is not None]
    eos_ids = () if ignore_eos and not workload.eos_ids else workload.eos_ids
    results = []
    greedy_ref = {}                      # question id -> transformers' greedy `generate` tokens
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
            for method in methods:
                kw = _generate_kwargs(method, temperature, max_new_tokens, eos_ids, ignore_eos, lookup_tokens,
                                      max_ngram)
                if method == "assisted_distilled":
                    kw.update(assistant_model=assistant_model)
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
                        "generate_kwargs": {k: v for k, v in kw.items() if k != "assistant_model"},
                        "generated_ids": gen,
                    }
                    if method == "assisted_distilled":
                        rec["assistant"] = assistant_info
                    if temperature == 0 and method == "target_only":
                        greedy_ref[p.question_id] = gen
                    elif temperature == 0 and p.question_id in greedy_ref:
                        ref = greedy_ref[p.question_id]
                        rec["common_prefix_with_transformers_greedy"] = common_prefix(gen, ref)
                        rec["greedy_matches_transformers"] = gen == ref
                    results.append(rec)
                    if on_record is not None:
                        on_record(rec)
    return results


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
