"""The benchmark's measurements: memory bandwidth, timed generation (specjax), transformers.

Generation (`Runner.run`): one configuration on one batch. All configurations of a batch share
its `decoding.Batch` (same padded width and cache capacity, sized for the largest gamma of the
run), so target-only and speculative runs attend over the same slots. The first call per
compiled shape is an untimed warm-up whose trace + compile seconds `CompileLog` records; then
`repeats` timed pairs of a prefill (`engine.prefill`) and the decoding that continues from it
(`engine.run(..., prefill=)`), medians kept: decode is timed on its own (a few milliseconds on a
toy model, where a difference of medians would be lost in the timing noise of a loaded
machine), total = the median of prefill + decode; the timed runs must compile nothing.
Adaptive gamma's round times come from `Runner.calibrate`, i.e. `Engine.round_times` (what
`Generator.calibrate` and the CLI use), measured before any timed run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decoding, sampling

from experiments.lib import toolkit
from experiments.lib import workload


def bandwidth(gib: float, threads=(1, 2), repeats: int = 5) -> dict:
    """Streaming-read bandwidth, best of `repeats`. On CPU: numpy.sum over a float32 array of
    `gib` GiB (pages touched first) split over t threads (numpy releases the GIL), per t. On an
    accelerator: a jitted on-device read (jnp.sum) and copy (x * s, s traced so it stays)."""
    n = max(1024, int(gib * 2 ** 30) // 4)
    probes = {}
    if jax.default_backend() == "cpu":
        arr = np.ones(n, np.float32)
        method = f"numpy.sum over {gib:g} GiB of float32 split over t threads, best of {repeats}"
        for t in threads:
            chunks = np.array_split(arr, t)
            with concurrent.futures.ThreadPoolExecutor(max_workers=t) as pool:
                list(pool.map(np.sum, chunks))
                best = min(toolkit.timed(lambda: list(pool.map(np.sum, chunks)))[0] for _ in range(repeats))
            probes[f"read, {t} thread(s)"] = arr.nbytes / best / 1e9
    else:
        x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
        method = (f"jitted on-device read (jnp.sum) and copy (x * s, bytes read + written) of {gib:g} GiB, "
                  f"best of {repeats}")
        for name, fn, args, moved in (("device read", jnp.sum, (x,), 4 * n),
                                      ("device copy", lambda a, s: a * s, (x, jnp.float32(1)), 8 * n)):
            f = jax.jit(fn)
            toolkit.timed(f, *args)
            probes[name] = moved / min(toolkit.timed(f, *args)[0] for _ in range(repeats)) / 1e9
    return {"method": method, "probes": probes, "gb_per_s": max(probes.values())}


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding configuration: its name in the report, its drafter kind and gamma."""
    name: str
    drafter: str                      # none | ngram | early_exit | distilled | head | oracle
    gamma: int | decoding.AdaptiveGamma

    @property
    def gammas(self) -> tuple[int, ...]:
        return self.gamma.gammas if isinstance(self.gamma, decoding.AdaptiveGamma) else (int(self.gamma),)

    def describe(self) -> str:
        if isinstance(self.gamma, decoding.AdaptiveGamma):
            return f"{self.drafter}, adaptive gamma in {list(self.gamma.gammas)}"
        return "target only" if self.drafter == "none" else f"{self.drafter}, gamma {self.gamma}"


def methods(c, w: workload.Workload) -> list[Method]:
    """target_only and `c.methods` (checked by `config.check`), less distilled (head) ones where no
    draft (head) exists."""
    out = [Method("target_only", "none", 0)]
    for name in c.methods:
        kind = name.removeprefix("adaptive_")
        has = {"distilled": workload.has_distilled, "head": workload.has_head,
               "hybrid": workload.has_head if c.get("hybrid_model", "head") == "head" else workload.has_distilled}
        if not has.get(kind, lambda w, c: True)(w, c):
            continue
        gamma = decoding.AdaptiveGamma(gammas=tuple(c.adaptive_gammas)) if name.startswith("adaptive_") \
            else int(c.gamma[kind])
        out.append(Method(name, kind, gamma))
    return out


class Runner:
    """Runs configurations on batches; remembers which compiled shapes are warm."""

    def __init__(self, w: workload.Workload, c, log: toolkit.CompileLog, eos_ids=()):
        self.w, self.c, self.log, self.eos_ids = w, c, log, tuple(eos_ids)
        self.warmed: set = set()

    def block_tokens(self) -> int:
        """The benchmark's `block_tokens` resolved once for every method (target-only included):
        -1 = the largest block any of its methods drafts (one shape for every target pass)."""
        block = int(self.c.get("block_tokens", 0))
        if block != -1:
            return block
        gammas = [int(g) for g in self.c.adaptive_gammas] if any(
            m.startswith("adaptive_") for m in self.c.methods) else [0]
        gammas += [int(self.c.gamma[m]) for m in self.c.methods if m in self.c.gamma]
        return max(gammas) + 1

    def _engine(self, method: Method, draft_params=None):
        d, dp = (None, None) if method.drafter == "none" else workload.drafter(self.w, method.drafter, self.c)
        config = decoding.GenerationConfig(max_new_tokens=self.c.max_new_tokens, gamma=method.gamma,
                                           verifier=self.c.verifier, eos_ids=self.eos_ids,
                                           block_tokens=self.block_tokens())
        return (decoding.Engine(self.w.target, d, config),
                decoding.EngineParams(target=self.w.params, draft=dp if draft_params is None else draft_params))

    def calibrate(self, method: Method, temperature: float, batch: decoding.Batch, repeats: int):
        """Adaptive gamma's seconds of one round per gamma on `batch` (`Engine.round_times`), and
        the compile seconds of the probe; (None, None) for a fixed gamma."""
        if not isinstance(method.gamma, decoding.AdaptiveGamma):
            return None, None
        oracle = np.zeros(batch.prompt_BP.shape[:1] + (batch.capacity,), np.int32) if method.drafter == "oracle" \
            else None
        engine, params = self._engine(method, oracle)
        with self.log.section() as box:
            times = engine.round_times(params, sampling.SamplingConfig.make(temperature=temperature), batch, repeats)
        return times, box

    def run(self, method: Method, temperature: float, batch: decoding.Batch, round_time_s=None, draft_params=None):
        """(record, GenerateOutput of the last timed run)."""
        engine, params = self._engine(method, draft_params)
        samp = sampling.SamplingConfig.make(temperature=temperature)
        def prefill():                               # (a Prefill is no pytree: wait on its arrays)
            p = engine.prefill(params, batch)
            jax.block_until_ready((p.target_cache, p.draft_state, p.features_BSF))
            return p

        decode_from = lambda made: engine.run(params, samp, batch, round_time_s, prefill=made)  # noqa: E731
        key = (method, float(temperature), tuple(batch.prompt_BP.shape), batch.capacity)
        warm = {"compile_s": 0.0, "compiles": 0}
        if key not in self.warmed:
            with self.log.section() as warm:
                toolkit.timed(lambda: decode_from(prefill()))
            self.warmed.add(key)
        pre_s, dec_s = [], []
        with self.log.section() as timed_box:
            for _ in range(self.c.repeats):
                out = None                                   # free the previous output first
                t_pre, made = toolkit.timed(prefill)
                t_dec, out = toolkit.timed(lambda: decode_from(made))
                made = None
                pre_s.append(t_pre)
                dec_s.append(t_dec)
        out = jax.device_get(out)
        m = out.metrics
        full_s = [a + b for a, b in zip(pre_s, dec_s)]
        total, pre, decode = toolkit.median(full_s), toolkit.median(pre_s), toolkit.median(dec_s)
        gen = out.generated()
        n = sum(map(len, gen))
        return {
            "batch": len(gen), "padded_prompt_width": int(batch.prompt_BP.shape[1]), "capacity": batch.capacity,
            "new_tokens": n, "new_tokens_per_row": [len(g) for g in gen], "status": out.statuses(),
            "total_s": total, "prefill_s": pre, "decode_s": decode, "total_s_all": full_s, "prefill_s_all": pre_s,
            "decode_s_all": dec_s, "tokens_per_s": n / decode, "e2e_tokens_per_s": n / total,
            "compile_s": warm["compile_s"], "compiles": warm["compiles"],
            "compiles_during_timing": timed_box["compiles"],
            "loop_rounds": int(np.max(m.rounds_B)), "rounds": int(np.sum(m.rounds_B)),
            "proposed": int(np.sum(m.proposed_B)), "accepted": int(np.sum(m.accepted_B)),
            "committed": int(np.sum(m.committed_B)), "degenerate_residuals": int(np.sum(m.degenerate_residual_B)),
            "accepted_at": np.sum(m.accepted_at_BG, 0), "tested_at": np.sum(m.tested_at_BG, 0),
            "gamma_rounds": dict(zip(map(str, method.gammas), np.asarray(m.gamma_rounds_Z).tolist())),
            "round_time_s": None if round_time_s is None else list(round_time_s), "generated_ids": gen,
        }, out


# ----------------------------------------------------------------------------- transformers

def transformers_runs(w: workload.Workload, c, on_record, assistant_dir=None) -> None:
    """transformers `generate` on the same weights and token ids, batch 1, float32, per prompt:
    plain (`target_only`), prompt lookup (`prompt_lookup`: the n-gram gamma candidates,
    `max_matching_ngram_size` = max_ngram) and, with `assistant_dir` (the distilled draft exported
    as an HF checkpoint), assisted generation (`assisted_distilled`: its gamma tokens per round,
    constant schedule, confidence threshold 0 = no early stop of a round). Greedy: do_sample=False;
    T > 0: pure sampling (top_k 0, top_p 1), seeded per prompt. One untimed warm-up per method;
    prefill = one `model(prompt, logits_to_keep=1)` timed apart; decode = generate - prefill.
    Each prompt's record goes to `on_record`."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(int(c.torch_threads))
    model = transformers.AutoModelForCausalLM.from_pretrained(**w.hf_source, dtype=torch.float32).eval()
    assistant = None
    if assistant_dir is not None:
        assistant = transformers.AutoModelForCausalLM.from_pretrained(str(assistant_dir), dtype=torch.float32).eval()
        assistant.generation_config.update(num_assistant_tokens=int(c.gamma.distilled),
                                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    greedy_ref = {}
    with torch.inference_mode():
        def prefill(ids):
            t0 = time.perf_counter()
            model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
            return time.perf_counter() - t0

        def generate(ids, kw, qid):
            torch.manual_seed(c.seed * 1_000_003 + qid)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

        for temp in c.temperatures:
            for method in ("target_only", "prompt_lookup") + (("assisted_distilled",) if assistant else ()):
                kw = dict(max_new_tokens=c.max_new_tokens, num_beams=1, do_sample=temp > 0)
                if temp > 0:
                    kw.update(temperature=float(temp), top_k=0, top_p=1.0)
                if w.eos_ids:             # the workload's stop tokens (ignore_eos: max_new_tokens anyway)
                    kw.update(eos_token_id=list(w.eos_ids), pad_token_id=int(w.eos_ids[0]),
                              **({"min_new_tokens": c.max_new_tokens} if c.ignore_eos else {}))
                if method == "prompt_lookup":
                    kw.update(prompt_lookup_num_tokens=int(c.gamma.ngram), max_matching_ngram_size=int(c.max_ngram))
                if method == "assisted_distilled":
                    kw.update(assistant_model=assistant)
                ids0 = torch.tensor([list(w.prompts[0].ids)])
                generate(ids0, kw, w.prompts[0].question_id)                 # warm-up
                for p in w.prompts:
                    ids = torch.tensor([list(p.ids)])
                    pre_s, full_s = [], []
                    for _ in range(c.repeats):
                        pre_s.append(prefill(ids))
                        t, gen = generate(ids, kw, p.question_id)
                        full_s.append(t)
                    total, pre = toolkit.median(full_s), toolkit.median(pre_s)
                    decode = total - pre if total > pre else float("nan")
                    rec = {"framework": "transformers", "method": method, "drafter": method, "config": method,
                           "temperature": float(temp), "question_ids": [p.question_id], "category": p.category,
                           "prompt_tokens": [len(p.ids)], "batch": 1, "new_tokens": len(gen), "total_s": total,
                           "prefill_s": pre, "decode_s": decode, "total_s_all": full_s, "prefill_s_all": pre_s,
                           "tokens_per_s": len(gen) / decode if decode > 0 else float("nan"),
                           "e2e_tokens_per_s": len(gen) / total, "torch_threads": torch.get_num_threads(),
                           "generate_kwargs": {k: v for k, v in kw.items() if k != "assistant_model"},
                           "generated_ids": [gen]}
                    if temp == 0 and method == "target_only":
                        greedy_ref[p.question_id] = gen
                    elif temp == 0:
                        rec["greedy_matches_transformers"] = gen == greedy_ref.get(p.question_id)
                    on_record(rec)
