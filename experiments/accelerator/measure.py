"""The accelerator check, one process: decode speed against the memory roofline, verification
cost, the bitwise block-vs-step check and the cost model, for the old and the new profile.

    python -m experiments.accelerator.measure OUT_DIR [--presets=8b,1b] [--batches=1,8,64] [--seconds=480]

Random weights with published checkpoints' shapes (`experiments.lib.workload.PRESETS`), in
bfloat16, on the default device. Per preset and layout (``old``: configs/generate_gpu_scan.py's
scanned layers, each pass its own size; ``new``: configs/generate_gpu.py's unrolled, fused
layers with one block shape of ``gamma + 1`` tokens):

* ``bandwidth``: the device's copy bandwidth (a 2 GiB buffer read and written);
* ``decode``: target-only decoding, ``steps`` jitted rounds after a warm-up, tokens/s per
  batch size, and the bytes a step must read (weights + the live KV) over that time as a fraction
  of the measured bandwidth (% of the memory roofline);
* ``verify``: the target's forward over k = 1..8 tokens on a cache of ``context`` tokens, each
  over the 1-token forward;
* ``bitwise``: a 4-token block against 4 one-token steps (padded to the block, as the engine
  runs them) on a small random model, logits compared with ``==``, at batch 1 and 2;
* ``cost_model``: the speedup `specjax.analysis.RoundCost` predicts at acceptance 0.6-0.9 with
  the measured verification costs and a draft step of 0.05 target steps (an EAGLE-3-sized head).

Every record is a JSON line in OUT_DIR/accelerator.jsonl with the device, jax version and commit;
the run stops starting new measurements once ``seconds`` have passed, so a time limit leaves
what was measured.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import analysis, decoding, models, sampling

from experiments.lib import workload

LAYOUTS = {"old": dict(scan_layers=True, fuse_projections=False, write_then_attend=False, block=0),
           "new": dict(scan_layers=False, fuse_projections=True, write_then_attend=True, block=-1)}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _sync(x):
    jax.block_until_ready(x)
    return x


def bandwidth_bytes_per_s(gib: float = 2.0) -> float:
    n = int(gib * 2**30 // 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    _sync(f(x))
    t0 = time.perf_counter()
    for _ in range(5):
        y = _sync(f(x))
    dt = (time.perf_counter() - t0) / 5
    del y
    return 2 * n * 4 / dt


def _model(size: str, layout: str):
    lay = LAYOUTS[layout]
    cfg = workload.preset_config(size, "bfloat16", scan_layers=lay["scan_layers"],
                                 fuse_projections=lay["fuse_projections"]).replace(
                                     write_then_attend=lay["write_then_attend"])
    model = models.Llama(cfg)
    params = model.prepare_params(workload.random_params(cfg.replace(scan_layers=True, fuse_projections=False),
                                                         jax.random.key(0)))
    return model, params


def _tree_bytes(tree) -> float:
    return float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def decode(model, params, batch: int, context: int, steps: int, block: int) -> dict:
    """Target-only decoding speed: ``steps`` rounds of one jitted loop after a warm-up."""
    cfg = model.config
    config = decoding.GenerationConfig(max_new_tokens=2 * steps + 8, gamma=0, block_tokens=block)
    engine = decoding.Engine(model, None, config)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, context)).tolist()
    b = decoding.make_batch(prompts, config, jax.random.key(0), pad_multiple=64)
    ep = decoding.EngineParams(target=params)
    greedy = sampling.SamplingConfig.make(0.0)
    state = _sync(engine.init(ep, b))
    state, _ = engine.steps(ep, greedy, state, steps)      # compile and warm up (the same program)
    _sync(state)
    t0 = time.perf_counter()
    state, _ = engine.steps(ep, greedy, state, steps)
    _sync(state)
    dt = (time.perf_counter() - t0) / steps
    embed = params["embed"].size * params["embed"].dtype.itemsize
    weights = _tree_bytes(params) - (0 if cfg.tie_embeddings else embed)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * batch * (context + 3 * steps // 2)
    return {"step_s": dt, "tokens_per_s": batch / dt, "bytes_per_step": weights + kv}


def verify_costs(model, params, batch: int, context: int, ks=range(1, 9), iters: int = 20) -> dict:
    apply = jax.jit(model.apply, donate_argnums=2)
    out = {}
    for k in ks:
        cache = model.init_cache(batch, context + 16)
        cache = cache.rollback(jnp.full((batch,), context, jnp.int32))
        tokens = jnp.ones((batch, k), jnp.int32)
        _, cache = _sync(apply(params, tokens, cache))
        times = []
        for _ in range(iters):
            cache = cache.rollback(jnp.full((batch,), context, jnp.int32))
            t0 = time.perf_counter()
            _, cache = _sync(apply(params, tokens, cache))
            times.append(time.perf_counter() - t0)
        out[k] = float(np.median(times))
    return out


def bitwise(batch: int) -> dict:
    """A 4-token block against 4 one-token steps padded to 4 tokens (the engine's one block
    shape), small random Llama in bfloat16, the new layout: logits compared with ``==``."""
    cfg = models.ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                             ffn_size=512, dtype="bfloat16", scan_layers=False, fuse_projections=True,
                             write_then_attend=True)
    model = models.Llama(cfg)
    params = jax.tree.map(lambda x: (x.astype(jnp.float32) * (1.0 if x.ndim == 1 else 8.0)).astype(x.dtype),
                          model.init_params(jax.random.key(1)))
    apply = jax.jit(model.apply)
    tokens = jax.random.randint(jax.random.key(2), (batch, 185), 0, cfg.vocab_size)
    _, cache = apply(params, tokens[:, :181], model.init_cache(batch, 256))
    block = tokens[:, 181:185]
    logits_block, _ = apply(params, block, cache)
    c, rows, unpadded = cache, [], []
    for t in range(4):
        before = c.lengths_B
        logits, c = apply(params, jnp.repeat(block[:, t:t + 1], 4, axis=1), c)
        c = c.rollback(before + 1)
        rows.append(logits[:, :1])
    c2, ones = cache, []
    for t in range(4):
        logits, c2 = apply(params, block[:, t:t + 1], c2)
        ones.append(logits)
    padded = jnp.concatenate(rows, 1)
    plain = jnp.concatenate(ones, 1)
    return {"batch": batch, "mismatches_padded": int(jnp.sum(padded != logits_block)),
            "mismatches_one_token_steps": int(jnp.sum(plain != logits_block)), "logits": int(padded.size)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--presets", default="8b,1b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=480.0)
    a = ap.parse_args(argv)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    meta = {"device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
            "jax": jax.__version__, "commit": _commit()}
    f = open(out / "accelerator.jsonl", "a")

    def write(kind, **rec):
        row = {"kind": kind, **meta, **rec}
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(row), flush=True)

    def left() -> bool:
        return time.time() - start < a.seconds

    bw = bandwidth_bytes_per_s()
    write("bandwidth", bytes_per_s=bw)
    for B in (1, 2):
        write("bitwise", **bitwise(B))
    for size in a.presets.split(","):
        for layout in ("new", "old"):
            if not left():
                break
            model, params = _model(size, layout)
            block = a.gamma + 1 if LAYOUTS[layout]["block"] == -1 else 0
            for B in (int(b) for b in a.batches.split(",")):
                if not left():
                    break
                try:
                    d = decode(model, params, B, a.context, a.steps, block)
                except Exception as e:  # noqa: BLE001 - an out-of-memory batch is a result
                    write("decode", preset=size, layout=layout, batch=B, error=" ".join(str(e).split())[:300])
                    continue
                write("decode", preset=size, layout=layout, batch=B, block=block, **d,
                      roofline=d["bytes_per_step"] / d["step_s"] / bw)
            if not left():
                break
            costs = verify_costs(model, params, 1, a.context)
            write("verify", preset=size, layout=layout, batch=1, seconds=costs,
                  over_step={k: v / costs[1] for k, v in costs.items()})
            rc = analysis.RoundCost(draft_s=0.05 * costs[1], verify_s=costs)
            write("cost_model", preset=size, layout=layout, draft_step_over_target=0.05,
                  speedup={str(alpha): {str(g): rc.predicted_speedup(alpha, g, costs[1]) for g in range(1, 8)}
                           for alpha in (0.6, 0.7, 0.8, 0.9)})
            del model, params
    f.close()


if __name__ == "__main__":
    main()
