"""Training tokens per second between two steps of a distill run's metrics.jsonl.

    python -m experiments.learning_curve.step_rate <metrics.jsonl> <first step> <last step>

A point's `train_tokens_per_s` divides by the wall time of its run's last part, which counts any
time the process was stopped (a background run paused for timing work); between two steps of one
uninterrupted stretch the rate is the training's own. The last record of each step counts (a
resumed run logs again the steps after its last checkpoint, superseding the earlier records).
"""

from __future__ import annotations

import json
import sys


def step_rate(path: str, first: int, last: int) -> float:
    by_step = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not a JSON record ({e.msg})") from None
            if r.get("kind") == "train" and first <= r["step"] <= last:
                by_step[r["step"]] = r
    if first not in by_step or last not in by_step or last <= first:
        raise ValueError(f"{path}: needs train records at steps {first} and {last} (last > first)")
    a, b = by_step[first], by_step[last]
    if b["elapsed_s"] <= a["elapsed_s"]:
        raise ValueError(f"{path}: steps {first}..{last} are not one run (elapsed time goes back: resumed in between)")
    return (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    try:
        path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        print(f"{path}: steps {first}..{last}: {step_rate(path, first, last):.1f} training tokens/s")
    except (OSError, ValueError) as e:          # a missing or unreadable file, a bad record or step: one line
        sys.exit(f"error: {e}")
