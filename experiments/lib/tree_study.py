"""The token-tree benchmark: chain vs static tree vs dynamic tree per drafter, and the cost of
scoring N tokens in one target pass; every measurement a JSONL record, the tables rendered from
the JSONL by `report` (here at the end, or on its own: ``python -m experiments.bench_trees.report``).

    python -m experiments.bench_trees.run --config=experiments/bench_trees/config.py
    python -m experiments.bench_trees.run --config=experiments/bench_trees/config.py:tiny

Prompts: the shortest held-out Spec-Bench question of each category (13, chat-templated), all
padded to one width, so every configuration compiles once. Timing: each configuration runs
every prompt once with `Engine.run` (the whole generation, one jitted call; a call that
compiled is run again and only the second call is timed); the prefill alone (`Engine.init`,
timed per prompt) is subtracted, so tokens/s is decoding speed. Target-only decoding runs on the same prompts, batches and cache capacity in the
same process, per temperature, so the ratios are measured in one run. Under greedy decoding the
outputs are compared with target-only decoding's (recorded, not asserted: float near-ties, see
`specjax.decoding.greedy_check`).
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import build, decoding, drafters, models, sampling, trees

from experiments.lib import toolkit
from experiments.lib import workload
from experiments.lib import tree_report as report


def _log(msg: str):
    print(f"[bench_trees {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proposals(c, kind: str) -> list[tuple[str, object]]:
    """(label, gamma or tree) of one drafter kind: the chains, then its trees (feature heads:
    ``head_chains`` and, for EAGLE kinds, ``head_trees``; Medusa heads draft chains only)."""
    adaptive = []
    if kind.startswith("head:"):
        gs = tuple(int(g) for g in c.get("head_chains", c.chains))
        chains = [(f"chain:{g}", g) for g in gs]
        if c.get("adaptive", False):
            adaptive = [("adaptive", decoding.AdaptiveGamma(gammas=(0,) + gs))]
        directory = kind.split(":", 1)[1]
        if drafters.is_head_dir(directory) and drafters.head_kind(directory) == "medusa":
            return chains + adaptive
        return chains + [(t, trees.parse_tree(t)) for t in c.get("head_trees", ())] + adaptive
    tree_texts = c.ngram_trees if kind == "ngram" else c.model_trees
    out = [(f"chain:{g}", int(g)) for g in c.chains] + [(t, trees.parse_tree(t)) for t in tree_texts]
    if c.get("adaptive", False):            # gamma per round among 0 and the chains (calibrated round times)
        out.append(("adaptive", decoding.AdaptiveGamma(gammas=(0,) + tuple(int(g) for g in c.chains))))
    return out


def with_verifiers(c, props: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Each proposal once per verifier of ``c.verifiers`` (chains: 'token', 'block') and
    ``c.tree_verifiers`` (trees: 'traversal', 'recursive'), labelled ``<setting>@<verifier>``;
    unchanged when those are empty (the config's `tree_verifier`, the token verifier)."""
    chain_vs, tree_vs = tuple(c.get("verifiers", ()) or ()), tuple(c.get("tree_verifiers", ()) or ())
    out = []
    for label, p in props:
        vs = chain_vs if isinstance(p, int) else (tree_vs if not isinstance(p, decoding.AdaptiveGamma) else ())
        out += [(f"{label}@{v}", p) for v in vs] if vs else [(label, p)]
    return out


def verifiers_of(c, label: str) -> tuple[str, str]:
    """(verifier, tree_verifier) of a setting label from `with_verifiers`."""
    _, _, v = label.partition("@")
    if not v:
        return "token", c.tree_verifier
    return (v, c.tree_verifier) if v in ("token", "block") else ("token", v)


def samplings(c) -> list[tuple[float, float]]:
    """(temperature, top_p) of every sampling setting: ``c.samplings`` ("T" or "T:top_p"
    strings) when given, else each of ``c.temperatures`` with top_p 1."""
    texts = tuple(c.get("samplings", ()) or ())
    if not texts:
        return [(float(t), 1.0) for t in c.temperatures]
    out = []
    for t in texts:
        temp, _, top_p = str(t).partition(":")
        out.append((float(temp), float(top_p or 1.0)))
    return out


def node_costs(target, params, counts, *, ctx: int, capacity: int, iters: int, log) -> dict:
    """{N: timing} of one target pass scoring N tokens as a tree block (root + N - 1 nodes, a
    chain-shaped ancestor mask: the cost does not depend on the mask's shape) against a cache
    holding ctx tokens."""
    cache = target.init_cache(1, capacity).rollback(ctx)
    fn = jax.jit(lambda p, t, c, b: target.apply(p, t, c, tree=b)[0])
    out = {}
    for n in counts:
        block = models.TreeBlock(rel_positions_BT=jnp.arange(n, dtype=jnp.int32)[None],
                                 visible_BTW=jnp.tril(jnp.ones((n, n), bool))[None])
        out[int(n)] = toolkit.time_calls(fn, params, toolkit.probe_tokens(1, n, target.vocab_size), cache, block,
                                         iters=iters, log=log)
    return out


class _Calibrated:
    """An engine whose `run` passes its calibrated round times (adaptive gamma)."""

    def __init__(self, engine, round_time_s):
        self.engine, self.round_time_s = engine, round_time_s

    def run(self, params, samp, batch):
        return self.engine.run(params, samp, batch, round_time_s=self.round_time_s)

    def init(self, params, batch):
        return self.engine.init(params, batch, round_time_s=self.round_time_s)


def _generate(engine, params, samp, batch, log):
    """(decode seconds, output, compile seconds) of one `Engine.run` less its prefill; each
    call is rerun once if it compiled."""
    with log.section() as box:
        t, out = toolkit.timed(engine.run, params, samp, batch)
        pre, _ = toolkit.timed(engine.init, params, batch)
    if box["compiles"]:
        t, out = toolkit.timed(engine.run, params, samp, batch)
        pre, _ = toolkit.timed(engine.init, params, batch)
    return t - pre, out, box["compile_s"]


def main(c, module: str = "experiments.bench_trees.run"):
    """The benchmark of config `c`; ``module`` names the entry point in the provenance (the
    variants in experiments/theory and experiments/temperature call this)."""
    build.tune_xla_cpu()
    out = pathlib.Path(c.out)
    g = toolkit.load_config(c.generate_config)
    workload.check_workload(c.workload or g.target)
    for kind in c.drafters:
        proposals(c, kind)                         # bad tree strings fail before anything loads
    prov = toolkit.provenance(module, exclude=[out.parent], config=c.to_dict(),
                              generate_config=g.to_dict())
    layers = workload.layers_of(g)             # the main command's layout (cpu_kernel resolved)
    c.early_exit_layers = c.early_exit_layers or g.early_exit_layers
    wc = ml_collections.ConfigDict({**c.to_dict(), "workload": c.workload or g.target, "dtype": g.dtype,
                                    "layers": layers, "draft_model": g.draft_model, "max_ngram": g.max_ngram})
    _log(f"loading {wc.workload}")
    w = workload.load(wc, out.parent / "_work")
    by_cat = {}
    for p in w.prompts:
        by_cat.setdefault(p.category, []).append(p)
    k = int(c.get("per_category", 1))       # the k shortest questions of each category
    w.prompts = [p for cat in sorted(by_cat) for p in sorted(by_cat[cat], key=lambda p: len(p.ids))[:k]]
    jl = toolkit.Jsonl(out, {**prov, "model": w.name, "model_file": w.model_file, "model_sha256": w.model_sha256,
                             "model_notes": w.notes, "layers": layers})
    prompts = [list(p.ids) for p in w.prompts]
    kinds = [k for k in c.drafters if k != "distilled" or workload.has_distilled(w, wc)]
    def block(p):
        return p if isinstance(p, int) else (max(map(block, p.gammas)) if isinstance(p, decoding.AdaptiveGamma)
                                            else p.num_nodes)
    max_block = max(block(p) for k in kinds for _, p in proposals(c, k))
    longest = max(map(len, prompts))
    capacity = -(-(longest + c.max_new_tokens + max_block + 1) // c.pad_multiple) * c.pad_multiple
    width = -(-longest // c.pad_multiple) * c.pad_multiple
    base_config = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=0, eos_ids=w.eos_ids)

    def batch_of(i, p):     # one request per call, every call with the same width and capacity
        b = decoding.make_batch([p], base_config, jax.random.key(c.seed), request_ids=[w.prompts[i].question_id],
                                pad_multiple=c.pad_multiple, capacity=capacity)
        pad = width - b.prompt_BP.shape[1]
        return b if pad == 0 else decoding.Batch(jnp.pad(b.prompt_BP, ((0, 0), (0, pad))), b.prompt_lengths_B,
                                                 b.key_B, b.capacity)

    batches = [batch_of(i, p) for i, p in enumerate(prompts)]
    with toolkit.CompileLog() as log:
        ctx = int(round(np.mean([len(p) for p in prompts]) + c.max_new_tokens / 2))
        _log(f"node costs N = {list(c.node_counts)} at context {ctx}, capacity {capacity}")
        for n, v in node_costs(w.target, w.params, c.node_counts, ctx=ctx, capacity=capacity, iters=c.cost_iters,
                               log=log).items():
            jl.write("node_cost", n=n, context=ctx, capacity=capacity, **v)
        if c.get("draft_costs", False):
            for kind in kinds:
                drafter, dparams = workload.drafter(w, kind, wc)
                for g in (c.get("head_chains", c.chains) if kind.startswith("head:") else c.chains):
                    v = toolkit.propose_cost(w.target, drafter, dparams, int(g), sampling.SamplingConfig.make(0.0),
                                             ctx=ctx, capacity=capacity, iters=c.cost_iters, log=log)
                    jl.write("draft_cost", drafter=kind, gamma=int(g), context=ctx, **v)
                    _log(f"draft cost {kind} gamma {g}: {1e3 * v['median_s']:.2f} ms")
        for temp, top_p in samplings(c):
            samp = sampling.SamplingConfig.make(temperature=temp, top_p=top_p)
            runs = [("none", "target_only", 0)] + [(k, label, p) for k in kinds
                                                  for label, p in with_verifiers(c, proposals(c, k))]
            reference = None
            for kind, label, proposal in runs:
                drafter, dparams = (None, None) if kind == "none" else workload.drafter(w, kind, wc)
                verifier, tree_verifier = verifiers_of(c, label)
                config = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=proposal, eos_ids=w.eos_ids,
                                                   verifier=verifier, tree_verifier=tree_verifier,
                                                   tree_children=c.tree_children)
                engine = decoding.Engine(w.target, drafter, config)
                params = decoding.EngineParams(target=w.params, draft=dparams)
                round_time_s = None
                if config.adaptive:             # calibrated once per drafter and setting, on the first prompt
                    round_time_s = engine.round_times(params, samp, batches[0], repeats=3)
                    engine = _Calibrated(engine, tuple(round_time_s))
                per_prompt, gamma_rounds = [], None
                tot = dict(seconds=0.0, compile_s=0.0, new_tokens=0, target_passes=0, proposed=0, accepted=0,
                           scored=0, draft_passes=0)
                outputs = []
                for b in batches:
                    t, o, comp = _generate(engine, params, samp, b, log)
                    m = jax.device_get(o.metrics)
                    gen = o.generated()[0]
                    outputs.append(gen)
                    tot["seconds"] += t
                    tot["compile_s"] += comp
                    tot["new_tokens"] += len(gen)
                    tot["target_passes"] += int(m.rounds_B[0])
                    tot["proposed"] += int(m.proposed_B[0])
                    tot["accepted"] += int(m.accepted_B[0])
                    tot["scored"] += int(m.scored_B[0])
                    tot["draft_passes"] += int(m.draft_passes_B[0])
                    acc_at = np.asarray(m.accepted_at_BG[0]).tolist()
                    tested_at = np.asarray(m.tested_at_BG[0]).tolist()
                    tot["accepted_at"] = [a + b2 for a, b2 in zip(tot.get("accepted_at", [0] * len(acc_at)), acc_at)]
                    tot["tested_at"] = [a + b2 for a, b2 in zip(tot.get("tested_at", [0] * len(tested_at)), tested_at)]
                    k = np.asarray(m.gamma_rounds_Z)
                    gamma_rounds = k if gamma_rounds is None else gamma_rounds + k
                    pr = w.prompts[len(per_prompt)]
                    per_prompt.append(dict(question_id=pr.question_id, category=pr.category, seconds=t,
                                           new_tokens=len(gen), target_passes=int(m.rounds_B[0]),
                                           proposed=int(m.proposed_B[0]), accepted=int(m.accepted_B[0])))
                if kind == "none":
                    reference = outputs
                rec = dict(drafter=kind, setting=label, temperature=float(temp), top_p=float(top_p), prompts=len(batches),
                           tokens_per_s=tot["new_tokens"] / tot["seconds"],
                           accepted_tokens_per_pass=tot["new_tokens"] / max(tot["target_passes"], 1),
                           tokens_scored_per_pass=tot["scored"] / max(tot["target_passes"], 1), **tot)
                if temp == 0 and kind != "none":
                    rec["greedy_rows_matching"] = sum(a == b2 for a, b2 in zip(outputs, reference))
                rec["per_prompt"] = per_prompt
                if config.adaptive:
                    rec.update(gammas=list(config.gammas), round_time_s=list(round_time_s),
                               rounds_per_gamma=gamma_rounds.tolist())
                jl.write("generation", **rec)
                _log(f"T={temp:g} {kind} {label}: {rec['accepted_tokens_per_pass']:.2f} tokens/pass, "
                     f"{rec['tokens_per_s']:.1f} tok/s (compile {tot['compile_s']:.0f} s)")
                jax.clear_caches()
    jl.close()
    print(report.write(out))


def run_variant(c, module: str, plot_fn) -> None:
    """A study built on this benchmark (experiments/theory, temperature, verifiers): the run, the
    benchmark's own table kept as bench_trees.md (it writes README.md beside the JSONL), then the
    study's plots and tables from the JSONL (``plot_fn(path)`` -> written paths)."""
    main(c, module=module)
    results = pathlib.Path(c.out).parent
    (results / "README.md").replace(results / "bench_trees.md")
    for p in plot_fn(c.out):
        print(p)


def study(name: str):
    """(main, entry point) of the study ``experiments/<name>``: `run_variant` with its config
    (``experiments/<name>/config.py``) and its ``plot`` module; its run.py is these two lines."""
    import importlib
    plot = importlib.import_module(f"experiments.{name}.plot")

    def study_main(c):
        run_variant(c, f"experiments.{name}.run", plot.plot)

    def entry():
        toolkit.main_with_config(study_main, toolkit.REPO / "experiments" / name / "config.py",
                                 f"experiments/{name}/config.py[:tiny]")
    return study_main, entry


def entry():
    """The bench_trees study's command line (experiments/bench_trees/run.py)."""
    toolkit.main_with_config(main, toolkit.REPO / "experiments" / "bench_trees" / "config.py",
                             "experiments/bench_trees/config.py[:tiny]")
