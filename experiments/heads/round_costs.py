"""Where a draft-head round's time goes, chains against token trees: one JSONL record per setting.

    python -m experiments.heads.round_costs [--temperature=0] ["--settings=2;3;branching:2,1,1;dynamic:4,2,7"]

For the shipped head (or ``--head=DIR``) on the packed SmolLM2 target, batch 1, a mid-length
held-out prompt: the median wall time of one engine round (`Engine.round_times`, donated state,
as in the loop), of the drafter's `propose` / `propose_tree` alone, and of the target's
verification forward alone (its block: gamma + 1 tokens, or root + tree nodes through tree
attention, with the head's features), each jitted on its own; *rest* = round - propose -
forward (acceptance, cache commits, feature bookkeeping). Output:
``experiments/heads/results/round_costs.jsonl`` (``--out``), and a table on stdout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags

from specjax import build, decoding, models, sampling, trees
from specjax.drafters import DraftContext

from experiments.lib import toolkit
from experiments.lib import workload

TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "sampling temperature of the rounds")
SETTINGS = flags.DEFINE_string("settings", "1;2;3;branching:2,1,1;dynamic:4,2,7;dynamic:5,2,7;branching:2,2,1;"
                               "dynamic:4,3,12",
                               "chain lengths and tree strings (specjax.trees.parse_tree), separated by ';'")
HEAD = flags.DEFINE_string("head", "", "a head directory ('' = the one shipped for the target)")
OUT = flags.DEFINE_string("out", "experiments/heads/results/round_costs.jsonl", "JSONL output")
REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per measurement (median)")
PROMPT_INDEX = 6          # the 7th shortest of the 13 held-out prompts (one per category)


def main(_):
    build.tune_xla_cpu()
    proposals = [(text, int(text) if text.isdigit() else trees.parse_tree(text)) for text in SETTINGS.value.split(";") if text]
    c = toolkit.load_config(toolkit.REPO / "experiments" / "bench_speed" / "config.py")   # its workload settings
    c.update(num_prompts=13, layers="packed", head_model=HEAD.value)
    prov = toolkit.provenance("experiments.heads.round_costs", exclude=["experiments/heads/results"])
    w = workload.load(ml_collections.ConfigDict(c.to_dict()), "/tmp/specjax-round-costs")
    drafter, dparams = workload.drafter(w, "head", c)
    params = decoding.EngineParams(target=w.params, draft=dparams)
    prompt = sorted(w.prompts, key=lambda p: len(p.ids))[PROMPT_INDEX]
    samp = sampling.SamplingConfig.make(TEMPERATURE.value)
    jl = toolkit.Jsonl(OUT.value, {**prov, "model": w.name, "head": HEAD.value or "shipped",
                                   "prompt_question_id": prompt.question_id, "prompt_tokens": len(prompt.ids)})
    base = decoding.Engine(w.target, None, decoding.GenerationConfig(max_new_tokens=128, gamma=0, eos_ids=w.eos_ids))
    batch = decoding.make_batch([list(prompt.ids)], base.config, jax.random.key(0), capacity=512)
    step_ms = 1e3 * base.round_times(decoding.EngineParams(target=w.params, draft=None), samp, batch,
                                     repeats=REPEATS.value)[0]
    jl.write("target_step", temperature=TEMPERATURE.value, round_ms=step_ms)
    rows = [("target-only step", "1", f"{step_ms:.1f}", "", "", "")]
    with toolkit.CompileLog() as log:
        for text, g in proposals:
            children = "deterministic" if TEMPERATURE.value == 0 else "iid"
            cfg = decoding.GenerationConfig(max_new_tokens=128, gamma=g, eos_ids=w.eos_ids, tree_children=children)
            eng = decoding.Engine(w.target, drafter, cfg)
            batch = decoding.make_batch([list(prompt.ids)], cfg, jax.random.key(0), capacity=512)
            round_ms = 1e3 * eng.round_times(params, samp, batch, repeats=REPEATS.value)[0]
            state = eng.step(params, samp, eng.init(params, batch))[0]    # mid-generation: after one round
            ctx = DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B, target_cache=state.target_cache,
                               features=state.features_BSF)
            if isinstance(g, int):
                prop = jax.jit(lambda dp, st, cx, k: drafter.propose(dp, st, cx, k, g, samp)[:2])
                n_tok, block = g + 1, None
            else:
                prop = jax.jit(lambda dp, st, cx, k: drafter.propose_tree(dp, st, cx, k, g, samp, children)[:2])
                n_tok = g.num_nodes + 1
                block = models.TreeBlock(rel_positions_BT=jnp.arange(n_tok, dtype=jnp.int32)[None],
                                         visible_BTW=jnp.tril(jnp.ones((n_tok, n_tok), bool))[None])
            propose_ms = 1e3 * toolkit.time_calls(prop, dparams, state.draft_state, ctx, state.key_B,
                                                  iters=REPEATS.value, log=log)["median_s"]
            # The verification pass as the engine runs it for a head: logits and the head's features.
            fwd = jax.jit(lambda p, t, cc, b: w.target.apply_with_features(p, t, cc, tree=b,
                                                                           layers=drafter.feature_layers)[:2])
            toks = jnp.zeros((1, n_tok), jnp.int32)
            forward_ms = 1e3 * toolkit.time_calls(fwd, w.params, toks, state.target_cache, block, iters=REPEATS.value,
                                                  log=log)["median_s"]
            rest = round_ms - propose_ms - forward_ms
            jl.write("round", setting=text, temperature=TEMPERATURE.value, block_tokens=n_tok, round_ms=round_ms,
                     propose_ms=propose_ms, forward_ms=forward_ms, rest_ms=rest, target_step_ms=step_ms)
            rows.append((text, str(n_tok), f"{round_ms:.1f} ({round_ms / step_ms:.2f})", f"{propose_ms:.1f}",
                         f"{forward_ms:.1f} ({forward_ms / step_ms:.2f})", f"{rest:.1f}"))
            print(f"[round_costs] {text}: round {round_ms:.1f} ms, propose {propose_ms:.1f}, forward {forward_ms:.1f}",
                  flush=True)
            jax.clear_caches()
    jl.close()
    print(toolkit.table(["setting", "block tokens", "round ms (÷ step)", "propose ms", "target forward ms (÷ step)",
                         "rest ms"], rows))


if __name__ == "__main__":
    app.run(main)
