"""Time to first token and peak memory on long prompts (issue 18 item 10); see config.py.

    python -m experiments.long_prompt.run --config=experiments/long_prompt/config.py

Each (prompt length, chunk) runs in a child process: load the target, build the prompt, then
time `Engine.init` (the prefill; its compile measured apart by a first call on the same shapes
in the same process) and the first round, and read the process's peak RSS (`ru_maxrss`).
Then the main command itself (`specjax.cli`, default config) on prompts of
``main_command_tokens``: one prefill serves calibration, the speculative and the target-only run.
"""

from __future__ import annotations

import json
import pathlib
import resource
import subprocess
import sys
import time

from experiments.lib import toolkit


def child(target: str, n_tokens: int, chunk: int, max_new_tokens: int) -> dict:
    import jax

    from specjax import build, decoding, models, sampling, specbench

    build.tune_xla_cpu()
    if target.startswith("preset:"):
        from experiments.lib import workload
        model = models.Llama(workload.preset_config(target.split(":", 1)[1], scan_layers=False).replace(
            max_position=max(8192, n_tokens + 64)))
        params = model.init_params(jax.random.key(0))
        ids = [(7 * i + 3) % model.vocab_size for i in range(n_tokens)]
    else:
        model, params, tok = models.load_with_tokenizer(target, scan_layers=False, fuse_projections=True)
        text, ids = "", []
        for q in specbench.load():
            text += q.prompt + "\n\n"
            ids = decoding.encode_prompt(tok, "Answer the last question.\n\n" + text)
            if len(ids) >= n_tokens:
                break
        ids = ids[-n_tokens:]
    config = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=0, prefill_chunk=chunk or None)
    engine = decoding.Engine(model, None, config)
    ep = decoding.EngineParams(target=params)
    batch = decoding.make_batch([ids], config, jax.random.key(0), pad_multiple=64)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.init(ep, batch))           # compile + first prefill
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(engine.init(ep, batch))
    prefill_s = time.perf_counter() - t0
    greedy = sampling.SamplingConfig.greedy_config()
    jax.block_until_ready(engine.step(ep, greedy, engine.init(ep, batch)))     # compile the round
    t0 = time.perf_counter()
    state, commit = engine.step(ep, greedy, state)
    jax.block_until_ready(commit)
    round_s = time.perf_counter() - t0
    return {"prompt_tokens": len(ids), "chunk": chunk, "capacity": batch.capacity,
            "prefill_s": prefill_s, "first_round_s": round_s, "ttft_s": prefill_s + round_s,
            "compile_and_first_prefill_s": first_s,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def child_main_command(n_tokens: int, max_new_tokens: int) -> dict:
    """The README's main command (configs/generate.py: shipped draft, adaptive gamma with its
    calibration, the target-only comparison) on a chat prompt of about ``n_tokens`` tokens: the
    prompt is prefilled once and every run starts from it. Wall time of the whole command after
    the model load, and the process's peak RSS."""
    import io
    import contextlib

    from configs import generate
    from specjax import build, cli, specbench
    from specjax import generate as generate_command

    build.tune_xla_cpu()
    c = generate.get_config()
    text = "Answer the last question.\n\n"
    from specjax import models
    _, _, tok = models.load_with_tokenizer(c.target, scan_layers=False)
    for q in specbench.load():
        text += q.prompt + "\n\n"
        if len(tok.encode(text)) >= n_tokens:
            break
    c.prompt, c.max_new_tokens = text, max_new_tokens
    c.calibration_cache = ""          # calibrate in every run, so runs stay comparable
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        stats = generate_command.run(generate_command.generate_job(c))
    wall_s = time.perf_counter() - t0
    keep = ("new_tokens", "prefill_s_incl_compile", "ttft_s_incl_compile", "tokens_per_s",
            "target_only_tokens_per_s", "speedup", "gamma", "drafter")
    return {"main_command": True, "prompt_chars": len(text), "wall_s_incl_load_and_compile": wall_s,
            **{k: stats.get(k) for k in keep},
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main(c):
    out = pathlib.Path(c.out)
    prov = toolkit.provenance("experiments.long_prompt.run", exclude=[out], with_backend=False, config=c.to_dict())
    jl = toolkit.Jsonl(out, prov)
    runs = [(n, ch) for n in c.prompt_tokens for ch in c.chunks] + \
           [(n, 0) for n in c.prompt_tokens if n <= c.unchunked_up_to]
    runs += [(n, "main") for n in c.main_command_tokens]
    for n, ch in runs:
        call = (f"child_main_command({n}, {c.max_new_tokens})" if ch == "main"
                else f"child({c.target!r}, {n}, {ch}, {c.max_new_tokens})")
        code = (f"import json; from experiments.long_prompt.run import child, child_main_command; "
                f"print(json.dumps({call}))")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=toolkit.REPO)
        if p.returncode != 0:
            rec = jl.write("measurement", prompt_tokens=n, chunk=ch, error=p.stderr.strip().splitlines()[-1:])
        else:
            rec = jl.write("measurement", **json.loads(p.stdout.strip().splitlines()[-1]))
        print({k: v for k, v in rec.items() if k != "provenance"}, flush=True)
    jl.close()


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/long_prompt/config.py[:tiny]")
