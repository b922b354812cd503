"""Round times at one batch size for one load-study mode, each adaptive candidate in turn (the
calibration the study runs before serving; per draft source for the hybrid), as one JSON line:

    python -m experiments.load_study.calibrate 16 ["load-aware hybrid, row budgets"]

The study's own settings (experiments/load_study/config.py: prompts, capacity, repeats).
"""
import json
import sys


def main(argv):
    from specjax import build
    build.tune_xla_cpu()
    import jax

    from experiments.lib import toolkit
    from experiments.load_study import run as study
    from specjax import sampling
    prov = toolkit.provenance("experiments.load_study.calibrate")
    size = int(argv[1])
    mode = argv[2] if len(argv) > 2 else "load-aware hybrid, row budgets"
    c = toolkit.load_config("experiments/load_study/config.py", "")
    gc, target, params, eos_ids, prompts, _, _ = study._setup(c, max(c.num_requests))
    engine, eparams = study._engine(c, gc, target, params, eos_ids, mode)
    if not engine.config.adaptive:
        raise SystemExit(f"mode {mode!r} has no adaptive candidates to time")
    pad = 64
    capacity = -(-max(engine.config.slots_needed(len(p)) for p in prompts) // pad) * pad
    times = study.round_times_per_size(engine, eparams, sampling.SamplingConfig.make(temperature=float(c.temperature)),
                                       prompts, (size,), capacity, jax.random.key(c.seed), pad,
                                       int(c.calibration_repeats))[size]
    print(json.dumps({"size": size, "mode": mode, "candidates": [str(g) for g in engine.config.gammas],
                      "round_ms": [round(1e3 * t, 1) for t in times], "provenance": prov}))


if __name__ == "__main__":
    main(sys.argv)
