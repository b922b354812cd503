"""The `specjax` command: ``specjax <command> --config=FILE [--config.KEY=VALUE ...]``.

    specjax generate --config=configs/generate.py --config.prompt="..."
    specjax bench    --config=configs/bench.py                 # drafters x Spec-Bench categories
    specjax distill  --config=configs/distill.py --workdir=DIR  # run or resume a distillation
    specjax eval     --config=configs/eval.py                  # teacher-forced alpha of a draft
    specjax export   --config=configs/export.py --config.out=DIR

``python -m specjax.cli`` is the same program. `generate` streams the text as rounds commit,
then prints one line of stats: tokens/s, speedup over target-only decoding of the same prompt
(timed in the same run), mean accepted tokens per target pass; compilation is excluded from
tokens/s (the first round of each run is the warm-up) and reported separately. Every flag and
config key is checked before anything loads: an unknown one is an error that lists the allowed
ones; a bad value is an error naming the key and what it accepts (`specjax.build.check_config`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import sys
import time
import traceback

import numpy as np

from ml_collections import config_flags

def stream_tokens(gen, batch, samp, on_tokens=None, prefill=None):
    """Stream row 0 of one generation; returns (tokens, timing summary, GenerateOutput). Under
    adaptive gamma every candidate's round compiles before the first token (its time counts in
    the time to the first token, not in tokens/s)."""
    from specjax import decoding
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


def calibration_fields(c, batch, config) -> dict:
    """The settings of a run that change adaptive gamma's round times: with the machine, the key
    of its calibration in the cache (`specjax.calibration.setting_key`)."""
    import os

    import specjax
    from specjax import build
    from specjax.settings import generate_settings
    c = generate_settings(c)
    return {"specjax": specjax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "target": c.target, "dtype": c.dtype, "scan_layers": bool(c.scan_layers),
            "fuse_projections": bool(c.fuse_projections), "cpu_kernel": build.use_cpu_kernel(c),
            "drafter": c.drafter, "draft_model": c.draft_model, "early_exit_layers": int(c.early_exit_layers),
            "max_ngram": int(c.max_ngram), "gammas": [str(g) for g in config.gammas],
            **({"hybrid_model": c.hybrid_model, "min_match": int(c.min_match or 0),
                "min_ngram": int(c.min_ngram)} if c.drafter == "hybrid" else {}),
            "prompt_shape": list(batch.prompt_BP.shape), "capacity": int(batch.capacity),
            "greedy": c.temperature == 0, "top_k": int(c.top_k), "top_p": float(c.top_p),
            "verifier": c.verifier, "tree": c.tree, "adaptive_trees": list(c.adaptive_trees),
            "tree_verifier": c.tree_verifier, "tree_children": c.tree_children}


def _round_times(c, gen, batch, samp, pre) -> str:
    """Set adaptive gamma's round times on `gen`: from the calibration cache
    (``calibration_cache``) when it holds this machine and setting and ``recalibrate`` is off,
    else measured (`Generator.calibrate`) and stored. Returns 'cached' or 'measured'."""
    from specjax import calibration
    config = gen.config
    cache = calibration.CalibrationCache(c.get("calibration_cache", ""))
    fields = calibration_fields(c, batch, config)
    key = calibration.setting_key(**fields)
    # Several processes measure together (and take process 0's times, `Generator.calibrate`):
    # reading a per-host cache could send them down different paths.
    import jax
    multi = jax.process_count() > 1
    cached = None if c.get("recalibrate", False) or multi else cache.get(key)
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


def generate_main(c, settings=None) -> dict:
    """The main command's run on config ``c`` (its own keys: prompt, system, seed, ...) with the
    generation settings typed from it (`specjax.settings.GenerateSettings`; ``settings`` if the
    caller typed them already)."""
    import jax

    from specjax import build
    from specjax.settings import generate_settings

    cmd, c = c, (settings if settings is not None else generate_settings(c))
    t0 = time.perf_counter()
    gen = build.load_generator(c)
    tok = gen.tokenizer
    load_s = time.perf_counter() - t0
    # Prompts padded to a multiple of 64; target-only and speculative runs share one capacity,
    # so both attend over the same number of cache slots.
    prompt_ids = gen.encode(cmd.prompt, system=cmd.system)
    batch = gen.batch([prompt_ids], jax.random.key(cmd.seed))
    samp = build.sampling_config(c)
    config = gen.config

    print(f"[specjax] target {c.target} ({gen.engine.target.config.num_layers} layers), drafter {c.drafter}, "
          f"gamma {_describe(config.gamma)}, temperature {c.temperature}; prompt {len(prompt_ids)} tokens; "
          f"loaded in {load_s:.1f}s", file=sys.stderr)
    print(f"\n>>> {cmd.prompt}\n", flush=True)
    decoder = tok.incremental_decoder(skip_special_tokens=True)

    round_sizes = []                        # tokens committed per round (the hybrid's replay)

    def show(ids):
        round_sizes.append(len(ids))
        piece = decoder.add(ids)
        if piece:
            print(piece, end="", flush=True)

    # The prompt enters the caches once; calibration, the speculative run and the target-only
    # run all start from this prefill (issue 18: a long prompt was prefilled three times).
    t1 = time.perf_counter()
    pre = gen.prefill(batch)
    jax.block_until_ready((pre.target_cache, pre.draft_state))
    prefill_s = time.perf_counter() - t1
    calibration = _round_times(cmd, gen, batch, samp, pre) if config.adaptive else "none"
    tokens, timing, out = stream_tokens(gen, batch, samp, show, prefill=pre)
    spec_tps, spec_first_s = timing["tokens_per_s"], prefill_s + timing["ttft_s"]
    print(decoder.finish(), flush=True)
    m = jax.device_get(out.metrics)
    rounds = int(np.asarray(m.rounds_B)[0])
    stats = {
        "target": c.target, "drafter": c.drafter, "gamma": str(config.gamma), "tree": c.tree, "temperature": c.temperature,
        "new_tokens": len(tokens), "tokens_per_s": spec_tps, "ttft_s_incl_compile": spec_first_s,
        "prefill_s_incl_compile": prefill_s,
        "inter_token_s": timing["inter_token_s"],
        "target_passes": rounds, "mean_accepted_tokens": len(tokens) / max(rounds, 1),
        "proposed": int(m.proposed_B[0]), "accepted": int(m.accepted_B[0]),
        "degenerate_residuals": int(m.degenerate_residual_B[0]),
        "invalid_draft_rounds": int(m.invalid_draft_rounds_B[0]),
        "status": out.statuses()[0],
        "tokens_scored_per_pass": int(m.scored_B[0]) / max(rounds, 1),
        "acceptance_per_depth": [float(x) / max(int(t), 1) for x, t in zip(m.accepted_at_BG[0], m.tested_at_BG[0])],
        "calibration": calibration,
        "mesh": dict(gen.engine.mesh.shape) if gen.engine.mesh is not None else None,
    }
    stats["proposal_rounds"] = {_describe(g): int(n) for g, n in zip(config.gammas, np.asarray(m.gamma_rounds_Z))}
    why = _why(config, stats, m, gen.round_time_s, out.policy, _regime_names(gen.engine))
    if c.drafter == "hybrid":
        dr = gen.engine.drafter
        lookup = dr.lookup_rounds(list(prompt_ids) + tokens, len(prompt_ids), round_sizes)
        stats["lookup_rounds"] = sum(lookup)
        why += (f"; prompt lookup drafts where the last {dr.min_match} tokens occurred earlier (they did at the "
                f"start of {sum(lookup)} of {len(lookup)} rounds), the {c.hybrid_model} elsewhere")
    print(f"[specjax] drafter {c.drafter}" + (f" ({c.draft_model})" if c.draft_model else "")
          + ": " + why, file=sys.stderr, flush=True)
    if stats["invalid_draft_rounds"]:
        print(f"[specjax] warning: in {stats['invalid_draft_rounds']} of {rounds} rounds the drafter's q was not a "
              f"distribution over the vocabulary (NaN, negative, or not summing to 1): those proposals were "
              f"discarded and the target sampled alone (exact, but no speedup); the draft is broken",
              file=sys.stderr, flush=True)
    stopped = row_status_line(0, stats["status"], len(tokens))      # the one row of the prompt
    if stats["status"] == "nan_logits" and not tokens:
        _write_stats(cmd, stats)
        raise GenerationFailed(f"no output: {stopped}; check the target's weights and dtype (nothing to time or "
                               f"compare)")
    if stopped:
        print(f"[specjax] warning: {stopped}", file=sys.stderr, flush=True)
    if cmd.compare_target_only and c.drafter != "none":
        base_tokens, base_timing, _ = stream_tokens(gen.target_only(), batch, samp, prefill=pre)
        base_tps = base_timing["tokens_per_s"]
        stats["target_only_tokens_per_s"] = base_tps
        stats["speedup"] = spec_tps / base_tps
        if c.temperature == 0:
            stats["same_tokens_as_target_only"] = base_tokens == tokens
    line = (f"[specjax] {stats['new_tokens']} tokens, {_rate(spec_tps)}"
            + (f", speedup {stats['speedup']:.2f}x over target-only ({_rate(stats['target_only_tokens_per_s'])})"
               if "speedup" in stats and np.isfinite(stats["speedup"]) else "")
            + f", mean accepted tokens {stats['mean_accepted_tokens']:.2f} per target pass"
            + f" (time to first token incl. compile {spec_first_s:.1f}s)")
    print(line, flush=True)
    _write_stats(cmd, stats)
    return stats


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


def _rate(tokens_per_s) -> str:
    """``<rate> tokens/s`` with one decimal, or ``tokens/s n/a`` when there is no rate (fewer than two
    rounds with tokens)."""
    x = float(tokens_per_s) if tokens_per_s is not None else float("nan")
    return f"{x:.1f} tokens/s" if np.isfinite(x) else "tokens/s n/a (too few tokens to time)"


def _write_stats(cmd, stats: dict) -> None:
    from specjax import distributed
    if cmd.metrics_jsonl and distributed.is_primary():
        import pathlib
        with open(pathlib.Path(cmd.metrics_jsonl).expanduser(), "a") as f:
            f.write(json.dumps(stats) + "\n")


def check_output_file(setting: str, path: str) -> None:
    """A file a command will write at its end (``metrics_jsonl``) can be: its directory exists
    and is writable and the path is not a directory. Checked before the model loads, so a typo
    fails at once, not after the whole run; a ValueError naming the setting. "" is off."""
    import os
    import pathlib
    if not path:
        return
    p = pathlib.Path(path).expanduser()
    parent = p.parent
    from specjax import files
    unusable = files.path_problem(p)          # a symlink loop, a file on the way
    if unusable:
        problem = unusable
    elif p.is_dir():
        problem = f"{p} is a directory"
    elif not parent.is_dir():
        problem = f"its directory {parent} does not exist" if not parent.exists() else f"{parent} is not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        problem = f"{p if p.exists() else parent} is not writable"
    else:
        return
    raise ValueError(f"{setting}={path!r}: {problem}; nothing was run")


def _nearest_existing(p):
    """`p` or its nearest ancestor that exists (the directory a mkdir of `p` would write into)."""
    import os
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _dir_problem(path: str) -> str | None:
    """What stops a command from creating (if absent) and writing into the directory `path`:
    a symlink loop, a file on the way, or a nearest existing directory that is not writable
    (a read-only file system, no permission); None when nothing does."""
    import os
    import pathlib
    p = pathlib.Path(path).expanduser()
    from specjax import files
    problem = files.path_problem(p)
    if problem is None:
        base = _nearest_existing(p)
        if not base.is_dir():
            problem = f"{base} is a file, not a directory"
        elif not os.access(base, os.W_OK | os.X_OK):
            problem = f"{base} is not writable (read-only file system or no permission)"
    return problem


def check_output_dir(setting: str, path: str) -> None:
    """A directory a command creates and writes into (``bench --config.out``), checked before
    anything loads (`_dir_problem`): ValueError naming the setting."""
    if not str(path).strip():
        raise ValueError(f"{setting}={path!r}: empty; name the directory to write into")
    problem = _dir_problem(path)
    if problem:
        raise ValueError(f"{setting}={path!r}: {problem}; nothing was run")


def check_workdir(path) -> None:
    """``--workdir`` of distill and data, before anything runs: not empty or blank (an empty
    value would mean the current directory), and a directory it can create and write into
    (`_dir_problem`). UsageError naming the flag."""
    if path is None or not str(path).strip():
        raise UsageError(f"--workdir={'' if path is None else path!r}: empty; name the run directory "
                         f"(an empty value would mean the current directory)")
    problem = _dir_problem(path)
    if problem:
        raise UsageError(f"--workdir={path}: {problem}; nothing was run")


def main(c) -> dict:
    """The main command on a config: XLA options, the settings checked (before anything heavy),
    optional multi-host start, caches, generation."""
    from specjax import build, decoding
    build.tune_xla_cpu()                  # before any backend starts
    decoding.check_text(c.get("prompt", ""), "prompt")     # bytes that are not UTF-8, before anything loads
    decoding.check_text(c.get("system", ""), "system")
    from specjax.settings import generate_settings
    settings = generate_settings(c)       # the generation settings, typed once
    build.check_config(settings)          # their values, and a local target's context length
    build.check_seed(c.get("seed", 0))
    check_output_file("metrics_jsonl", c.get("metrics_jsonl", ""))
    if c.get("distributed", False):
        from specjax import distributed
        distributed.initialize()
    build.enable_compilation_cache(c.get("compilation_cache_dir", ""))
    build.limit_heap_retention()
    return generate_main(c, settings)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are a user's mistake (a bad setting, a missing or broken file, a
    prompt too long for the cache): shown as one line, not a traceback."""
    from specjax import files, models
    from specjax.models.export import ExportError
    from specjax.models.registry import ModelFetchError
    # OSError: a full disk (ENOSPC), a file size limit (EFBIG), a read-only file system (EROFS),
    # a path that is a file or a symlink loop: one line naming the path (`error_line`).
    return (ValueError, OSError, models.CheckpointError, models.CacheCapacityError, ModelFetchError,
            ExportError, files.WorkdirBusy)


# OS errors of a write that a later run of the same command gets past once the cause is fixed
# (distill and data keep what they finished: checkpoints, shards).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EIO)


def error_line(e: BaseException) -> str:
    """The one line of a user error: its message on one line; an OS error as ``PATH: errno
    text`` (``[Errno 28] No space left on device: 'x'`` reads as ``x: No space left on device
    (ENOSPC)``), the second path of a rename or link after an arrow."""
    if isinstance(e, OSError) and e.strerror and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror} ({name})" if paths else f"{e.strerror} ({name})"
    return " ".join(str(e).split()) or type(e).__name__


def _quiet_backend_probe() -> None:
    """JAX logs at INFO that it could not start a TPU backend on a machine without one; absl's
    handler shows INFO, so on CPU every run starts with that line. Raise only that logger's
    level (one module's logger, nothing else changes)."""
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


# ----------------------------------------------------------------------------- subcommands

def bench_main(c, command: str = "specjax bench") -> list[dict]:
    """`specjax bench`: drafters against target-only decoding per category (`specjax.bench`)."""
    from specjax import bench, build
    build.check_seed(c.get("seed", 0))
    check_output_dir("out", c.out)        # a file or a symlink loop: before any model loads
    build.enable_compilation_cache(c.get("compilation_cache_dir", ""))
    build.limit_heap_retention()
    summary = bench.run(c, command=command)
    for r in summary:
        if r["category"] == "all":
            print(f"[specjax] {r['method']}: {r['tokens_per_s'] or float('nan'):.1f} tokens/s, speedup "
                  f"{r['speedup'] or float('nan'):.2f}x over target-only, mean accepted tokens "
                  f"{r['mean_accepted_tokens']:.2f} per target pass", flush=True)
    print(f"[specjax] table: {c.out}/results.md, records: {c.out}/results.jsonl", flush=True)
    return summary


def distill_main(c, workdir: str) -> dict:
    """`specjax distill`: run or resume (same command) a distillation in `workdir`."""
    from specjax.distill import train
    return train(c, workdir)


def data_main(c, workdir: str) -> dict:
    """`specjax data`: run or resume (same command) the data engine in `workdir`."""
    from specjax import build, distill
    build.check_seed(c.get("seed", 0))
    config = distill.data_config(c)          # the typed settings, checked before anything loads
    from specjax.settings import generate_settings
    g = generate_settings(c.generate)        # the generator's settings, typed once
    build.check_config(g)
    build.limit_heap_retention()             # batches of other capacities reuse no retained heap
    generator = build.load_generator(g)
    report = distill.generate_data(config, generator, workdir)
    print(f"[specjax] data in {workdir}: " + ", ".join(
        f"{k} {v.get('sequences', 0)} seqs / {v.get('loss_tokens', 0)} loss tokens" for k, v in report["stages"].items()),
        flush=True)
    return report


EVAL_DRAFTERS = ("distilled", "model", "early_exit")


def eval_main(c) -> dict:
    """`specjax eval`: teacher-forced alpha, greedy agreement and greedy tokens per target pass
    of a draft against its target (`specjax.distill.evaluate`; no wall-clock). Prints one JSON
    line; appends it to ``out`` when set."""
    from specjax import build, distill, models
    if c.drafter not in EVAL_DRAFTERS:
        raise ValueError(f"drafter={c.drafter!r}: expected one of {', '.join(EVAL_DRAFTERS)} (prompt lookup has no "
                         "draft distribution to score; heads are evaluated by their training, metrics.jsonl)")
    gammas = tuple(c.gammas)
    for g in gammas:
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"gammas={gammas!r}: expected integers >= 1")
    if c.drafter == "model" and not c.draft_model:
        raise ValueError("drafter='model' needs draft_model (a path or registry name)")
    check_output_file("out", c.out)      # a directory, or a missing directory: before the evaluation runs
    s = distill.distill_settings(c, extra="ignore")      # the target, data and eval keys, typed before loading
    build.check_seed(s.seed)
    target, params = build.load_target(s.target, s.dtype, True)
    tokenizer = None if s.eval.data_jsonl else models.load_tokenizer(s.target)
    if c.drafter == "early_exit" and not 1 <= int(c.early_exit_layers) <= target.config.num_layers:
        raise ValueError(f"early_exit_layers={c.early_exit_layers}: expected 1..{target.config.num_layers}")
    # The draft as the engine would run it (`build.make_drafter`: loading, vocab check); scored
    # teacher-forced, the early exit is the same model with its own cache.
    drafter, dparams = build.make_drafter("early_exit_own_cache" if c.drafter == "early_exit" else c.drafter,
                                          target, params, early_exit_layers=int(c.early_exit_layers),
                                          draft_model=c.draft_model, dtype=c.dtype, target_name=c.target)
    draft = drafter.model
    plan = distill.eval_plan(s, target, params, tokenizer, log=lambda m: print(f"[specjax] {m}", file=sys.stderr))
    result = distill.evaluate(draft, dparams, distill.teacher_head(target, params, None), plan, gammas)
    result = {"target": c.target, "drafter": c.drafter, "draft_model": c.draft_model,
              "data": s.eval.data_jsonl or f"held-out Spec-Bench, {s.eval.per_category} per category",
              **result}
    line = json.dumps(result)
    print(line, flush=True)
    if c.out:
        with open(c.out, "a") as f:
            f.write(line + "\n")
    return result


EXPORT_KINDS = ("model", "draft")
# The dtypes `export` writes: those specjax loads again (`models.config.SUPPORTED_DTYPES`); not
# float16 (the model config refuses it, and weights past 65504 would become inf).
EXPORT_DTYPES = ("float32", "bfloat16")


def export_main(c):
    """`specjax export`: a model or a draft as a Hugging Face checkpoint directory, written into
    a temporary directory beside ``out`` and renamed into place at the end (a failure, such as a
    full disk, leaves ``out`` as it was: `models.export.write_directory`)."""
    import pathlib

    from specjax import build, models
    from specjax.models.export import write_directory
    if c.what not in EXPORT_KINDS:
        raise ValueError(f"what={c.what!r}: expected one of {', '.join(EXPORT_KINDS)}")
    if c.dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={c.dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if not c.out:
        raise ValueError("out='': name the directory to write the checkpoint into")
    out = pathlib.Path(c.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out={c.out!r} exists and is not an empty directory; nothing was written")
    if c.what == "model":
        if not c.source:
            raise ValueError("source='': name the model to export (registry name, GGUF file or HF directory)")
        model, params, tokenizer = models.load_with_tokenizer(c.source, dtype="float32")

        def write(d):
            models.export_hf(model, params, d, dtype=c.dtype)
            if tokenizer is not None:
                tokenizer.save(d)
    else:
        from specjax.models.draft_artifact import export_draft_hf
        target, params = build.load_target(c.target, "float32", True)

        def write(d):
            export_draft_hf(c.source or build.shipped_draft(c.target), target, params, d, dtype=c.dtype)
    write_directory(out, write)
    print(f"[specjax] wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})", flush=True)
    return out


def aot_main(c) -> list[dict]:
    """`specjax aot`: its config and the generation profile it names, typed once here."""
    import pathlib
    from specjax import aot
    if not pathlib.Path(str(c.profile)).expanduser().is_file():
        raise ValueError(f"config.profile: {c.profile!r} is not a file (a configs/generate_*.py profile)")
    profile = _load_config_file(str(c.profile))
    return aot.main(aot.aot_settings(c, profile))


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: what it does, the config file that shows its keys, extra flags."""
    name: str
    summary: str
    config: str
    workdir: bool = False


COMMANDS = {c.name: c for c in (
    Command("generate", "speculative generation on one chat prompt: the text streamed, then one line of stats "
            "(tokens/s, speedup over target-only, mean accepted tokens)", "configs/generate.py"),
    Command("bench", "drafters against target-only decoding over a prompt set (default: held-out Spec-Bench), "
            "per category: speedup, mean accepted tokens, acceptance per position (Markdown + JSONL)",
            "configs/bench.py"),
    Command("distill", "train a draft (DistillSpec) or a feature head into --workdir; the same command resumes",
            "configs/distill.py", workdir=True),
    Command("data", "the data engine: prompts the target writes itself (Magpie), cleaned, and its greedy and "
            "sampled answers, as resumable sha256'd shards in --workdir; the same command resumes",
            "configs/data.py", workdir=True),
    Command("eval", "teacher-forced alpha, greedy agreement and tokens per target pass of a draft/target pair "
            "(no wall-clock)", "configs/eval.py"),
    Command("export", "a model or a draft as a Hugging Face checkpoint directory", "configs/export.py"),
    Command("aot", "compile every program (prefill, decode, verification, speculative rounds, training steps) "
            "for a TPU topology without a TPU: memory, bytes per call against the ideal, HLO lint (JSON lines)",
            "configs/aot.py"),
)}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: specjax <command> --config=FILE [--config.KEY=VALUE ...] [--verbose]", "",
             "commands:"]
    lines += [f"  {c.name:<{width}}  {c.summary} (e.g. --config={c.config})" for c in COMMANDS.values()]
    lines += ["", "specjax <command> --help lists that command's config keys. --config.KEY=VALUE overrides one key "
              "(nested keys with dots: --config.eval.per_category=2); --verbose prints tracebacks of errors.",
              "distill and data also take --workdir=DIR."]
    return "\n".join(lines)


class UsageError(ValueError):
    """A bad command line: unknown command, flag or config key, missing --config."""


def _load_config_file(path: str):
    """``get_config()`` of a config file. A file in a ``configs`` package directory may import
    its siblings (``from configs import generate``): that directory's parent goes on sys.path."""
    import importlib.util
    import pathlib
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"--config={path}: no such file")
    if p.parent.name == "configs" and (p.parent / "__init__.py").is_file():
        root = str(p.resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_specjax_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:            # a broken config file: one line naming it, not a traceback
        raise UsageError(f"--config={path}: the file does not run ({type(e).__name__}: {e})") from e
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config={path}: the file defines no get_config()")
    try:
        return module.get_config()
    except Exception as e:
        raise UsageError(f"--config={path}: get_config() failed ({type(e).__name__}: {e})") from e


def _keys(c, prefix="") -> list[str]:
    out = []
    for k, v in c.items():
        out.append(prefix + k)
        if hasattr(v, "items"):
            out += _keys(v, prefix + k + ".")
    return out


def check_command_line(cmd: Command, args: list[str]) -> None:
    """Every flag and ``--config.KEY`` of a command line is known, before any parsing or loading:
    a UsageError names the unknown one and lists what is allowed."""
    import difflib
    known = {"config", "verbose", "noverbose"} | ({"workdir"} if cmd.workdir else set())
    config_path, overrides = None, []
    for i, a in enumerate(args):
        if not a.startswith("-") or a == "-":
            continue
        name = a.lstrip("-").split("=", 1)[0]
        if name == "config":
            config_path = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
        elif name.startswith("config."):
            overrides.append(name[len("config."):])
        elif name not in known:
            allowed = ", ".join(f"--{k}" for k in sorted(known - {"noverbose"})) + ", --config.KEY=VALUE"
            raise UsageError(f"specjax {cmd.name}: unknown flag --{name}; expected {allowed}")
    if config_path is None:
        raise UsageError(f"specjax {cmd.name}: --config is required, e.g. --config={cmd.config}")
    if cmd.workdir and not any(a.lstrip("-").split("=", 1)[0] == "workdir" for a in args if a.startswith("-")):
        raise UsageError(f"specjax {cmd.name}: --workdir is required (checkpoints, metrics.jsonl, final.json)")
    c = _load_config_file(config_path)
    keys = _keys(c)
    for key in overrides:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"specjax {cmd.name}: unknown config key {key!r} in {config_path}{hint}; its keys: "
                             + ", ".join(keys))


def _expected(args: list[str], error: Exception) -> str:
    """For a ``--config.KEY=VALUE`` that did not parse: the type and default the key has."""
    import re
    m = re.search(r"--config\.([\w.]+)=", str(error))
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if m is None or path is None:
        return ""
    value = _load_config_file(path)
    for part in m.group(1).split("."):
        if not hasattr(value, "items") or part not in value:
            return ""
        value = value[part]
    return f" (expected type {type(value).__name__}, e.g. the default {value!r})"


def describe_config(cmd: Command, path: str) -> str:
    """`specjax <command> --help`: the command, then each key of its config with its default."""
    c = _load_config_file(path)
    flat = []

    def walk(d, prefix=""):
        for k, v in d.items():
            if hasattr(v, "items"):
                walk(v, prefix + k + ".")
            else:
                flat.append(f"  --config.{prefix}{k}={v!r}")
    walk(c)
    extra = "  --workdir=DIR  (required) checkpoints, metrics.jsonl, final.json\n" if cmd.workdir else ""
    return (f"usage: specjax {cmd.name} --config={path} [--config.KEY=VALUE ...] [--verbose]\n\n{cmd.summary}.\n\n"
            f"{extra}config keys (defaults from {path}):\n" + "\n".join(flat))


def dispatch(argv: list[str]) -> int:
    """Run ``specjax <command> ...`` (argv[0] is the program). Returns the exit status: 0, or 2
    for a bad command line or a user error (one line ``specjax: error: ...`` on stderr;
    --verbose adds the traceback)."""
    from absl import flags

    args = list(argv[1:])
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    verbose = any(a in ("--verbose", "--verbose=true", "--verbose=True") for a in rest)
    try:
        if name.startswith("-"):
            raise UsageError(f"name a command before the flags, e.g. specjax generate {' '.join(args)} "
                             f"(commands: {', '.join(COMMANDS)})")
        if name not in COMMANDS:
            raise UsageError(f"unknown command {name!r}: expected one of {', '.join(COMMANDS)} (specjax --help)")
        cmd = COMMANDS[name]
        if any(a in ("-h", "--help", "--helpfull", "--helpshort") for a in rest):
            path = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), cmd.config)
            print(describe_config(cmd, path))
            return 0
        check_command_line(cmd, rest)
        fv = flags.FlagValues()       # this call's own flags: dispatch can run twice in one process
        argv_ = [f"specjax {name}", *rest]
        config = config_flags.DEFINE_config_file("config", None, "a configs/*.py file", flag_values=fv,
                                                 lock_config=True, sys_argv=argv_)
        flags.DEFINE_boolean("verbose", False, "print the full traceback of an error", flag_values=fv)
        workdir = flags.DEFINE_string("workdir", None, "run directory", flag_values=fv) if cmd.workdir else None
        try:
            extra = fv(argv_)[1:]
        except flags.Error as e:
            raise UsageError(f"specjax {name}: {e}{_expected(rest, e)}") from None
        if extra:
            raise UsageError(f"specjax {name}: unexpected arguments {extra}")
        if cmd.workdir:
            check_workdir(workdir.value)
        _quiet_backend_probe()
        from specjax import distributed
        distributed.platforms_without_tpu()
        from specjax import build
        build.tune_xla_cpu()                  # before any backend starts
        c = config.value
        build.strict_precision(bool(c.get("strict_precision", False)))   # before any backend starts
        if c.get("distributed", False):       # multi-host: every process runs the command; see launch/
            from specjax import distributed
            distributed.initialize()
        if name == "generate":
            main(c)
        elif name == "bench":
            bench_main(c, " ".join(["specjax", name, *rest]))
        elif name == "distill":
            distill_main(c, workdir.value)
        elif name == "data":
            data_main(c, workdir.value)
        elif name == "eval":
            eval_main(c)
        elif name == "aot":
            aot_main(c)
        else:
            export_main(c)
    except GenerationFailed as e:
        if verbose:
            traceback.print_exc()
        print(f"specjax: error: {error_line(e)}", file=sys.stderr, flush=True)
        return 1
    except user_errors() as e:
        if verbose:
            traceback.print_exc()
        text = error_line(e)
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS and name in ("distill", "data"):
            text += "; what was finished is kept: the same command resumes once this is fixed"
        hint = "" if verbose or isinstance(e, UsageError) else " (--verbose for the traceback)"
        print(f"specjax: error: {text}{hint}", file=sys.stderr, flush=True)
        return 2
    return 0


def run(argv: list[str] | None = None):
    """Console entry point (``specjax``, ``python -m specjax.cli``): `dispatch`, then exit with its status."""
    sys.exit(dispatch(sys.argv if argv is None else argv))


if __name__ == "__main__":
    run()
