"""The streamed adaptive round with and without `step`'s `lax.switch` (the main command
streams; `Engine.stream` now dispatches the policy's choice to a round compiled on its own):

    python experiments/bench_speed/adaptive_stream.py TEMPERATURE

Held-out questions 84 and 104, packed SmolLM2 target, n-gram drafter under the main
command's adaptive gamma and XLA options, 128 new tokens with EOS; best of the last 3 of 4
runs of: target-only (`run`), adaptive `run`, adaptive `stream` (the chosen-round path) and
adaptive rounds by hand through `step` (the switch, what `stream` did before). Prints
seconds/rounds per prompt and checks that every path committed the same tokens.
"""
import sys
import time

import jax

from specjax import build, decoding, models, sampling, specbench

build.tune_xla_cpu()
NAME = "smollm2-135m-instruct"
target, params = build.load_target(NAME, scan_layers=False, fuse_projections=True)
packed = models.Llama(target.config.replace(linear_op="panels"))
pp = packed.prepare_params(params)
tok = models.load_tokenizer(NAME)
qs = {q.question_id: q for q in specbench.load(split="held_out")}
prompts = [decoding.encode_prompt(tok, qs[i].prompt) for i in (84, 104)]
eos = tuple(int(i) for i in tok.stop_token_ids)
drafter, dp = build.make_drafter("ngram", packed, pp)
samp = sampling.SamplingConfig.make(temperature=float(sys.argv[1]))


def by_step(eng, ep, b):
    state = eng.init(ep, b)
    toks = []
    for _ in range(eng.config.max_new_tokens):
        state, commit = eng.step(ep, samp, state)
        c = jax.device_get(commit)
        toks += c.tokens_BC[0, :c.n_B[0]].tolist()
        if bool(c.done_B[0]):
            break
    return toks


def by_stream(eng, ep, b):
    return [t for ev in eng.stream(ep, samp, b) for t in ev.new_tokens[0]]


def by_run(eng, ep, b):
    return jax.device_get(eng.run(ep, samp, b)).generated()[0]


def bench(name, gamma, how, draft=True):
    cfg = decoding.GenerationConfig(max_new_tokens=128, gamma=gamma, eos_ids=eos)
    eng = decoding.Engine(packed, drafter if draft else None, cfg)
    ep = decoding.EngineParams(target=pp, draft=dp if draft else None)
    res, outs = [], []
    for p in prompts:
        b = decoding.make_batch([p], cfg, jax.random.key(0), pad_multiple=128)
        ts = []
        for _ in range(4):
            t0 = time.perf_counter()
            toks = how(eng, ep, b)
            ts.append(time.perf_counter() - t0)
        outs.append(list(toks))
        res.append(f"{min(ts[1:]):.3f}s/{len(toks)}tok")
    print(f"{name:28s}", res, flush=True)
    return outs


adaptive = decoding.AdaptiveGamma()
base = bench("target-only run", 0, by_run, draft=False)
runs = [bench("adaptive run", adaptive, by_run),
        bench("adaptive stream (chosen)", adaptive, by_stream),
        bench("adaptive step (switch)", adaptive, by_step)]
print("same tokens across adaptive paths:", all(r == runs[0] for r in runs))
if samp.temperature == 0:
    print("greedy equals target-only:", all(r == base for r in runs))
