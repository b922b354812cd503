"""The decoding engine on a device mesh (issue 15): with 8 simulated CPU devices
(``--xla_force_host_platform_device_count=8``, in a subprocess so the rest of the suite keeps
one device), speculative generation on data x model, model-only and data-only meshes returns
exactly the tokens of the single-device run, greedy and sampled (the same per-request keys):
prompt lookup (greedy), an early-exit draft (sampled) and a separate draft model (both) on a
4 x 2 mesh, and the draft model greedy also on 1 x 8 and 8 x 1; the weights and the loop
state are really sharded (checked on their `NamedSharding` specs); `decoding.generate_batched`
(whose runs consume their prefills) gives the single-device tokens on the 4 x 2 mesh.

Exactness here is equality: the tiny random target's greedy choices beat the runner-up by far
more than the rounding differences of sharded matmuls (~1e-7; the script checks the margin),
and a sampled token or an accept/reject decision could only flip if its uniform fell within
that rounding of a boundary (probability ~1e-6 per decision; the keys are fixed, so the
outcome is deterministic). The subprocess compiles with XLA's backend code generation turned
down (`_bench_run.FAST_COMPILE_XLA_FLAGS`: the same optimized HLO up to a few fusion decisions,
compiled in a fraction of the time); the reference runs are compiled in that process too, so the
comparison is like for like."""
import os
import subprocess
import sys
import textwrap

from _bench_run import FAST_COMPILE_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from specjax import decoding, drafters, models, sampling, sharding
    sys.path.insert(0, "tests")      # (run from the repository root)
    from _multiprocess_common import tiny_pair
    assert jax.device_count() == 8, jax.devices()
    target, tp, small, sp = tiny_pair()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 96, n)) for n in (3, 9, 5, 12, 1, 7, 4, 10)]
    ee, ep = drafters.EarlyExitDrafter.from_target(target, tp, 1)
    setups = {"ngram": (drafters.NGramDrafter(vocab_size=96), None), "early_exit": (ee, ep),
              "model": (drafters.ModelDrafter(small), sp)}
    samplings = {"greedy": sampling.SamplingConfig.make(0.0),
                 "T1_top_p0.9": sampling.SamplingConfig.make(temperature=1.0, top_p=0.9)}
    gen = decoding.GenerationConfig(max_new_tokens=12, gamma=3)
    batch = decoding.make_batch(prompts, gen, jax.random.key(7))
    # the margin the exactness claim rests on: greedy runner-up gaps of the reference target
    lg = jax.jit(lambda p, t: target.apply(p, t, None)[0])(tp, batch.prompt_BP)
    top2 = np.sort(np.asarray(lg), -1)[..., -2:]
    assert np.median(top2[..., 1] - top2[..., 0]) > 1e-3
    # every drafter on data x model (prompt lookup greedy, the early exit sampled, the draft
    # model both); the draft model also model-only and data-only, greedy
    cases = {("ngram", "greedy"): ((4, 2),), ("early_exit", "T1_top_p0.9"): ((4, 2),),
             ("model", "greedy"): ((4, 2), (1, 8), (8, 1)), ("model", "T1_top_p0.9"): ((4, 2),)}
    checked = 0
    for (name, sname), shapes in cases.items():
        (dr, dp), samp = setups[name], samplings[sname]
        params = decoding.EngineParams(target=tp, draft=dp)
        ref = decoding.Engine(target, dr, gen).run(params, samp, batch)
        for shape in shapes:
            eng = decoding.Engine(target, dr, gen, mesh=sharding.make_mesh(*shape))
            p2, b2 = eng.place(params, batch)
            out = eng.run(p2, samp, b2)
            np.testing.assert_array_equal(np.asarray(out.tokens_BS), np.asarray(ref.tokens_BS),
                                          err_msg=f"{name} {sname} mesh {shape}")
            np.testing.assert_array_equal(np.asarray(out.lengths_B), np.asarray(ref.lengths_B))
            np.testing.assert_array_equal(np.asarray(out.metrics.accepted_B), np.asarray(ref.metrics.accepted_B))
            checked += 1
    # The placement is real: on the 4 x 2 mesh the MLP and head weights split over "model",
    # the batch rows and the loop state's caches over "data" (kv heads over "model").
    eng = decoding.Engine(target, setups["model"][0], gen, mesh=sharding.make_mesh(4, 2))
    p2, b2 = eng.place(decoding.EngineParams(target=tp, draft=sp), batch)
    assert "model" in tuple(p2.target["layers"][0]["w_up"].sharding.spec), p2.target["layers"][0]["w_up"].sharding
    assert tuple(b2.prompt_BP.sharding.spec)[0] == "data"
    st = eng.init(p2, b2)
    k0 = st.target_cache.k[0]
    assert tuple(k0.sharding.spec)[:2] == ("data", "model"), k0.sharding
    assert tuple(st.tokens_BS.sharding.spec)[0] == "data"
    assert tuple(st.draft_state.cache.k[0].sharding.spec)[:2] == ("data", "model")
    assert len(k0.addressable_shards) == 8 and k0.addressable_shards[0].data.shape[0] == 2
    # The data engine's path on the mesh: length-sorted batches whose runs consume their
    # prefills (donated sharded buffers, every one usable: a warning fails), the tokens of the
    # single-device run.
    import warnings
    p2 = eng.place_params(decoding.EngineParams(target=tp, draft=sp))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = {r.index: r.tokens for results, _ in decoding.generate_batched(
            eng, p2, prompts, samplings["greedy"], jax.random.key(7), batch_size=8) for r in results}
    ref = decoding.Engine(target, setups["model"][0], gen).run(
        decoding.EngineParams(target=tp, draft=sp), samplings["greedy"], batch).generated()
    assert got == dict(enumerate(ref)), (got, ref)
    print("OK", checked)
""")


def test_sharded_speculative_generation_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 " + FAST_COMPILE_XLA_FLAGS,
               JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "OK 6" in r.stdout, r.stdout
