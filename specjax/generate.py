"""`specjax generate`: speculative generation on one chat prompt, streamed, then one line of stats.

`generate_job` types the command's config once (`GenerateJob`: the generation settings, the
prompt and the command's own keys); `run` loads the target and the drafter, streams the text as
rounds commit and prints tokens/s, the speedup over target-only decoding of the same prompt
(timed in the same run) and the mean accepted tokens per target pass; compilation is excluded
from tokens/s (the first round of each run is the warm-up) and reported separately. What a run
says about its drafter beyond that comes from the drafter's kind (`DrafterKind.describe`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from specjax import build, decoding, drafters, files
from specjax.settings import Settings, field_types, typed_value


@dataclasses.dataclass(frozen=True)
class GenerateJob(Settings):
    """`specjax generate`'s settings: the generation settings and the command's own keys."""
    run: build.GenerateSettings = build.GenerateSettings()
    prompt: str = ""
    system: str = ""
    seed: int = 0
    compare_target_only: bool = True        # also time target-only decoding for the speedup
    metrics_jsonl: str = ""                 # append the run's stats as one JSON line
    calibration_cache: str = "~/.cache/specjax/calibration.json"
    recalibrate: bool = False
    compilation_cache_dir: str = "~/.cache/specjax/xla"
    distributed: bool = False


def generate_job(c: Any) -> GenerateJob:
    """`GenerateJob` of a generate config (a ConfigDict or a mapping), typed once: the generation
    settings (`build.generate_settings`) and the command's own keys (absent: the defaults)."""
    values = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    hints = field_types(GenerateJob)
    own = {f.name: typed_value(f.name, hints[f.name], values[f.name]) for f in dataclasses.fields(GenerateJob)
           if f.name != "run" and f.name in values}
    return GenerateJob(run=build.generate_settings(values), **own)


def stream_tokens(gen, batch, samp, on_tokens=None, prefill=None):
    """Stream row 0 of one generation; returns (tokens, timing summary, GenerateOutput). Under
    adaptive gamma every candidate's round compiles before the first token (its time counts in
    the time to the first token, not in tokens/s)."""
    tokens, events = [], []
    for ev in gen.stream(batch, samp, prefill=prefill, precompile=True):
        events.append(ev)
        tokens.extend(ev.new_tokens[0])
        if on_tokens is not None:
            on_tokens(ev.new_tokens[0])
    return tokens, decoding.timing_summary(events), events[-1].output


def _describe(gamma) -> str:
    """A draft length, a tree or an adaptive policy, in a few words."""
    return gamma.describe() if hasattr(gamma, "describe") else str(gamma)


def _priced(gammas, round_time_s, alpha) -> str:
    """Calibrated round times priced at acceptance ``alpha``: expected ms per committed token,
    with the adaptive policy's own expected tokens per candidate (what it compares)."""
    from specjax.decoding import adaptive
    expected = np.asarray(adaptive.expected_per_candidate(float(alpha), gammas), np.float64)
    per = [1e3 * t / e for t, e in zip(round_time_s, expected)]
    return (", ".join(f"{_describe(g)}: {p:.1f}" for g, p in zip(gammas, per))
            + f" (cheapest: {_describe(gammas[int(np.argmin(per))])})")


def _why(config, stats, m, round_time_s, policy=None, regime_names=()) -> str:
    """Which proposal lengths (or trees) the run used, and, under adaptive gamma, why: the
    calibrated round times priced at the acceptance the run measured (first proposals), or,
    for a drafter with several regimes (``regime_names``), each regime's round times priced at
    the policy's final acceptance estimate for that regime."""
    used = ", ".join(f"{g} in {n} rounds" for g, n in stats["proposal_rounds"].items() if n)
    if not config.adaptive or round_time_s is None:
        return f"gamma {_describe(config.gamma)} ({used})"
    G = len(config.gammas)
    if len(regime_names) > 1 and policy is not None and len(round_time_s) == len(regime_names) * G:
        alpha_R = np.asarray(policy.alpha_R)
        return (f"adaptive gamma used {used}; expected ms per token from the calibrated round times at the "
                f"policy's final acceptance estimate of each draft source: " + "; ".join(
                    f"{name} (estimate {alpha_R[r]:.2f}) " + _priced(config.gammas, round_time_s[r * G:(r + 1) * G], alpha_R[r])
                    for r, name in enumerate(regime_names)))
    tested, accepted = int(m.tested_at_BG[0][0]), int(m.accepted_at_BG[0][0])
    alpha = accepted / tested if tested else config.gamma.initial_alpha
    return (f"adaptive gamma used {used}; at the measured first-proposal acceptance {min(alpha, 1 - 1e-6):.2f} the "
            f"calibrated expected ms per token are " + _priced(config.gammas, round_time_s, alpha))


def _regime_names(engine) -> tuple[str, ...]:
    """Names of the drafter's draft sources that adaptive gamma tells apart (one: ``("",)``)."""
    if engine.regimes == 1:
        return ("",)
    return tuple(getattr(engine.drafter, "regime_names", [str(r) for r in range(engine.regimes)]))


def calibration_fields(s: build.GenerateSettings, batch, config) -> dict:
    """The settings of a run that change adaptive gamma's round times: with the machine, the key
    of its calibration in the cache (`specjax.calibration.setting_key`). The drafter enters by
    its kind and its own settings block."""
    import os

    import specjax
    return {"specjax": specjax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "target": s.target,
            "dtype": s.dtype, "scan_layers": bool(s.scan_layers), "fuse_projections": bool(s.fuse_projections),
            "cpu_kernel": build.use_cpu_kernel(s), "drafter": s.drafter, "draft": dataclasses.asdict(s.draft),
            "gammas": [str(g) for g in config.gammas],
            "prompt_shape": list(batch.prompt_BP.shape), "capacity": int(batch.capacity),
            "greedy": s.temperature == 0, "top_k": int(s.top_k), "top_p": float(s.top_p),
            "verifier": s.verifier, "tree": s.tree, "adaptive_trees": list(s.adaptive_trees),
            "tree_verifier": s.tree_verifier, "tree_children": s.tree_children}


def _round_times(job: GenerateJob, gen, batch, samp, pre) -> str:
    """Set adaptive gamma's round times on `gen`: from the calibration cache
    (``calibration_cache``) when it holds this machine and setting and ``recalibrate`` is off,
    else measured (`Generator.calibrate`) and stored. Returns 'cached' or 'measured'."""
    from specjax import calibration
    config = gen.config
    cache = calibration.CalibrationCache(job.calibration_cache)
    fields = calibration_fields(job.run, batch, config)
    key = calibration.setting_key(**fields)
    # Several processes measure together (and take process 0's times, `Generator.calibrate`):
    # reading a per-host cache could send them down different paths.
    import jax
    multi = jax.process_count() > 1
    cached = None if job.recalibrate or multi else cache.get(key)
    regimes = gen.engine.regimes
    if cached is not None and len(cached) == regimes * len(config.gammas):
        gen.round_time_s = cached               # what `calibrate` would have set
        source, head = "cached", f"round times (ms) per gamma from the calibration cache {cache.path}:"
    else:
        times = gen.calibrate(batch, samp, repeats=3, prefill=pre)
        if not multi:
            cache.put(key, fields, times)
        source, head = "measured", "calibrated round times (ms) per gamma"
    G, names = len(config.gammas), _regime_names(gen.engine)
    print(f"[specjax] {head} " + "; ".join(
        (f"{names[r]}: " if regimes > 1 else "")
        + ", ".join(f"{g}: {1e3 * t:.1f}" for g, t in zip(config.gammas, gen.round_time_s[r * G:(r + 1) * G]))
        for r in range(regimes)), file=sys.stderr)
    return source


def main(job: GenerateJob) -> dict:
    """The main command on typed settings: the prompt's text, the seed and the metrics file
    checked, the caches set, then the run (which checks the generation settings and a local
    target's context before anything loads, `build.load_generator`)."""
    decoding.check_text(job.prompt, "prompt")     # bytes that are not UTF-8, before anything loads
    decoding.check_text(job.system, "system")
    build.check_seed(job.seed)
    files.check_output_file("metrics_jsonl", job.metrics_jsonl)
    build.enable_compilation_cache(job.compilation_cache_dir)
    build.limit_heap_retention()
    return run(job)


def run(job: GenerateJob) -> dict:
    """The main command's run: load, prefill once, (calibrate,) stream the speculative run, time
    target-only on the same prefill, print and return the stats."""
    import jax

    s = job.run
    samp = build.sampling_config(s)
    t0 = time.perf_counter()
    gen = build.load_generator(s)                   # the settings checked before anything loads
    tok = gen.tokenizer
    load_s = time.perf_counter() - t0
    # Prompts padded to a multiple of 64; target-only and speculative runs share one capacity,
    # so both attend over the same number of cache slots.
    prompt_ids = gen.encode(job.prompt, system=job.system)
    batch = gen.batch([prompt_ids], jax.random.key(job.seed))
    config = gen.config

    print(f"[specjax] target {s.target} ({gen.engine.target.config.num_layers} layers), drafter {s.drafter}, "
          f"gamma {_describe(config.gamma)}, temperature {s.temperature}; prompt {len(prompt_ids)} tokens; "
          f"loaded in {load_s:.1f}s", file=sys.stderr)
    print(f"\n>>> {job.prompt}\n", flush=True)
    decoder = tok.incremental_decoder(skip_special_tokens=True)

    round_sizes = []                        # tokens committed per round (a drafter's replay)

    def show(ids):
        round_sizes.append(len(ids))
        piece = decoder.add(ids)
        if piece:
            print(piece, end="", flush=True)

    # The prompt enters the caches once; calibration, the speculative run and the target-only
    # run all start from this prefill.
    t1 = time.perf_counter()
    pre = gen.prefill(batch)
    jax.block_until_ready((pre.target_cache, pre.draft_state))
    prefill_s = time.perf_counter() - t1
    calibration = _round_times(job, gen, batch, samp, pre) if config.adaptive else "none"
    tokens, timing, out = stream_tokens(gen, batch, samp, show, prefill=pre)
    spec_tps, spec_first_s = timing["tokens_per_s"], prefill_s + timing["ttft_s"]
    print(decoder.finish(), flush=True)
    m = jax.device_get(out.metrics)
    rounds = int(np.asarray(m.rounds_B)[0])
    stats = _run_stats({"target": s.target, "drafter": s.drafter, "gamma": str(config.gamma), "tree": s.tree,
                        "temperature": s.temperature}, config, out, m, tokens, timing, prefill_s, calibration,
                       gen.engine.mesh)
    why = _why(config, stats, m, gen.round_time_s, out.policy, _regime_names(gen.engine))
    kind = s.drafter_kind
    record = drafters.RunRecord(tuple(prompt_ids), tuple(tokens), tuple(round_sizes))
    if kind.describe is not None:
        text, extra = kind.describe(s.draft, gen.engine.drafter, record)
        stats.update(extra)
        why += f"; {text}"
    if kind.after_run is not None:
        try:
            kind.after_run(s.draft, record)
        except OSError as e:        # e.g. a full disk: what the drafter keeps for later runs is not updated
            print(f"[specjax] warning: drafter {s.drafter}: {e}", file=sys.stderr, flush=True)
    draft_model = getattr(s.draft, "draft_model", "")
    print(f"[specjax] drafter {s.drafter}" + (f" ({draft_model})" if draft_model else "")
          + ": " + why, file=sys.stderr, flush=True)
    if stats["invalid_draft_rounds"]:
        print(f"[specjax] warning: in {stats['invalid_draft_rounds']} of {rounds} rounds the drafter's q was not a "
              f"distribution over the vocabulary (NaN, negative, or not summing to 1): those proposals were "
              f"discarded and the target sampled alone (exact, but no speedup); the draft is broken",
              file=sys.stderr, flush=True)
    stopped = row_status_line(0, stats["status"], len(tokens))      # the one row of the prompt
    if stats["status"] == "nan_logits" and not tokens:
        _write_stats(job.metrics_jsonl, stats)
        raise GenerationFailed(f"no output: {stopped}; check the target's weights and dtype (nothing to time or "
                               f"compare)")
    if stopped:
        print(f"[specjax] warning: {stopped}", file=sys.stderr, flush=True)
    if job.compare_target_only and s.drafter != drafters.TARGET_ONLY:
        base_tokens, base_timing, _ = stream_tokens(gen.target_only(), batch, samp, prefill=pre)
        base_tps = base_timing["tokens_per_s"]
        stats["target_only_tokens_per_s"] = base_tps
        stats["speedup"] = spec_tps / base_tps
        if s.temperature == 0:
            stats["same_tokens_as_target_only"] = base_tokens == tokens
    line = (f"[specjax] {stats['new_tokens']} tokens, {rate_text(spec_tps)}"
            + (f", speedup {stats['speedup']:.2f}x over target-only ({rate_text(stats['target_only_tokens_per_s'])})"
               if "speedup" in stats and np.isfinite(stats["speedup"]) else "")
            + f", mean accepted tokens {stats['mean_accepted_tokens']:.2f} per target pass"
            + f" (time to first token incl. compile {spec_first_s:.1f}s)")
    print(line, flush=True)
    _write_stats(job.metrics_jsonl, stats)
    return stats


def _run_stats(head: dict, config, out, m, tokens, timing, prefill_s, calibration, mesh) -> dict:
    """The speculative run's stats record after ``head`` (the run's settings), before the
    target-only comparison."""
    rounds = int(np.asarray(m.rounds_B)[0])
    return {
        **head,
        "new_tokens": len(tokens), "tokens_per_s": timing["tokens_per_s"],
        "ttft_s_incl_compile": prefill_s + timing["ttft_s"], "prefill_s_incl_compile": prefill_s,
        "inter_token_s": timing["inter_token_s"],
        "target_passes": rounds, "mean_accepted_tokens": len(tokens) / max(rounds, 1),
        "proposed": int(m.proposed_B[0]), "accepted": int(m.accepted_B[0]),
        "degenerate_residuals": int(m.degenerate_residual_B[0]),
        "invalid_draft_rounds": int(m.invalid_draft_rounds_B[0]),
        "status": out.statuses()[0],
        "tokens_scored_per_pass": int(m.scored_B[0]) / max(rounds, 1),
        "acceptance_per_depth": [float(x) / max(int(t), 1) for x, t in zip(m.accepted_at_BG[0], m.tested_at_BG[0])],
        "calibration": calibration,
        "mesh": dict(mesh.shape) if mesh is not None else None,
        "proposal_rounds": {_describe(g): int(n) for g, n in zip(config.gammas, np.asarray(m.gamma_rounds_Z))},
    }


class GenerationFailed(RuntimeError):
    """A generation that produced no output (its row stopped at non-finite target logits
    before the first token): exit status 1, one line."""


# Statuses of a row that are a normal finish (`decoding.STATUS_NAMES`); any other is reported.
NORMAL_FINISH = ("eos", "max_new_tokens")
_STATUS_WHY = {"nan_logits": "the target's logits were not finite (NaN or +inf) at the next position",
               "running": "the loop ended before the row finished"}


def row_status_line(row: int, status: str, n_tokens: int) -> str | None:
    """One line for a row that did not finish normally (None for ``eos`` / ``max_new_tokens``):
    ``row 0 stopped: nan_logits after 3 tokens (the target's logits were not finite ...)``."""
    if status in NORMAL_FINISH:
        return None
    return (f"row {row} stopped: {status} after {n_tokens} token{'s' if n_tokens != 1 else ''} "
            f"({_STATUS_WHY.get(status, 'not a normal finish')})")


def rate_text(tokens_per_s) -> str:
    """``<rate> tokens/s`` with one decimal, or ``tokens/s n/a`` when there is no rate (fewer than two
    rounds with tokens)."""
    x = float(tokens_per_s) if tokens_per_s is not None else float("nan")
    return f"{x:.1f} tokens/s" if np.isfinite(x) else "tokens/s n/a (too few tokens to time)"


def _write_stats(path: str, stats: dict) -> None:
    from specjax import distributed
    if path and distributed.is_primary():
        import pathlib
        with open(pathlib.Path(path).expanduser(), "a") as f:
            f.write(json.dumps(stats) + "\n")

