"""Sharding: logical-axis rules, and a 2-device CPU mesh smoke test (in a subprocess, so the
rest of the suite keeps one device; compiled with XLA's backend code generation turned down,
`_bench_run.FAST_COMPILE_XLA_FLAGS`, as its one-device reference in the same process)."""
import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.models import KVCache, Llama, ModelConfig
from specjax.models.kv_cache import logical_axes

from _bench_run import FAST_COMPILE_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_logical_to_spec_rules():
    assert sharding.logical_to_spec(("layers", "embed", "heads")) == P(None, None, "model")
    assert sharding.logical_to_spec(("batch", "kv"), rules=(("batch", "data"),)) == P("data", None)
    # the same mesh axis is used at most once per tensor
    assert sharding.logical_to_spec(("vocab", "mlp")) == P("model", None)
    # unknown names and None stay replicated
    assert sharding.logical_to_spec(("foo", None)) == P(None, None)
    c = ModelConfig(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, ffn_size=16)
    axes = Llama(c).param_logical_axes()
    assert axes["embed"] == ("vocab", "embed")
    stacked = logical_axes(KVCache.zeros(3, 2, 1, 8, 4))
    assert stacked.k == ("layers", "batch", "kv", "sequence", "head_dim")
    assert stacked.v == ("layers", "batch", "kv", "head_dim", "sequence")
    per_layer = logical_axes(KVCache.zeros(3, 2, 1, 8, 4, per_layer=True))
    assert per_layer.v == (("batch", "kv", "head_dim", "sequence"),) * 3


def test_shard_params_names_a_layout_mismatch():
    import jax
    import pytest
    c = ModelConfig(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=4, ffn_size=16)
    stacked = Llama(c).init_params(jax.random.key(0))
    unrolled = Llama(c.replace(scan_layers=False))
    mesh = sharding.make_mesh(data=1, model=1)
    with pytest.raises(ValueError, match=r"model\.prepare_params\(params\)"):
        sharding.shard_params(stacked, unrolled, mesh)
    placed = sharding.shard_params(unrolled.prepare_params(stacked), unrolled, mesh)
    assert isinstance(placed["layers"], tuple)


_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from specjax import sharding
    from specjax.models import Llama, ModelConfig
    assert jax.device_count() == 2, jax.devices()
    c = ModelConfig(vocab_size=98, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, ffn_size=64, attention_bias=True, tie_embeddings=False)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 98, (2, 9)))
    for scan, fuse, meshes in ((True, False, ((1, 2), (2, 1))), (False, False, ((1, 2), (2, 1))),
                               (False, True, ((1, 2),))):
        model = Llama(c.replace(scan_layers=scan, fuse_projections=fuse))
        params = jax.tree.map(lambda x: 3 * x, model.init_params(jax.random.key(0)))
        def run(p, cache):
            step = jax.jit(model.apply)
            a, cache = step(p, toks[:, :6], cache, jnp.asarray([6, 4]))
            b, cache = step(p, toks[:, 6:7], cache.rollback(jnp.asarray([6, 4])))
            return np.asarray(a), np.asarray(b), np.asarray(cache.lengths_B)
        ref = run(params, model.init_cache(2, 16))
        for data, mdl in meshes:
            mesh = sharding.make_mesh(data=data, model=mdl)
            ps = model.prepare_params(params)
            assert ("wqkv" in (ps["layers"] if scan else ps["layers"][0])) == fuse
            sp = sharding.shard_params(ps, model, mesh)
            sc = sharding.shard_cache(model.init_cache(2, 16), mesh)
            assert sc.per_layer == (not scan)
            k0, off = (sc.k, 1) if scan else (sc.k[0], 0)      # [L, B, K, S, H] or [B, K, S, H]
            if mdl == 2:
                assert sp["lm_head"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
                assert len(sp["embed"].sharding.device_set) == 2
                assert k0.sharding.spec[off + 1] == "model"
            else:
                assert k0.sharding.spec[off] == "data"
            got = run(sp, sc)
            for r, g in zip(ref, got):
                np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-5)
    print("SHARDING_OK")
""")


def test_two_device_cpu_mesh_matches_single_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), FAST_COMPILE_XLA_FLAGS,
                                 "--xla_force_host_platform_device_count=2"]).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "SHARDING_OK" in proc.stdout, proc.stderr[-4000:]


def _fake_devices(n):
    """Stand-ins for n devices: building a Mesh and reading its shape needs nothing else."""
    import collections
    Dev = collections.namedtuple("Dev", "id")
    return [Dev(i) for i in range(n)]


def test_mesh_from_config_fills_the_rest_and_names_bad_shapes():
    devs = _fake_devices(8)
    for spec, want in (({"data": -1, "fsdp": 1, "model": 1}, (8, 1, 1)), ({"data": 2, "fsdp": -1, "model": 2}, (2, 2, 2)),
                       ({"data": 1, "fsdp": 4, "model": 2}, (1, 4, 2))):
        m = sharding.mesh_from_config(spec, devices=devs)
        assert tuple(m.shape.values()) == want and m.axis_names == ("data", "fsdp", "model")
    for spec, words in (({"data": 3, "fsdp": 1, "model": 1}, "covers 3 devices, this job has 8"),
                        ({"data": -1, "fsdp": -1, "model": 1}, "at most one may be -1"),
                        ({"data": 0, "fsdp": 1, "model": 1}, "data=0"),
                        ({"data": -1, "fsdp": 3, "model": 1}, "not a multiple of 3")):
        with pytest.raises(ValueError, match=words):
            sharding.mesh_from_config(spec, devices=devs)


def test_fsdp_spec_and_size_one_axes():
    mesh = sharding.make_mesh(1, 2, _fake_devices(8), fsdp=4)
    assert sharding.fsdp_spec((576, 8192), mesh) == P(None, "fsdp")       # the largest dim fsdp divides
    assert sharding.fsdp_spec((8192, 578), mesh) == P("fsdp", None)
    assert sharding.fsdp_spec((577, 8191), mesh) == P()                  # none divides: replicated
    assert sharding.fsdp_spec((576,), mesh) == P()                       # small: replicated
    # axes of size 1 are never named, so specs do not depend on whether the mesh has them
    m1 = sharding.make_mesh(8, 1, _fake_devices(8))
    assert sharding.logical_to_spec(("batch", "kv"), sharding.DEFAULT_RULES, m1, (8, 4)) == P("data", None)
    # a mesh axis serves one dimension: the batch takes fsdp (data has size 1), so embed stays whole
    assert sharding.logical_to_spec(("batch", "embed"), sharding.TRAIN_RULES, mesh, (8, 64)) == P("fsdp", None)


def test_distributed_settings_from_env():
    from specjax import distributed
    assert distributed.settings_from_env({}) == {}
    env = {"SPECJAX_COORDINATOR": "127.0.0.1:1234", "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": "1"}
    assert distributed.settings_from_env(env) == {"coordinator_address": "127.0.0.1:1234", "num_processes": 2,
                                                  "process_id": 1}
    for bad, words in (({"SPECJAX_COORDINATOR": "127.0.0.1:1"}, "SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID not"),
                       ({**env, "SPECJAX_PROCESS_ID": "2"}, r"must be in \[0, SPECJAX_NUM_PROCESSES=2\)"),
                       ({**env, "SPECJAX_NUM_PROCESSES": "two"}, "must be integers"),
                       ({**env, "SPECJAX_COORDINATOR": "localhost"}, "host:port")):
        with pytest.raises(ValueError, match=words):
            distributed.settings_from_env(bad)
