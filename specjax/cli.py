"""specjax's main command: speculative generation on a chat prompt, streamed, with stats.

    python -m specjax.cli --config=configs/generate.py --config.prompt="..."

Streams the text as rounds commit, then prints one line of stats: tokens/s, speedup over
target-only decoding of the same prompt (timed in the same run), mean accepted tokens per
target pass. Compilation is excluded from tokens/s (the first round of each run is the
warm-up) and reported separately.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

from absl import app
from ml_collections import config_flags

def stream_tokens(gen, batch, samp, on_tokens=None, prefill=None):
    """Stream row 0 of one generation; returns (tokens, timing summary, GenerateOutput)."""
    from specjax import decoding
    tokens, events = [], []
    for ev in gen.stream(batch, samp, prefill=prefill):
        events.append(ev)
        tokens.extend(ev.new_tokens[0])
        if on_tokens is not None:
            on_tokens(ev.new_tokens[0])
    return tokens, decoding.timing_summary(events), events[-1].output


def _describe(gamma) -> str:
    """A draft length, a tree or an adaptive policy, in a few words."""
    return gamma.describe() if hasattr(gamma, "describe") else str(gamma)


def _why(config, stats, m, round_time_s) -> str:
    """Which proposal lengths (or trees) the run used, and, under adaptive gamma, why: the
    calibrated round times priced at the acceptance the run measured (first proposals)."""
    used = ", ".join(f"{g} in {n} rounds" for g, n in stats["proposal_rounds"].items() if n)
    if not config.adaptive or round_time_s is None:
        return f"gamma {_describe(config.gamma)} ({used})"
    from specjax import analysis
    tested, accepted = int(m.tested_at_BG[0][0]), int(m.accepted_at_BG[0][0])
    alpha = min(accepted / tested if tested else config.gamma.initial_alpha, 1 - 1e-6)
    expected = [analysis.expected_tokens_per_round(alpha, g) if isinstance(g, int) else float(g.expected_tokens(alpha))
                for g in config.gammas]
    per = [1e3 * t / e for t, e in zip(round_time_s, expected)]
    best = _describe(config.gammas[int(np.argmin(per))])
    return (f"adaptive gamma used {used}; at the measured first-proposal acceptance {alpha:.2f} the calibrated "
            f"expected ms per token are " + ", ".join(f"{_describe(g)}: {p:.1f}" for g, p in zip(config.gammas, per))
            + f" (cheapest: {best})")


def calibration_fields(c, batch, config) -> dict:
    """The settings of a run that change adaptive gamma's round times: with the machine, the key
    of its calibration in the cache (`specjax.calibration.setting_key`)."""
    import os

    import specjax
    from specjax import build
    return {"specjax": specjax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "target": c.target, "dtype": c.dtype, "scan_layers": bool(c.scan_layers),
            "fuse_projections": bool(c.get("fuse_projections", False)), "cpu_kernel": build.use_cpu_kernel(c),
            "drafter": c.drafter, "draft_model": c.draft_model, "early_exit_layers": int(c.early_exit_layers),
            "max_ngram": int(c.max_ngram), "gammas": [str(g) for g in config.gammas],
            "prompt_shape": list(batch.prompt_BP.shape), "capacity": int(batch.capacity),
            "greedy": c.temperature == 0, "top_k": int(c.top_k), "top_p": float(c.top_p),
            "verifier": c.verifier, "tree": c.get("tree", ""), "adaptive_trees": list(c.get("adaptive_trees", ())),
            "tree_verifier": c.get("tree_verifier", "traversal"), "tree_children": c.get("tree_children", "iid")}


def _round_times(c, gen, batch, samp, pre) -> str:
    """Set adaptive gamma's round times on `gen`: from the calibration cache
    (``calibration_cache``) when it holds this machine and setting and ``recalibrate`` is off,
    else measured (`Generator.calibrate`) and stored. Returns 'cached' or 'measured'."""
    from specjax import calibration
    config = gen.config
    cache = calibration.CalibrationCache(c.get("calibration_cache", ""))
    fields = calibration_fields(c, batch, config)
    key = calibration.setting_key(**fields)
    cached = None if c.get("recalibrate", False) else cache.get(key)
    if cached is not None and len(cached) == len(config.gammas):
        gen.round_time_s = cached               # what `calibrate` would have set
        source, head = "cached", f"round times (ms) per gamma from the calibration cache {cache.path}:"
    else:
        cache.put(key, fields, gen.calibrate(batch, samp, repeats=3, prefill=pre))
        source, head = "measured", "calibrated round times (ms) per gamma"
    print(f"[specjax] {head} " + ", ".join(f"{g}: {1e3 * t:.1f}" for g, t in zip(config.gammas, gen.round_time_s)),
          file=sys.stderr)
    return source


def generate_main(c) -> dict:
    import jax

    from specjax import build

    t0 = time.perf_counter()
    gen = build.load_generator(c)
    tok = gen.tokenizer
    load_s = time.perf_counter() - t0
    # Prompts padded to a multiple of 64; target-only and speculative runs share one capacity,
    # so both attend over the same number of cache slots.
    prompt_ids = gen.encode(c.prompt, system=c.system)
    batch = gen.batch([prompt_ids], jax.random.key(c.seed))
    samp = build.sampling_config(c)
    config = gen.config

    print(f"[specjax] target {c.target} ({gen.engine.target.config.num_layers} layers), drafter {c.drafter}, "
          f"gamma {_describe(config.gamma)}, temperature {c.temperature}; prompt {len(prompt_ids)} tokens; "
          f"loaded in {load_s:.1f}s", file=sys.stderr)
    print(f"\n>>> {c.prompt}\n", flush=True)
    decoder = tok.incremental_decoder(skip_special_tokens=True)

    def show(ids):
        piece = decoder.add(ids)
        if piece:
            print(piece, end="", flush=True)

    # The prompt enters the caches once; calibration, the speculative run and the target-only
    # run all start from this prefill (issue 18: a long prompt was prefilled three times).
    t1 = time.perf_counter()
    pre = gen.prefill(batch)
    jax.block_until_ready((pre.target_cache, pre.draft_state))
    prefill_s = time.perf_counter() - t1
    calibration = _round_times(c, gen, batch, samp, pre) if config.adaptive else "none"
    tokens, timing, out = stream_tokens(gen, batch, samp, show, prefill=pre)
    spec_tps, spec_first_s = timing["tokens_per_s"], prefill_s + timing["ttft_s"]
    print(decoder.finish(), flush=True)
    m = jax.device_get(out.metrics)
    rounds = int(np.asarray(m.rounds_B)[0])
    stats = {
        "target": c.target, "drafter": c.drafter, "gamma": str(config.gamma), "tree": c.get("tree", ""), "temperature": c.temperature,
        "new_tokens": len(tokens), "tokens_per_s": spec_tps, "ttft_s_incl_compile": spec_first_s,
        "prefill_s_incl_compile": prefill_s,
        "inter_token_s": timing["inter_token_s"],
        "target_passes": rounds, "mean_accepted_tokens": len(tokens) / max(rounds, 1),
        "proposed": int(m.proposed_B[0]), "accepted": int(m.accepted_B[0]),
        "degenerate_residuals": int(m.degenerate_residual_B[0]),
        "status": out.statuses()[0],
        "tokens_scored_per_pass": int(m.scored_B[0]) / max(rounds, 1),
        "acceptance_per_depth": [float(x) / max(int(t), 1) for x, t in zip(m.accepted_at_BG[0], m.tested_at_BG[0])],
        "calibration": calibration,
    }
    stats["proposal_rounds"] = {_describe(g): int(n) for g, n in zip(config.gammas, np.asarray(m.gamma_rounds_K))}
    print(f"[specjax] drafter {c.drafter}" + (f" ({c.draft_model})" if c.get("draft_model", "") else "")
          + ": " + _why(config, stats, m, gen.round_time_s), file=sys.stderr, flush=True)
    if c.compare_target_only and c.drafter != "none":
        base_tokens, base_timing, _ = stream_tokens(gen.target_only(), batch, samp, prefill=pre)
        base_tps = base_timing["tokens_per_s"]
        stats["target_only_tokens_per_s"] = base_tps
        stats["speedup"] = spec_tps / base_tps
        if c.temperature == 0:
            stats["same_tokens_as_target_only"] = base_tokens == tokens
    line = (f"[specjax] {stats['new_tokens']} tokens, {spec_tps:.1f} tokens/s"
            + (f", speedup {stats['speedup']:.2f}x over target-only ({stats['target_only_tokens_per_s']:.1f} tokens/s)"
               if "speedup" in stats else "")
            + f", mean accepted tokens {stats['mean_accepted_tokens']:.2f} per target pass"
            + f" (time to first token incl. compile {spec_first_s:.1f}s)")
    print(line, flush=True)
    if c.metrics_jsonl:
        with open(c.metrics_jsonl, "a") as f:
            f.write(json.dumps(stats) + "\n")
    return stats


def main(c) -> dict:
    """The main command on a config: XLA options, the settings checked (before anything heavy),
    optional multi-host start, caches, generation."""
    from specjax import build
    build.tune_xla_cpu()                  # before any backend starts
    build.check_config(c)                 # settings, and a local target's context length
    if c.get("distributed", False):
        import jax
        jax.distributed.initialize()
    build.enable_compilation_cache(c.get("compilation_cache_dir", ""))
    build.limit_heap_retention()
    return generate_main(c)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are a user's mistake (a bad setting, a missing or broken file, a
    prompt too long for the cache): shown as one line, not a traceback."""
    from specjax import models
    from specjax.models.registry import ModelFetchError
    return (ValueError, FileNotFoundError, models.CheckpointError, models.CacheCapacityError, ModelFetchError)


def _quiet_backend_probe() -> None:
    """JAX logs at INFO that it could not start a TPU backend on a machine without one; absl's
    handler shows INFO, so on CPU every run starts with that line. Raise only that logger's
    level (one module's logger, nothing else changes)."""
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def run():
    """Console entry point. The --config and --verbose flags are defined here, not at import,
    so the CLI module can be imported next to other absl programs (experiments, tests). A user
    error prints one line (``specjax: error: ...``) and exits with status 2; --verbose adds
    the traceback."""
    from absl import flags
    flag = config_flags.DEFINE_config_file("config", None, "path to a configs/*.py file", lock_config=True)
    verbose = flags.DEFINE_boolean("verbose", False, "print the full traceback of an error")

    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        if flag.value is None:
            raise app.UsageError("--config is required, e.g. --config=configs/generate.py")
        _quiet_backend_probe()
        try:
            main(flag.value)
        except user_errors() as e:
            if verbose.value:
                traceback.print_exc()
            text = " ".join(str(e).split()) or type(e).__name__
            hint = "" if verbose.value else " (--verbose for the traceback)"
            print(f"specjax: error: {text}{hint}", file=sys.stderr, flush=True)
            sys.exit(2)

    app.run(_main)


if __name__ == "__main__":
    run()
