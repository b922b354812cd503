"""Round times at one batch size for one load-study mode, each adaptive candidate in turn (the
calibration the study runs before serving; per draft source for the hybrid), as one JSON line:

    python -m experiments.load_study.calibrate 16 ["load-aware hybrid, row budgets"]

The study's own settings (experiments/load_study/config.py: prompts, capacity, repeats).
"""
import json
import sys


USAGE = "usage: python -m experiments.load_study.calibrate BATCH_SIZE [MODE]"


def parse(argv) -> tuple[int, str]:
    """(batch size, mode) from the command line; SystemExit with one line naming what is wrong,
    before anything loads."""
    from experiments.load_study import config as config_lib
    if len(argv) not in (2, 3) or not argv[1].isdigit() or int(argv[1]) < 1:
        raise SystemExit(f"{USAGE} (BATCH_SIZE a positive integer; got {argv[1:]})")
    mode = argv[2] if len(argv) == 3 else "load-aware hybrid, row budgets"
    adaptive = [m for m, spec in config_lib.MODES.items() if spec[2]]
    if mode not in adaptive:
        raise SystemExit(f"mode {mode!r}: expected one of the adaptive modes {adaptive}")
    return int(argv[1]), mode


def main(argv):
    size, mode = parse(argv)
    from specjax import build
    build.tune_xla_cpu()
    import jax

    from experiments.lib import toolkit
    from experiments.load_study import run as study
    from specjax import sampling
    prov = toolkit.provenance("experiments.load_study.calibrate")
    c = toolkit.load_config("experiments/load_study/config.py", "")
    gc, target, params, eos_ids, prompts, _, _ = study._setup(c, max(c.num_requests))
    engine, eparams = study._engine(c, gc, target, params, eos_ids, mode)
    pad = 64
    capacity = -(-max(engine.config.slots_needed(len(p)) for p in prompts) // pad) * pad
    times = study.round_times_per_size(engine, eparams, sampling.SamplingConfig.make(temperature=float(c.temperature)),
                                       prompts, (size,), capacity, jax.random.key(c.seed), pad,
                                       int(c.calibration_repeats))[size]
    print(json.dumps({"size": size, "mode": mode, "candidates": [str(g) for g in engine.config.gammas],
                      "round_ms": [round(1e3 * t, 1) for t in times], "provenance": prov}))


if __name__ == "__main__":
    main(sys.argv)
