"""Where the test suite's time goes, from a profiled run.

    SPECJAX_TEST_PROFILE=/tmp/prof python -m pytest -q -n 2 --dist loadfile tests
    python -m experiments.suite_time.report /tmp/prof experiments/suite_time/results/<name> <commit>

`tests/conftest.py` writes one JSONL line per test and worker (SPECJAX_TEST_PROFILE): the test's
wall seconds in its worker (setup, call and teardown) and the seconds JAX spent tracing
(`jaxpr_trace_duration`), lowering (`jaxpr_to_mlir_module_duration`) and compiling
(`backend_compile_duration`) in that process; subprocesses a test starts count in its wall time
only. This writes `<out>.jsonl` (one record per test file, with the commit the suite ran at and
the report's provenance),
`<out>.md` (the table) and `<out>.png` (the files that take most, stacked by kind).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys


def per_file(profile_dir: str) -> list[dict]:
    """One record per test file, the longest first: wall, compile, trace (tracing and lowering)
    and the rest (execution, Python, subprocesses), in worker-seconds."""
    acc = collections.defaultdict(lambda: collections.Counter())
    for path in sorted(glob.glob(os.path.join(profile_dir, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                a = acc[r["test"].split("::")[0]]
                a["tests"] += 1
                a["wall_s"] += r["wall_s"]
                a["compile_s"] += r.get("backend_compile_duration", 0.0)
                a["trace_s"] += r.get("jaxpr_trace_duration", 0.0) + r.get("jaxpr_to_mlir_module_duration", 0.0)
    if not acc:
        raise SystemExit(f"no profile records under {profile_dir!r} (run the suite with SPECJAX_TEST_PROFILE set)")
    out = []
    for name, a in acc.items():
        rest = a["wall_s"] - a["compile_s"] - a["trace_s"]
        out.append({"file": name, "tests": a["tests"], **{k: round(a[k], 2) for k in ("wall_s", "compile_s", "trace_s")},
                    "rest_s": round(rest, 2)})
    return sorted(out, key=lambda r: -r["wall_s"])


def render(records: list[dict], top: int = 40) -> str:
    tot = {k: sum(r[k] for r in records) for k in ("tests", "wall_s", "compile_s", "trace_s", "rest_s")}
    lines = [f"{tot['tests']} tests, {tot['wall_s']:.0f} worker-seconds: compiling {tot['compile_s']:.0f}, "
             f"tracing and lowering {tot['trace_s']:.0f}, the rest {tot['rest_s']:.0f}.", "",
             "| file | tests | worker-s | compile | trace | rest |", "|---|---|---|---|---|---|"]
    for r in records[:top]:
        lines.append(f"| {r['file']} | {r['tests']} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | {r['trace_s']:.1f} "
                     f"| {r['rest_s']:.1f} |")
    if len(records) > top:
        rest = records[top:]
        lines.append(f"| {len(rest)} other files | {sum(r['tests'] for r in rest)} | "
                     f"{sum(r['wall_s'] for r in rest):.1f} | | | |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str, top: int = 25) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = records[:top][::-1]
    names = [r["file"].rpartition("/")[2] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1))
    left = [0.0] * len(rows)
    for key, label in (("compile_s", "compile"), ("trace_s", "trace + lower"), ("rest_s", "the rest")):
        vals = [max(r[key], 0.0) for r in rows]
        ax.barh(names, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("worker-seconds")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        raise SystemExit("usage: python -m experiments.suite_time.report PROFILE_DIR OUT_PREFIX SUITE_COMMIT")
    from experiments.lib import toolkit
    records = per_file(argv[1])
    prov = toolkit.provenance("experiments.suite_time.report", with_backend=False)
    os.makedirs(os.path.dirname(os.path.abspath(argv[2])), exist_ok=True)
    with open(argv[2] + ".jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({**r, "suite_commit": argv[3], "provenance": prov}) + "\n")
    with open(argv[2] + ".md", "w") as f:
        f.write(render(records))
    plot(records, argv[2] + ".png")
    print(render(records, top=15))


if __name__ == "__main__":
    main(sys.argv)
