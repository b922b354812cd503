"""specjax measurements: jitted generation (target-only and speculative), k-token forward costs,
draft costs.

Shapes: every prompt is right-padded to a multiple of `pad_multiple` (default 128) and every
configuration of one prompt uses the same cache capacity, `capacity_for(prompt, largest gamma
of the run, multiple=pad_multiple)`, so (a) prompts of nearby lengths share one compiled
program and (b) target-only and speculative runs of a prompt attend over the same number of
slots (specjax's attention reads the whole cache capacity, masked), so their speed compares
like with like.

Timing: `timed()` waits for the result (`block_until_ready`). A configuration is run once
untimed per compiled shape (its warm-up, whose trace + compile seconds `CompileLog` records),
then `repeats` timed runs whose median is kept. The prefill is the jitted
`specjax.decoding.init_state` of the same configuration (target prefill, plus the draft's
for a model drafter), timed separately with the same inputs; decode time = median full
generation time - median prefill time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import build, decoding
from specjax import sampling as sampling_lib

from experiments.bench_speed.common import CompileLog, median, timed
from experiments.bench_speed.workload import Prompt, Workload


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One decoding method: `name` in the report, which drafter, which gamma."""
    name: str
    drafter: str                                   # none | ngram | early_exit
    gamma: Any                                     # int, or decoding.AdaptiveGamma

    @property
    def gammas(self) -> tuple[int, ...]:
        return self.gamma.gammas if isinstance(self.gamma, decoding.AdaptiveGamma) else (int(self.gamma),)

    @property
    def max_gamma(self) -> int:
        return max(self.gammas)

    def describe(self) -> str:
        if isinstance(self.gamma, decoding.AdaptiveGamma):
            return f"{self.drafter}, adaptive gamma in {list(self.gamma.gammas)}"
        return "target only" if self.drafter == "none" else f"{self.drafter}, gamma {self.gamma}"


@dataclasses.dataclass
class Inputs:
    prompt: Prompt
    prompt_BP: jax.Array
    plens_B: jax.Array
    key_B: jax.Array
    capacity: int


def prepare_inputs(workload: Workload, max_new_tokens: int, max_gamma: int, pad_multiple: int,
                   seed: int) -> list[Inputs]:
    base_key = jax.random.key(seed)
    probe = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=max_gamma)
    out = []
    for p in workload.prompts:
        prompt_BP, plens = decoding.pad_prompts([list(p.ids)], workload.target.vocab_size, multiple=pad_multiple)
        cap = decoding.capacity_for([len(p.ids)], probe, multiple=pad_multiple)
        cap = max(cap, int(prompt_BP.shape[1]))
        out.append(Inputs(p, prompt_BP, plens, decoding.request_keys(base_key, [p.question_id]), cap))
    return out


class Drafters:
    """Builds each drafter once: (drafter, draft_params) by kind."""

    def __init__(self, workload: Workload, early_exit_layers: int, max_ngram: int, draft_model: str = ""):
        self.workload = workload
        self.draft_model = draft_model
        self.early_exit_layers = min(early_exit_layers, workload.target.config.num_layers - 1)
        self.max_ngram = max_ngram
        self._cache: dict[str, tuple] = {}

    def get(self, kind: str):
        if kind not in self._cache:
            w = self.workload
            self._cache[kind] = build.make_drafter(kind, w.target, w.params, early_exit_layers=self.early_exit_layers,
                                                   max_ngram=self.max_ngram, draft_model=self.draft_model,
                                                   target_name=w.name)
        return self._cache[kind]


# ----------------------------------------------------------------------------- generation

class Runner:
    """Runs one configuration on one prompt: warm-up once per compiled shape, then repeats."""

    def __init__(self, workload: Workload, drafters: Drafters, log: CompileLog, max_new_tokens: int,
                 repeats: int, eos_ids: tuple[int, ...], verifier: str = "token"):
        self.w = workload
        self.drafters = drafters
        self.log = log
        self.max_new_tokens = max_new_tokens
        self.repeats = repeats
        self.eos_ids = tuple(eos_ids)
        self.verifier = verifier
        self.warmed: set = set()

    def generation_config(self, cfg: DecodeConfig) -> decoding.GenerationConfig:
        return decoding.GenerationConfig(max_new_tokens=self.max_new_tokens, gamma=cfg.gamma,
                                         verifier=self.verifier, eos_ids=self.eos_ids)

    def run(self, cfg: DecodeConfig, temperature: float, inp: Inputs, round_time_s=None) -> dict:
        w = self.w
        drafter, dparams = self.drafters.get(cfg.drafter)
        gen = self.generation_config(cfg)
        samp = sampling_lib.SamplingConfig.make(temperature=temperature)

        def prefill():
            return decoding.init_state(w.target, w.params, drafter, dparams, gen, inp.prompt_BP, inp.plens_B,
                                       inp.key_B, inp.capacity)

        if cfg.drafter == "none":
            def full():
                return decoding.autoregressive_generate(w.target, w.params, inp.prompt_BP, inp.plens_B, inp.key_B,
                                                        samp, self.max_new_tokens, eos_ids=self.eos_ids,
                                                        capacity=inp.capacity)
        else:
            def full():
                return decoding.speculative_generate(w.target, w.params, drafter, dparams, inp.prompt_BP,
                                                     inp.plens_B, inp.key_B, samp, gen, round_time_s=round_time_s,
                                                     capacity=inp.capacity)

        shape_key = (cfg, float(temperature), tuple(inp.prompt_BP.shape), inp.capacity)
        warm = {"compile_s": 0.0, "compiles": 0, "first_call_s": None}
        if shape_key not in self.warmed:
            with self.log.section() as box:
                t_pre, _ = timed(prefill)
                t_full, _ = timed(full)
            warm = {"compile_s": box["compile_s"], "compiles": box["compiles"], "first_call_s": t_pre + t_full}
            self.warmed.add(shape_key)

        pre_s, full_s, out = [], [], None
        with self.log.section() as timed_box:
            for _ in range(self.repeats):
                t, _ = timed(prefill)
                pre_s.append(t)
                t, out = timed(full)
                full_s.append(t)
        out = jax.device_get(out)
        gen_ids = out.generated()[0]
        m = out.metrics
        total, pre = median(full_s), median(pre_s)
        decode = total - pre if total > pre else float("nan")   # <= 0: lost in timing noise
        n = len(gen_ids)
        return {
            "question_id": inp.prompt.question_id,
            "category": inp.prompt.category,
            "prompt_tokens": len(inp.prompt.ids),
            "padded_prompt_width": int(inp.prompt_BP.shape[1]),
            "capacity": inp.capacity,
            "new_tokens": n,
            "status": decoding.STATUS_NAMES[int(np.asarray(out.status_B)[0])],
            "total_s": total,
            "prefill_s": pre,
            "decode_s": decode,
            "total_s_all": full_s,
            "prefill_s_all": pre_s,
            "tokens_per_s": n / decode if decode > 0 else float("nan"),
            "e2e_tokens_per_s": n / total if total > 0 else float("nan"),
            "compile_s": warm["compile_s"],
            "compiles": warm["compiles"],
            "first_call_s": warm["first_call_s"],
            "compiles_during_timing": timed_box["compiles"],
            "rounds": int(np.asarray(m.rounds_B)[0]),
            "proposed": int(np.asarray(m.proposed_B)[0]),
            "accepted": int(np.asarray(m.accepted_B)[0]),
            "committed": int(np.asarray(m.committed_B)[0]),
            "degenerate_residuals": int(np.asarray(m.degenerate_residual_B)[0]),
            "accepted_at": np.asarray(m.accepted_at_BG)[0].tolist(),
            "tested_at": np.asarray(m.tested_at_BG)[0].tolist(),
            "gamma_rounds": dict(zip([str(g) for g in cfg.gammas], np.asarray(m.gamma_rounds_K).tolist()))
            if cfg.drafter != "none" else {"0": int(np.asarray(m.rounds_B)[0])},
            "generated_ids": gen_ids,
        }


# ----------------------------------------------------------------------------- forward costs

def _time_many(fn, args, iters: int) -> list[float]:
    return [timed(fn, *args)[0] for _ in range(iters)]


def probe_tokens(k: int, vocab_size: int) -> jax.Array:
    """Fixed [1, k] token ids for cost probes (the cost does not depend on them)."""
    return (jnp.arange(k, dtype=jnp.int32)[None, :] * 7 + 3) % vocab_size


def donated_step(model, params, k: int, ctx: int, capacity: int):
    """A jitted, cache-donated k-token step (logits and the in-place cache write, as in the
    generation loop) against a cache holding `ctx` tokens. Returns `call()`: one step, waited
    for, after which the cache is rolled back to `ctx` for the next call (compiles on the first)."""
    step = jax.jit(model.apply, donate_argnums=(2,))
    tokens = probe_tokens(k, model.vocab_size)
    # A fresh lengths array each time: the cache (lengths included) is donated to the step.
    state = {"cache": model.init_cache(1, capacity).rollback(jnp.full((1,), ctx, jnp.int32))}

    def call():
        logits, cache = step(params, tokens, state["cache"])
        jax.block_until_ready((logits, cache))
        state["cache"] = cache.rollback(jnp.full((1,), ctx, jnp.int32))

    return call


def forward_cost(model, params, ks, ctx: int, capacity: int, iters: int, log: CompileLog) -> dict:
    """Median seconds of one jitted `model.apply` of k tokens against a cache of `capacity`
    slots holding `ctx` committed tokens, for each k. Only the logits are returned, so the
    timed program does not copy the (non-donated) cache buffers; inside the generation loop
    the cache update is an in-place write of k slots, which this leaves out."""
    if ctx + max(ks) > capacity:
        raise ValueError(f"context {ctx} + k {max(ks)} exceeds capacity {capacity}")
    cache = model.init_cache(1, capacity)
    cache = cache.replace(lengths_B=jnp.full((1,), ctx, jnp.int32))
    fn = jax.jit(lambda p, t, c: model.apply(p, t, c)[0])
    out = {}
    for k in ks:
        tokens = probe_tokens(k, model.vocab_size)
        with log.section() as box:
            timed(fn, params, tokens, cache)
        times = _time_many(fn, (params, tokens, cache), iters)
        out[int(k)] = {"median_s": median(times), "min_s": float(min(times)), "compile_s": box["compile_s"]}
    return out


def propose_cost(target, drafter, dparams, gamma: int, temperature: float, ctx: int, capacity: int,
                 iters: int, log: CompileLog, seed: int = 0, batch: int = 1) -> dict:
    """Median seconds of one jitted `drafter.propose` of `gamma` tokens per row (`batch` rows) at
    context `ctx` (the draft's own state prefilled on a random context first; a drafter that
    reads the target's cache, `reads_target_cache`, gets one holding ctx - 1 tokens, as in the
    loop)."""
    rng = np.random.default_rng(seed)
    tokens_BL = jnp.asarray(rng.integers(0, target.vocab_size, size=(batch, capacity)), jnp.int32)
    lengths_B = jnp.full((batch,), ctx, jnp.int32)
    state = jax.jit(lambda dp, tk, ln: drafter.init(dp, tk, ln, capacity))(dparams, tokens_BL[:, :ctx], lengths_B)
    extra = {}
    if getattr(drafter, "reads_target_cache", False):
        cache = target.init_cache(batch, capacity)
        extra = {"target_cache": cache.replace(lengths_B=jnp.full((batch,), ctx - 1, jnp.int32))}
    samp = sampling_lib.SamplingConfig.make(temperature=temperature)
    keys = decoding.request_keys(jax.random.key(seed), list(range(batch)))
    fn = jax.jit(lambda dp, st, tk, ln, ky, sp, ex: drafter.propose(dp, st, tk, ln, ky, gamma, sp, **ex)[:2])
    args = (dparams, state, tokens_BL, lengths_B, keys, samp, extra)
    with log.section() as box:
        timed(fn, *args)
    times = _time_many(fn, args, iters)
    return {"median_s": median(times), "min_s": float(min(times)), "compile_s": box["compile_s"]}
