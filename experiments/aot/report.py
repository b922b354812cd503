"""The AOT tables and plot from `specjax aot` rows (experiments/aot/run.sh writes them).

    python -m experiments.aot.report OUT_DIR [BEFORE]     # reads OUT_DIR/rows.jsonl

Writes OUT_DIR/results.md (one table of every row, then the before/after summary: per topology
and target, a decode step's and a k = 8 verification block's HBM bytes over the ideal, the
verification block over the step, the chain and tree rounds, batch 64) and OUT_DIR/plot.png
(bytes over the ideal, old profile (hatched) against new, per topology). The old profiles are
those named ``*_scan`` and, when given, the profile named BEFORE.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

GiB = 2 ** 30


def load(path: pathlib.Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _lint(row) -> str:
    return ", ".join(f"{k} x{v['count']}" for k, v in sorted(row.get("lint", {}).items())) or "clean"


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    out = ["| topology | target | profile | program | batch | fits | memory / HBM (GiB) | HBM bytes / call (GB) | "
           "ideal (GB) | x ideal | predicted (ms) | collectives | lint |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r.get("memory", {})
        if not r.get("fits", True):
            out.append(f"| {r['topology']} | {r['target']} | {r['profile']} | {r['program']} | {r['batch']} | no | "
                       f"{mem.get('argument', 0) / GiB:.1f} args / {mem.get('hbm', 0) / GiB:.0f} | - | - | - | - | - | - |")
            continue
        coll = ", ".join(f"{k} {v['count']}" for k, v in sorted(r.get("collectives", {}).items())) or "none"
        ideal = r.get("ideal_bytes")
        out.append(f"| {r['topology']} | {r['target']} | {r['profile']} | {r['program']} | {r['batch']} | yes | "
                   f"{mem['total'] / GiB:.2f} / {mem['hbm'] / GiB:.0f} | {r['bytes'] / 1e9:.3f} | "
                   f"{_fmt(None if ideal is None else ideal / 1e9, '.3f')} | {_fmt(r.get('bytes_over_ideal'))} | "
                   f"{r['predicted_s'] * 1e3:.3f} | {coll} | {_lint(r)} |")
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per (topology, target, profile): decode b=1, verify k=8 over decode, chain, tree, decode b=64."""
    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["topology"], r["target"], r["profile"])][(r["program"], r["batch"])] = r
    out = ["| topology | target | profile | decode b=1 x ideal | k=8 block / step (bytes) | chain x ideal | "
           "tree x ideal | decode b=64 x ideal | lint (decode b=1, b=64) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (topo, target, profile), progs in by.items():
        def ratio(p, b=1):
            r = progs.get((p, b))
            if r is None:
                return "-"
            if not r.get("fits", True):
                return "does not fit"
            return _fmt(r.get("bytes_over_ideal"))
        step, k8 = progs.get(("decode", 1)), progs.get(("verify_k8", 1))
        k8_over = "-" if not (step and k8 and step.get("fits", True) and k8.get("fits", True)) else \
            f"{k8['bytes'] / step['bytes']:.2f}"
        chain = next((k for k in progs if k[0].startswith("chain") and k[1] == 1), None)
        tree = next((k for k in progs if k[0].startswith("tree") and k[1] == 1), None)
        lints = "; ".join(_lint(progs[k]) if progs[k].get("fits", True) else "-"
                          for k in (("decode", 1), ("decode", 64)) if k in progs)
        out.append(f"| {topo} | {target} | {profile} | {ratio('decode')} | {k8_over} | "
                   f"{ratio(chain[0]) if chain else '-'} | {ratio(tree[0]) if tree else '-'} | "
                   f"{ratio('decode', 64)} | {lints} |")
    return out


def plot(rows: list[dict], path: pathlib.Path, before: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    topologies = list(dict.fromkeys(r["topology"] for r in rows))
    programs = [("decode", 1), ("verify_k8", 1), ("chain", 1), ("tree", 1), ("decode", 64)]
    fig, axes = plt.subplots(1, len(topologies), figsize=(5 * len(topologies), 4), squeeze=False)
    for ax, topo in zip(axes[0], topologies):
        sub = [r for r in rows if r["topology"] == topo and r.get("fits", True) and r.get("bytes_over_ideal")]
        targets = list(dict.fromkeys(r["target"] for r in sub))
        profiles = list(dict.fromkeys(r["profile"] for r in sub))
        width = 0.8 / max(1, len(profiles) * len(programs))
        for pi, prof in enumerate(profiles):
            for qi, (prog, batch) in enumerate(programs):
                xs, ys = [], []
                for ti, t in enumerate(targets):
                    r = next((r for r in sub if r["target"] == t and r["profile"] == prof and r["batch"] == batch
                              and r["program"].startswith(prog)), None)
                    if r is not None:
                        xs.append(ti + (pi * len(programs) + qi) * width)
                        ys.append(r["bytes_over_ideal"])
                old = prof.endswith("_scan") or prof == before
                if not xs:
                    continue
                ax.bar(xs, ys, width, label=f"{'old' if old else 'new'} profile: {prog} b={batch}",
                       hatch="//" if old else None, color=f"C{qi}", alpha=0.55 if old else 1.0)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(targets))])
        ax.set_xticklabels(targets, rotation=20, fontsize=8)
        ax.set_title(topo)
        ax.set_ylabel("HBM bytes per call / ideal")
    seen = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def main(out_dir: str, before: str = "") -> None:
    out = pathlib.Path(out_dir)
    rows = load(out / "rows.jsonl")
    lines = ["# specjax aot: programs compiled without the device", "",
             "Generated by `python -m experiments.aot.report` from `rows.jsonl` (see README.md for the command).", "",
             "## Before and after", "", *summary(rows), "", "## Every program", "", *table(rows), ""]
    (out / "results.md").write_text("\n".join(lines))
    plot(rows, out / "plot.png", before)
    print(f"wrote {out / 'results.md'} and {out / 'plot.png'} from {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "experiments/aot/results", sys.argv[2] if len(sys.argv) > 2 else "")
