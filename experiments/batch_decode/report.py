"""Table and plot of a batch_decode run (`run.py`'s JSONL), written beside it.

    python -m experiments.batch_decode.report experiments/batch_decode/results/<run>/results.jsonl
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit


def tables(records: list[dict]) -> str:
    rows = [r for r in records if r["kind"] == "throughput"]
    gemm = next((r["gflops"] for r in records if r["kind"] == "gemm"), float("nan"))
    base = {r["batch_size"]: r for r in rows if r["path"].startswith("unsorted:512") and r["path"].count(":") == 1}
    out = [f"float32 GEMM rate of this CPU (the practical FLOP bound): {gemm:.0f} GFLOP/s", "",
           toolkit.table(["path", "batch", "prompts", "generated tok/s", "vs unsorted:512", "prefill tok/s",
                          "decode tok/s", "padded / real prompt tokens", "GFLOP/s (share of GEMM)",
                          "FLOP-bound tok/s", "compile s (left out)"],
                         [[r["path"], r["batch_size"], r["prompts"], toolkit.fmt(r["tokens_per_s"], 1),
                           (toolkit.fmt(r["tokens_per_s"] / base[r["batch_size"]]["tokens_per_s"]) + "x")
                           if r["batch_size"] in base and base[r["batch_size"]]["prompts"] == r["prompts"] else "",
                           toolkit.fmt(r["prefill_tokens_per_s"], 0), toolkit.fmt(r["decode_tokens_per_s"], 0),
                           toolkit.fmt(r["padded_prompt_tokens"] / r["prompt_tokens"]),
                           f"{r['achieved_gflops']:.0f} ({r['achieved_gflops'] / gemm:.0%})",
                           toolkit.fmt(r["flop_bound_tokens_per_s"], 0),
                           toolkit.fmt(sum(r["compile_s"].values()), 0)] for r in rows])]
    return "\n".join(out) + "\n"


def plot(records: list[dict], path) -> pathlib.Path:
    plt = toolkit.pyplot()
    rows = [r for r in records if r["kind"] == "throughput"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p in sorted({r["path"] for r in rows}):
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if r["path"] == p)
        ax.plot(*zip(*pts), marker="o", label=p)
    bound = {}
    for r in rows:                   # one prompt set per batch size: the bound of its first record
        bound.setdefault(r["batch_size"], r["flop_bound_tokens_per_s"])
    ax.plot(*zip(*sorted(bound.items())), ls="--", marker="x", color="grey", label="FLOP bound (GEMM rate)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (rows)")
    ax.set_ylabel("generated tokens / s (compile left out)")
    ax.set_title("Target-only generation, Spec-Bench training prompts\n" + toolkit.run_caption(rows[0]["provenance"]),
                 fontsize=9)
    ax.legend(fontsize=8)
    return toolkit.save_figure(fig, path)


def main(path: str) -> None:
    p = pathlib.Path(path)
    records = toolkit.read_jsonl(p)
    text = tables(records)
    (p.parent / "TABLE.md").write_text(text)
    plot(records, p.parent / "throughput.png")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1])
