"""Greedy exactness at full size: speculative vs target-only greedy decoding of the production
configuration, per drafter and batch size.

    python -m experiments.greedy_exactness.run --config=experiments/greedy_exactness/config.py
    python -m experiments.greedy_exactness.run --config=experiments/greedy_exactness/config.py:tiny

The rule is `specjax.decoding.greedy_check`'s: a mismatch is allowed only where the target's
top-2 logit gap on the target-only prefix is below `decoding.NEAR_TIE_EPS` (a near-tie: reported,
then teacher-forced); any other mismatch is a failure. References (target-only greedy) are
computed per batch size, with the same batch layout as the speculative runs. Writes one JSONL
record per (drafter, batch size, prompt) and one summary per (drafter, batch size), each with
the provenance block (git commit and dirty flag, the weights' sha256, machine, config); exits
with status 1 if any prompt has a mismatch beyond the near-tie rule.
"""

from __future__ import annotations

import pathlib
import sys
import time

import ml_collections

from specjax import build, decoding

from experiments.lib import toolkit
from experiments.lib import workload
from experiments.greedy_exactness import config as settings



def main(c):
    out = pathlib.Path(c.out)
    specs = settings.drafter_specs(c)
    g = toolkit.load_config(c.generate_config)
    build.strict_precision(bool(g.get("strict_precision", False)))    # the profile's XLA rounding, before any backend
    workload.check_workload(c.workload or g.target)
    # the provenance of the start; the run's own files (not its code) do not make the tree dirty
    prov = toolkit.provenance("experiments.greedy_exactness.run", exclude=[out, out.parent / "_work"],
                              config=c.to_dict(), generate_config=g.to_dict())
    layers = workload.layers_of(g)             # the main command's layout (cpu_kernel resolved)
    c.early_exit_layers = c.early_exit_layers or g.early_exit_layers
    wc = ml_collections.ConfigDict({**c.to_dict(), "workload": c.workload or g.target, "dtype": g.dtype,
                                    "write_then_attend": bool(g.get("write_then_attend", False)),
                                    # token trees in the run: their rows in position order, the
                                    # references too (`ModelConfig.ordered_tail`)
                                    "ordered_tail": bool(g.get("write_then_attend", False))
                                    and any(not isinstance(spec, int) for _, spec in specs),
                                    "attention_op": str(g.get("attention_op", "reference")),
                                    "layers": layers, "draft_model": g.draft_model, "max_ngram": g.max_ngram})
    w = workload.load(wc, out.parent / "_work")
    prompts = [list(p.ids) for p in w.prompts]
    jl = toolkit.Jsonl(out, {**prov, "model": w.name, "model_file": w.model_file, "model_sha256": w.model_sha256,
                             "model_notes": w.notes, "eps": decoding.NEAR_TIE_EPS, "layers": layers,
                             "attention_op": w.target.config.attention_op,
                             "ordered_tail": w.target.config.ordered_tail})
    failures = 0
    block_tokens = int(g.get("block_tokens", 0))
    eps = decoding.NEAR_TIE_EPS if c.near_tie_eps < 0 else float(c.near_tie_eps)
    for B in c.batch_sizes:
        refs_by_block = {}

        def references(block):
            # target-only greedy in the speculative run's block shape (one per shape: with
            # block_tokens the references are bitwise comparable only in the same shape)
            if block not in refs_by_block:
                t0 = time.time()
                refs_by_block[block] = decoding.reference_greedy(
                    w.target, w.params, prompts, c.max_new_tokens, batch_size=B, pad_multiple=c.pad_multiple,
                    block_tokens=block)
                print(f"batch {B}: references (block {block or 'own'}) in {time.time() - t0:.0f} s", flush=True)
            return refs_by_block[block]

        for kind, gamma in specs:
            if kind == "distilled" and not workload.has_distilled(w, wc):
                print(f"batch {B}: no distilled draft for {w.name}, skipped", flush=True)
                continue
            draft_model = c.parallel_model if kind == "parallel" and c.parallel_model else g.draft_model
            drafter, dparams = build.make_drafter(
                kind, w.target, w.params, early_exit_layers=c.early_exit_layers, draft_model=draft_model,
                max_ngram=g.max_ngram, min_ngram=g.min_ngram, target_name=w.name, **c.drafter_settings.to_dict())
            t0 = time.time()
            budgets = isinstance(gamma, decoding.AdaptiveGamma)     # a row budget's pass is packed, never padded
            block = 0 if budgets else decoding.GenerationConfig(max_new_tokens=1, gamma=gamma,
                                                                block_tokens=block_tokens).target_block or 0
            reports = decoding.greedy_check(w.target, drafter, decoding.EngineParams(target=w.params, draft=dparams),
                                            prompts, c.max_new_tokens, gamma, references=references(block),
                                            batch_size=B, pad_multiple=c.pad_multiple, block_tokens=block, eps=eps)
            label = (gamma if isinstance(gamma, int) else gamma.describe() if hasattr(gamma, "describe")
                     else "adaptive " + ", ".join(str(g) for g in gamma.gammas))
            for p, r in zip(w.prompts, reports):
                jl.write("prompt", drafter=kind, gamma=label, batch_size=B, question_id=p.question_id,
                         category=p.category, ok=r.ok, tokens_compared=r.tokens_compared, near_ties=r.near_ties,
                         hard_mismatch=r.hard_mismatch, rounds=r.rounds, proposed=r.proposed, accepted=r.accepted,
                         full_accept_rounds=r.full_accept_rounds)
            total = {k: sum(getattr(r, k) for r in reports) for k in
                     ("tokens_compared", "rounds", "proposed", "accepted", "full_accept_rounds")}
            summary = jl.write("summary", drafter=kind, gamma=label, batch_size=B, prompts=len(reports), block_tokens=block,
                               near_tie_eps=eps,
                               hard_mismatches=sum(not r.ok for r in reports),
                               near_ties=sum(len(r.near_ties) for r in reports), **total, seconds=time.time() - t0)
            failures += summary["hard_mismatches"]
            print({k: v for k, v in summary.items() if k != "provenance"}, flush=True)
    jl.close()
    print(f"{failures} prompt(s) with a mismatch beyond the near-tie rule; wrote {c.out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/greedy_exactness/config.py[:tiny]")
