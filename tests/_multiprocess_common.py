"""The work of tests/test_multiprocess.py, shared by the test (one process, one device: the
training) and each process of the 2-process job (`_multiprocess_job.py`, whose process 0 also
runs the one-device generation)."""
import pathlib

import jax
import numpy as np

import _distill_toy as toy

STEPS = 12


def distill_config(root: pathlib.Path, run: str):
    """The toy distillation, with a held-out evaluation every 6 steps (on the fixed toy set) and an
    export at the end; on several devices FSDP over all of them (fsdp=-1: with one device per
    process the draft's weights and Adam moments are split across the processes)."""
    c = toy.config(target_dir=root / "target", data_path=root / "data.jsonl", data_root=root / "data_root",
                   budget=STEPS * 150, checkpoint_every=4, export_dir=root / f"{run}-export")
    c.keep_checkpoints = 100
    c.eval.every, c.eval.data_jsonl, c.eval.at_start = 6, str(root / "data.jsonl"), False
    c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, -1, 1
    return c


def tiny_pair():
    """(target, its params, a 1-layer draft model, its params): a tiny random Llama pair whose
    greedy choices beat the runner-up by far more than sharded-matmul rounding (weights x 4);
    also the pair of tests/test_sharded_engine.py."""
    from specjax import models
    cfg = models.ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=64, max_position=256, scan_layers=False)
    target = models.Llama(cfg)
    tp = jax.tree.map(lambda x: 4 * x, target.init_params(jax.random.key(0)))
    small = models.Llama(cfg.replace(num_layers=1))
    sp = jax.tree.map(lambda x: 4 * x, small.init_params(jax.random.key(1)))
    return target, tp, small, sp


def generate(mesh=None) -> dict:
    """Speculative generation with a draft model on a tiny random target, greedy and T = 1
    top-p 0.9 (per-request keys); on ``mesh`` when given. Tokens, lengths and accepted counts."""
    from specjax import decoding, drafters, sampling, sharding
    target, tp, small, sp = tiny_pair()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 96, n)) for n in (3, 9, 5, 12, 1, 7)]
    gen = decoding.GenerationConfig(max_new_tokens=12, gamma=3)
    batch = decoding.make_batch(prompts, gen, jax.random.key(7))
    params = decoding.EngineParams(target=tp, draft=sp)
    out = {}
    for name, samp in (("greedy", sampling.SamplingConfig.make(0.0)),
                       ("T1_top_p0.9", sampling.SamplingConfig.make(temperature=1.0, top_p=0.9))):
        eng = decoding.Engine(target, drafters.ModelDrafter(small), gen, mesh=mesh)
        p, b = eng.place(params, batch) if mesh is not None else (params, batch)
        o = eng.run(p, samp, b)
        host = sharding.to_host((o.tokens_BS, o.lengths_B, o.metrics.accepted_B))
        out[name] = [np.asarray(h).tolist() for h in host]
        if mesh is not None:
            assert tuple(b.prompt_BP.sharding.spec)[0] == "data" and not b.prompt_BP.is_fully_addressable
    return out
