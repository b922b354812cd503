"""Sampled-path exactness on the real target: the first two committed tokens of speculative
sampling against the target's exact two-token distribution.

    python -m experiments.sampled_exactness.run --config=experiments/sampled_exactness/config.py[:ci]

For a fixed prompt and sampling setting (temperature, top-p; the same `sampling.probabilities`
for draft and target), the target's exact distribution of the first two tokens is
p(x1) p(x2 | x1): p(x1) from one forward of the prompt, p(x2 | x1) from one forward of
prompt + x1 for every x1 that is expected at least `min_expected` times in `samples` rows.
Cells: each pair (x1, x2) expected at least `min_expected` times; per frequent x1 the rest of
its row ("x1, any other x2") when that is expected often enough; one cell for all the rest;
a pooled cell expected less than `min_expected` times is merged into the smallest other cell.
Speculative decoding (batch `batch_size`, every row its own key, max_new_tokens 2, EOS an
ordinary token) fills the cells; Pearson's chi-square test (df = cells - 1) compares the
counts with the exact probabilities. A run passes at the Bonferroni level
family_alpha / (exact runs x prompts x settings); the negative control (`:misreported`, a draft
that reports a q other than the one it sampled from) must fail at that level.

Records (JSONL): a ``setup`` (config, machine, commit), one ``test`` per (run, prompt, setting)
with the statistic, df, p-value, cells, samples, the draft's acceptance and rounds, and a
``summary``; `report` writes results/README.md from the JSONL alone.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import build, decoding, sampling

from experiments.lib import toolkit


def _log(msg):
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ----------------------------------------------------------------------------- exact cells

@dataclasses.dataclass
class Cells:
    """A partition of all two-token continuations into cells with exact probabilities."""
    probs: np.ndarray                    # [K], sums to 1
    pair: dict                           # (x1, x2) -> cell
    first_rest: dict                     # x1 -> cell of (x1, any x2 without a cell of its own)
    other: int                           # every continuation not covered above

    def index(self, x1: int, x2: int) -> int:
        c = self.pair.get((x1, x2))
        if c is None:
            c = self.first_rest.get(x1, self.other)
        return c

    def counts(self, tokens_N2: np.ndarray) -> np.ndarray:
        out = np.zeros(len(self.probs), np.int64)
        for x1, x2 in tokens_N2:
            out[self.index(int(x1), int(x2))] += 1
        return out


def _distribution(target, params, seqs: list[list[int]], samp) -> np.ndarray:
    """[len(seqs), V] float64 next-token distributions after each (equal-length) sequence."""
    logits = target.apply(params, jnp.asarray(seqs, jnp.int32), None)[0][:, -1]
    p = np.asarray(sampling.probabilities(logits, samp), np.float64)
    return p / p.sum(-1, keepdims=True)


def exact_cells(target, params, prompt_ids: list[int], samp, n: int, min_expected: float = 5.0,
                batch: int = 32) -> Cells:
    p1 = _distribution(target, params, [prompt_ids], samp)[0]
    frequent = [int(x) for x in np.flatnonzero(n * p1 >= min_expected)]
    rows = []
    for i in range(0, len(frequent), batch):
        rows.append(_distribution(target, params, [prompt_ids + [x] for x in frequent[i:i + batch]], samp))
    p2 = np.concatenate(rows) if rows else np.zeros((0, p1.shape[0]))
    probs, pair, first_rest = [], {}, {}
    for x1, row in zip(frequent, p2):
        joint = p1[x1] * row
        kept = np.flatnonzero(n * joint >= min_expected)
        for x2 in kept:
            pair[(x1, int(x2))] = len(probs)
            probs.append(joint[x2])
        rest = p1[x1] - joint[kept].sum()
        if n * rest >= min_expected:
            first_rest[x1] = len(probs)
            probs.append(rest)
    other = len(probs)
    probs.append(max(0.0, 1.0 - float(np.sum(probs))))
    probs = np.asarray(probs)
    if n * probs[other] < min_expected and len(probs) > 1:
        # too rare for the chi-square approximation: pool it with the smallest other cell
        target_cell = int(np.argmin(probs[:other]))
        probs[target_cell] += probs[other]
        probs = probs[:other]
        other = target_cell
    return Cells(probs / probs.sum(), pair, first_rest, other)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value of `counts` against `probs`."""
    import scipy.stats
    n = counts.sum()
    expected = n * probs
    if np.any((expected == 0) & (counts > 0)):
        return float("inf"), len(probs) - 1, 0.0
    keep = expected > 0
    stat = float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]))
    df = int(keep.sum()) - 1
    return stat, df, float(scipy.stats.chi2.sf(stat, df))


# ----------------------------------------------------------------------------- sampling

@dataclasses.dataclass(frozen=True)
class Misreported:
    """Negative control: the inner drafter's proposals, reported with q^2 renormalized instead
    of the q they were drawn from (every other method delegates)."""
    inner: object

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, params, state, context, key_B, gamma, samp):
        tokens, q, state = self.inner.propose(params, state, context, key_B, gamma, samp)
        sharp = q * q
        return tokens, sharp / jnp.maximum(sharp.sum(-1, keepdims=True), 1e-30), state


def parse_run(spec: str):
    """"drafter:gamma:verifier[:misreported]" -> (kind, gamma or 'adaptive', verifier, misreported)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "misreported") \
            or not (parts[1].isdigit() or parts[1] == "adaptive") or parts[2] not in ("token", "block"):
        raise ValueError(f"config.runs: {spec!r} is not drafter:gamma|adaptive:token|block[:misreported]")
    return parts[0], parts[1] if parts[1] == "adaptive" else int(parts[1]), parts[2], len(parts) == 4


ADAPTIVE_GAMMAS = (0, 1, 2, 3)
# Fixed round times for adaptive gamma (seconds per round at gamma 0..3): the policy switches
# between lengths as its acceptance estimate moves; exactness must not depend on them.
ADAPTIVE_ROUND_S = (1.0, 1.25, 1.45, 1.6)


def sample_two(target, tparams, drafter, dparams, prompt_ids, samp, *, gamma, verifier, n, batch_size, key):
    """[n, 2] first two committed tokens of `n` rows and the summed metrics."""
    g = decoding.AdaptiveGamma(gammas=ADAPTIVE_GAMMAS) if gamma == "adaptive" else gamma
    config = decoding.GenerationConfig(max_new_tokens=2, gamma=g, verifier=verifier, eos_ids=())
    engine = decoding.Engine(target, drafter, config)
    params = decoding.EngineParams(target=tparams, draft=dparams)
    times = ADAPTIVE_ROUND_S if gamma == "adaptive" else None
    out, proposed, accepted, rounds, degenerate = [], 0, 0, 0, 0
    # The prompt enters the caches once; every row starts from a copy (`Prefill.repeat`).
    one = engine.prefill(params, decoding.make_batch([prompt_ids], config, key, request_ids=[0], pad_multiple=8))
    for start in range(0, n, batch_size):
        b = min(batch_size, n - start)
        batch = decoding.make_batch([prompt_ids] * b, config, key, request_ids=list(range(start, start + b)),
                                    pad_multiple=8)
        res = jax.device_get(engine.run(params, samp, batch, times, prefill=one.repeat(batch)))
        gen = res.generated()
        if any(len(t) != 2 for t in gen):
            raise AssertionError(f"rows with other than 2 tokens: {sorted({len(t) for t in gen})}")
        out.extend(gen)
        m = res.metrics
        proposed += int(np.sum(m.proposed_B))
        accepted += int(np.sum(m.accepted_B))
        rounds += int(np.sum(m.rounds_B))
        degenerate += int(np.sum(m.degenerate_residual_B))
    return np.asarray(out, np.int64), {"proposed": proposed, "accepted": accepted, "rounds": rounds,
                                       "degenerate_residuals": degenerate}


def _setting(text: str):
    t, _, p = text.partition(":")
    return sampling.SamplingConfig.make(temperature=float(t), top_p=float(p or 1.0)), float(t), float(p or 1.0)


def run(c) -> list[dict]:
    gc = toolkit.load_config(c.generate_config)
    if c.target:
        gc.target = c.target
    if c.get("draft_model", ""):
        gc.draft_model = c.draft_model
    gc.scan_layers, gc.cpu_kernel = c.scan_layers, c.cpu_kernel
    runs = [parse_run(s) for s in c.runs]
    target, tparams, tokenizer = build.load_target_with_tokenizer(build.generate_settings(gc))
    prompts = [tokenizer.encode(p) for p in c.prompts]
    out = pathlib.Path(c.out)
    prov = toolkit.provenance("experiments.sampled_exactness.run", exclude=[out.parent], config=c.to_dict())
    jl = toolkit.Jsonl(out, {**prov, "target": gc.target, "prompt_ids": prompts})
    exact_runs = sum(1 for r in runs if not r[3]) * len(prompts) * len(c.sampling)
    level = c.family_alpha / max(exact_runs, 1)
    drafters = {}
    tests = []
    key = jax.random.key(c.seed)
    for si, setting in enumerate(c.sampling):
        samp, temperature, top_p = _setting(setting)
        for pi, ids in enumerate(prompts):
            cells = exact_cells(target, tparams, ids, samp, c.samples, c.min_expected)
            _log(f"prompt {pi} at T={temperature} top-p={top_p}: {len(cells.probs)} cells")
            for ri, (spec, (kind, gamma, verifier, misreported)) in enumerate(zip(c.runs, runs)):
                if kind not in drafters:
                    drafters[kind] = build.make_drafter(kind, target, tparams, early_exit_layers=gc.early_exit_layers,
                                                        draft_model=gc.draft_model, max_ngram=gc.max_ngram,
                                                        min_ngram=gc.min_ngram, dtype=gc.dtype,
                                                        scan_layers=gc.scan_layers, target_name=gc.target)
                drafter, dparams = drafters[kind]
                if misreported:
                    drafter = Misreported(drafter)
                t0 = time.perf_counter()
                toks, metrics = sample_two(target, tparams, drafter, dparams, ids, samp, gamma=gamma,
                                           verifier=verifier, n=c.samples, batch_size=c.batch_size,
                                           key=jax.random.fold_in(key, (si * 100 + pi) * 100 + ri))
                counts = cells.counts(toks)
                stat, df, pvalue = chi_square(counts, cells.probs)
                rec = {"run": spec, "drafter": kind, "gamma": gamma, "verifier": verifier, "negative_control": misreported,
                       "prompt": pi, "temperature": temperature, "top_p": top_p, "samples": int(c.samples),
                       "cells": len(cells.probs), "chi2": stat, "df": df, "p_value": pvalue, "level": level,
                       "passed": (pvalue >= level) if not misreported else (pvalue < level),
                       "acceptance": metrics["accepted"] / max(metrics["proposed"], 1), **metrics,
                       "seconds": time.perf_counter() - t0}
                jl.write("test", **rec)
                tests.append(rec)
                _log(f"{spec} prompt {pi} T={temperature} top-p={top_p}: chi2 {stat:.1f} df {df} p {pvalue:.3g} "
                     f"({'negative control' if misreported else 'exact'}: {'as expected' if rec['passed'] else 'FAILED'})"
                     f"; acceptance {rec['acceptance']:.2f}, {rec['seconds']:.0f}s")
    jl.write("summary", exact_runs=exact_runs, level=level, all_as_expected=all(t["passed"] for t in tests))
    jl.close()
    return tests


def report(path) -> str:
    """results/README.md's table from the JSONL alone."""
    recs = toolkit.read_jsonl(path)
    prov = recs[0]["provenance"]
    tests = [r for r in recs if r["kind"] == "test"]
    summary = next(r for r in recs if r["kind"] == "summary")
    f = toolkit.fmt
    lines = ["# Sampled-path exactness on the real target", ""] + toolkit.provenance_lines(prov) + [
        f"- per test {tests[0]['samples']} rows, the first two committed tokens; Pearson chi-square against the "
        f"target's exact p(x1) p(x2|x1), cells expected < {prov['config']['min_expected']} times pooled; "
        f"Bonferroni level {summary['level']:.2g} per test = family-wise {prov['config']['family_alpha']} over "
        f"{summary['exact_runs']} exact tests; a negative control passes when its p-value is *below* the level", "",
        toolkit.table(["run", "prompt", "T", "top-p", "cells", "chi2 / df", "p-value", "acceptance", "rounds/row",
                       "degenerate", "as expected"],
                      [[r["run"], r["prompt"], r["temperature"], r["top_p"], r["cells"], f"{f(r['chi2'], 1)} / {r['df']}",
                        f"{r['p_value']:.3g}", f(r["acceptance"]), f(r["rounds"] / r["samples"]),
                        r["degenerate_residuals"], "yes" if r["passed"] else "**no**"] for r in tests]),
        "", f"All as expected: {'yes' if summary['all_as_expected'] else 'no'}."]
    return "\n".join(lines) + "\n"


def main(c):
    run(c)
    readme = pathlib.Path(c.out).with_name("README.md")
    readme.write_text(report(c.out))
    print(readme.read_text())


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/sampled_exactness/config.py")
