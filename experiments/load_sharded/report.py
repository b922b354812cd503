"""The table and plot of experiments/load_sharded/results/results.jsonl.

    python -m experiments.load_sharded.report --results=experiments/load_sharded/results
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

flags.DEFINE_string("results", "experiments/load_sharded/results", "folder with results.jsonl")
FLAGS = flags.FLAGS
GB = 1e9


def table(rows) -> str:
    lines = ["| path | seconds | peak anonymous GB | above placed shards GB | peak RSS GB | placed GB | checkpoint GB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['seconds']:.1f} | {r['peak_anon_bytes'] / GB:.2f} | "
                     f"{r['transient_anon_bytes'] / GB:.2f} | {r['peak_rss_bytes'] / GB:.2f} | "
                     f"{r['placed_bytes'] / GB:.2f} | {r['checkpoint_bytes'] / GB:.2f} |")
    return "\n".join(lines)


def main(_):
    folder = pathlib.Path(FLAGS.results)
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    print(table(rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["path"] for r in rows]
    placed = [r["placed_bytes"] / GB for r in rows]
    above = [r["transient_anon_bytes"] / GB for r in rows]
    ax.barh(names, placed, label="placed shards")
    ax.barh(names, above, left=placed, label="transient (anonymous)")
    ax.axvline(rows[0]["checkpoint_bytes"] / GB, color="k", ls="--", lw=1, label="checkpoint size")
    ax.set_xlabel("peak host memory, GB")
    ax.set_title(f"{rows[0]['num_params'] / 1e9:.2f}B params, 8 simulated devices ({rows[0]['cpu']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "memory.png", dpi=120)


if __name__ == "__main__":
    app.run(main)
