"""The parity table of the model families: specjax against transformers, per family and case.

    python -m experiments.family_parity.run --out=experiments/family_parity/results     # ~2 min on 2 cores

For every family of `tests/test_families.py` (the same tiny random checkpoints, written by
transformers itself: `tests/_hf_tiny.family_model`), the cases of `tests/_hf_tiny.parity_cases`
(ragged prefill, cached one-token steps, a 5-token verification block, a rollback, a token
tree) in both layer layouts (scan, unrolled); per case the largest max|Δ| / max|logit| over its
positions and the largest KL(p_ref || p). Writes results.jsonl, README.md (the table) and
parity.png.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
from absl import app, flags

from experiments.lib import toolkit
from specjax.models import load

flags.DEFINE_string("out", "experiments/family_parity/results", "results folder")
FLAGS = flags.FLAGS


def _tests_helper():
    """tests/_hf_tiny.py, the tests' tiny checkpoints and parity cases (one definition for both)."""
    path = toolkit.REPO / "tests" / "_hf_tiny.py"
    spec = importlib.util.spec_from_file_location("_hf_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(_):
    import tempfile

    import torch
    import transformers
    tiny = _tests_helper()
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = toolkit.provenance("experiments.family_parity.run", exclude=["experiments/family_parity/results"])
    jl = toolkit.Jsonl(out / "results.jsonl", {**prov, "transformers": transformers.__version__})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in tiny.FAMILY_KINDS:
            path = pathlib.Path(tmp) / kind
            tiny.family_model(kind).save_pretrained(path, safe_serialization=True)
            ref_model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
            for layout in ("scan", "unrolled"):
                model, params = load(str(path), scan_layers=layout == "scan")
                worst: dict[str, list[float]] = {}
                for case, ref, got in tiny.parity_cases(model, params, ref_model):
                    rel, kl = tiny.rel_and_kl(ref, got)
                    w = worst.setdefault(case, [0.0, 0.0, 0])
                    w[0], w[1], w[2] = max(w[0], float(rel.max())), max(w[1], float(kl.max())), w[2] + len(rel)
                for case, (rel, kl, n) in worst.items():
                    rec = jl.write("case", family=kind, arch=model.config.arch, layout=layout, case=case,
                                   max_rel_error=rel, max_kl=kl, positions=n)
                    rows.append(rec)
                    print(f"{kind:13s} {layout:9s} {case:30s} rel {rel:.2e} kl {kl:.2e}", file=sys.stderr)
    jl.close()
    write_report(out, rows)


def write_report(out: pathlib.Path, rows) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    table_rows = []
    for fam in families:
        cells = []
        for case in cases:
            vals = [r["max_rel_error"] for r in rows if r["family"] == fam and r["case"] == case]
            cells.append(f"{max(vals):.1e}")
        arch = next(r["arch"] for r in rows if r["family"] == fam)
        table_rows.append([f"{fam} (`{arch}`)", *cells])
    prov = rows[0]["provenance"]
    text = "\n".join([
        "# Model families: parity with transformers",
        "",
        "```bash",
        "python -m experiments.family_parity.run --out=experiments/family_parity/results",
        "```",
        "",
        "Max |Δ logit| / max |logit| per position, the largest over the case's positions and both "
        "layer layouts (scan, unrolled), float32, tiny random checkpoints written by transformers "
        f"{rows[0]['provenance'].get('transformers', '')} (`tests/_hf_tiny.py`). The tests hold every "
        "case to 1e-4 (and KL to 1e-5). The tree block follows a rollback of a verification block.",
        "",
        toolkit.table(["family", *cases], table_rows),
        "",
        *toolkit.provenance_lines(prov),
        "",
        "![parity](parity.png)",
    ])
    (out / "README.md").write_text(text + "\n")
    plt = toolkit.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(families))
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        ax.bar(x + i * width, [max(r["max_rel_error"] for r in rows if r["family"] == f and r["case"] == case)
                               for f in families], width, label=case)
    ax.set_yscale("log")
    ax.axhline(1e-4, color="k", ls="--", lw=1)
    ax.set_xticks(x + 0.4 - width / 2, families, fontsize=8)
    ax.set_ylabel("max relative logit error")
    ax.legend(fontsize=7)
    fig.tight_layout()
    toolkit.save_figure(fig, out / "parity.png")


if __name__ == "__main__":
    app.run(main)
