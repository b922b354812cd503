"""`specjax aot`: TPU programs compiled on this CPU (libtpu, no TPU), and the HLO byte model.

The byte model is calibrated against programs whose traffic is known: a lone ``x @ W`` reads W
once; a ``lax.scan`` over L layers reads what the same layers unrolled read (XLA's own figure
counts the loop body once). Then the project's own programs are compiled for a TPU topology
from a tiny preset, every row is checked for its figures, and bad settings are one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import aot, sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# libtpu comes with the test extra (setup.py): without it these tests fail with the command's
# own line naming the install, not a skip.


@pytest.fixture(scope="module")
def v5e():
    chip, devices = aot.topology_devices("v5e:2x2")
    return chip, sharding.make_mesh(1, 4, devices)


def _compiled(fn, *args):
    with aot.without_persistent_cache():
        return jax.jit(fn).lower(*args).compile()


def _sds(shape, mesh, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_lone_matmul_reads_its_weight_once(v5e):
    _, mesh = v5e
    x = _sds((1, 1024), mesh, P())
    w = _sds((1024, 4096), mesh, P(None, "model"))
    compiled = _compiled(lambda x, w: x @ w, x, w)
    per_device_w = 1024 * 4096 * 2 / 4
    got = aot.traffic(aot.parse_module(compiled.as_text())).bytes
    assert 0.98 <= got / per_device_w <= 1.05, got / per_device_w
    assert 0.98 <= compiled.cost_analysis()["bytes accessed"] / per_device_w <= 1.05


def _layers(scan: bool, L=8, D=512, F=2048):
    def f(x, w1, w2):
        def layer(h, ws):
            a, b = ws
            return jnp.tanh((h @ a) @ b), None
        if scan:
            return jax.lax.scan(layer, x, (w1, w2))[0]
        for i in range(L):
            x, _ = layer(x, (w1[i], w2[i]))
        return x
    return f


def test_scan_counts_each_layer_like_the_unrolled_loop(v5e):
    """32 layers of two matmuls under `lax.scan`: XLA's figure counts the body once (a tiny
    fraction of the weights); the trip-count walk gives what the unrolled program reads."""
    _, mesh = v5e
    L, D, F = 8, 512, 2048
    x = _sds((1, D), mesh, P())
    w1 = _sds((L, D, F), mesh, P(None, None, "model"))
    w2 = _sds((L, F, D), mesh, P(None, "model", None))
    weights = 2 * L * D * F * 2 / 4
    scan = _compiled(_layers(True, L, D, F), x, w1, w2)
    unrolled = _compiled(_layers(False, L, D, F), x, w1, w2)
    t_scan = aot.traffic(aot.parse_module(scan.as_text()))
    t_unrolled = aot.traffic(aot.parse_module(unrolled.as_text()))
    assert [lp["trips"] for lp in t_scan.loops] == [L]
    assert abs(t_scan.bytes / t_unrolled.bytes - 1) < 0.05, (t_scan.bytes, t_unrolled.bytes)
    assert 0.95 <= t_unrolled.bytes / weights <= 1.2
    assert scan.cost_analysis()["bytes accessed"] < 0.5 * t_scan.bytes      # why the walk exists


HLO = """HloModule m, input_output_alias={ {0}: (1, {}, may-alias) }

%fused_slice (param_0: bf16[4,256,256], param_1: s32[]) -> bf16[256,256] {
  %param_0 = bf16[4,256,256]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = bf16[1,256,256]{2,1,0} dynamic-slice(%param_0, %param_1, %c0, %c0), dynamic_slice_sizes={1,256,256}
  ROOT %b = bf16[256,256]{1,0} bitcast(%ds)
}

%body (p: (s32[], bf16[4,256,256], f32[256])) -> (s32[], bf16[4,256,256], f32[256]) {
  %p = (s32[], bf16[4,256,256]{2,1,0}, f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[4,256,256]{2,1,0} get-tuple-element(%p), index=1
  %h = f32[256]{0} get-tuple-element(%p), index=2
  %slice = bf16[256,256]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %hh = f32[256]{0} copy(%h)
  ROOT %t = (s32[], bf16[4,256,256]{2,1,0}, f32[256]{0}) tuple(%next, %w, %hh)
}

%cond (q: (s32[], bf16[4,256,256], f32[256])) -> pred[] {
  %q = (s32[], bf16[4,256,256]{2,1,0}, f32[256]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: bf16[4,256,256], b: f32[256]) -> f32[256] {
  %a = bf16[4,256,256]{2,1,0} parameter(0)
  %b = f32[256]{0:S(1)} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], bf16[4,256,256]{2,1,0}, f32[256]{0}) tuple(%z, %a, %b)
  %loop = (s32[], bf16[4,256,256]{2,1,0}, f32[256]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[256]{0} get-tuple-element(%loop), index=2
}
"""


def test_byte_model_on_a_written_module():
    """Per trip: the fusion reads one 256 x 256 bf16 slice (not the stacked 4 layers) and
    writes it (128 KiB + 128 KiB), the copy 1 KiB + 1 KiB; 4 trips; the compare's scalars add
    a few bytes. An S(1) (on-chip) array is not HBM traffic."""
    module = aot.parse_module(HLO)
    tr = aot.traffic(module)
    assert [lp["trips"] for lp in tr.loops] == [4]
    per_trip = 2 * 256 * 256 * 2 + 2 * 256 * 4
    assert per_trip * 4 <= tr.bytes <= per_trip * 4 + 200, tr.bytes
    assert module.aliased_parameters() == {1}
    assert aot.parse_type("(bf16[2,3]{1,0:T(8,128)(2,1)S(1)}, s32[])") == [
        aot.Array("bf16", (2, 3), 1), aot.Array("s32", (), 0)]


def test_lint_names_a_per_layer_weight_copy():
    """The written loop materializes each layer's slice in HBM before using it (what the GPU
    compiler's dynamic-slice fusions do before a GEMM): a ``weight_copy`` per trip. The same
    slice streamed into on-chip memory (``S(1)``, how a TPU feeds an operand) is clean; a copy
    of the whole stacked buffer is a ``cache_copy`` when that is a cache's size."""
    size = 256 * 256 * 2

    def findings(text):
        module = aot.parse_module(text)
        return aot.lint(module, aot.traffic(module), weight_bytes=[size], cache_bytes=[4 * size], min_bytes=size // 2)

    (found,) = findings(HLO)
    assert found.rule == "weight_copy" and "x4" in found.detail and 0 <= found.bytes - 4 * 2 * size <= 64
    on_chip = HLO.replace("%slice = bf16[256,256]{1,0} fusion", "%slice = bf16[256,256]{1,0:S(1)} fusion")
    assert findings(on_chip) == []
    stacked = on_chip.replace("  %one = s32[] constant(1)\n",
                              "  %all = bf16[4,256,256]{2,1,0} copy(%w)\n  %one = s32[] constant(1)\n")
    assert [f.rule for f in findings(stacked)] == ["cache_copy"]


def _settings(**kw):
    from configs import aot as aot_config
    from configs import generate_tpu
    c = aot_config.get_config()
    c.update(dict(target="tiny", programs=("prefill", "decode", "verify", "chain", "tree", "train_head"),
                  verify_ks=(4,), batch_sizes=(2,), context=120, capacity=256, prompt=64, train_batch=2,
                  train_seq=64, tree=(2, 2, 4)))
    c.update(kw)
    return aot.aot_settings(c, generate_tpu.get_config())


def test_tiny_programs_compile_for_a_tpu_topology():
    """Every program of a run compiles for v5e:2x2 from a tiny preset; each row carries its
    memory by kind, its bytes against the ideal, its collectives and its lint; the decode
    step's traffic is the weights plus the cache (the reference op reads every slot). (One
    verification width here; a row per width, and k = 1 compiled: the compiler-failure test.)"""
    rows = []
    aot.run(_settings(), emit=rows.append)
    names = [r["program"] for r in rows]
    assert names == ["prefill", "decode", "verify_k4", "chain_eagle3_g3", "tree_dynamic_2_2_4", "train_head"]
    for r in rows:
        assert r["fits"] and r["topology"] == "v5e:2x2" and r["devices"] == 4 and r["chip"] == "v5e", r
        m = r["memory"]
        assert m["total"] > 0 and m["hbm"] == 16 * 2**30
        assert r["bytes"] > 0 and r["flops"] > 0 and r["predicted_s"] > 0
        assert "host_transfer" not in r["lint"] and "weight_copy" not in r["lint"], r["lint"]
        json.dumps(r)
    decode = rows[1]
    assert decode["program"] == "decode" and decode["batch"] == 2
    assert decode["lint"] == {} and all(lp["trips"] for lp in decode["loops"])
    capacity_over_live = 256 / (120 + 1)       # the einsum op reads every slot
    assert 1.0 <= decode["bytes_over_ideal"] <= capacity_over_live + 0.3, decode["bytes_over_ideal"]
    assert decode["memory"]["alias"] > 0                       # the donated state is updated in place
    assert rows[-1]["ideal_bytes"] is None                     # training has no decode floor


def test_bad_settings_are_one_line_each(monkeypatch):
    with pytest.raises(aot.AotError, match=r"topology 'v9z:2x2': expected <chip>:<grid>"):
        aot.run(_settings(topology="v9z:2x2"))
    with pytest.raises(aot.AotError, match=r"topology 'v5e:7x7': libtpu does not know it"):
        aot.run(_settings(topology="v5e:7x7"))
    with pytest.raises(aot.AotError, match=r"target 'llama-9b': not a preset"):
        aot.run(_settings(target="llama-9b"))
    with pytest.raises(ValueError, match=r"config.programs"):
        _settings(programs=("decode", "sing"))
    with pytest.raises(ValueError, match=r"config.context: 252 committed tokens"):
        _settings(context=252)              # + the 5-token tree block: 257 slots of 256
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(aot.AotError, match=r"needs libtpu .* pip install"):
        aot.run(_settings())


def test_a_program_that_does_not_fit_is_a_row_not_a_crash():
    """Gemma-3-12B replicated on every chip (data parallel, model=1) needs ~24 GB of weights
    per 16 GiB chip: refused with its memory before anything compiles."""
    rows = []
    aot.run(_settings(target="gemma-3-12b", programs=("decode",), batch_sizes=(4,),
                      mesh=dict(data=4, fsdp=0, model=1)), emit=rows.append)
    (row,) = rows
    assert row["fits"] is False and row["memory"]["argument"] > row["memory"]["hbm"]
    assert "GiB per device" in row["error"]


def test_a_compiler_failure_is_a_row_and_the_next_program_goes_on(monkeypatch):
    """libtpu's own failure on a program (a RET_CHECK, as once on a batched cache write) is a
    row naming it, not a traceback that loses the programs after it: the first and the third
    program fail, the second (verify_k1) compiles. Two verification widths: a row per width."""
    import jax.stages
    real = jax.stages.Lowered.compile
    calls = []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) != 2:
            raise RuntimeError("INTERNAL: RET_CHECK failure (hlo_instruction.cc:3699) The shape doesn't match")
        return real(self, *a, **k)
    monkeypatch.setattr(jax.stages.Lowered, "compile", flaky)
    rows = []
    aot.run(_settings(programs=("decode", "verify"), verify_ks=(1, 4)), emit=rows.append)
    assert [r["program"] for r in rows] == ["decode", "verify_k1", "verify_k4"]
    for r in (rows[0], rows[2]):
        assert r["fits"] is None and r["error"].startswith("compiler error: INTERNAL: RET_CHECK")
        assert "not compiled" in aot.describe(r)
    assert rows[1]["fits"] is True and rows[1]["bytes"] > 0


def test_cli_prints_json_rows_and_one_line_errors():
    env = dict(os.environ, JAX_PLATFORMS="")
    base = [sys.executable, "-m", "specjax.cli", "aot", "--config=configs/aot.py"]
    out = subprocess.run(base + ["--config.topology=v5e:2x3x4x5"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "specjax: error: topology 'v5e:2x3x4x5'"), out.stderr
    assert "Traceback" not in out.stderr and "TPU_WORKER" not in out.stderr
    out = subprocess.run(base + ["--config.target=tiny", "--config.programs=('decode',)", "--config.capacity=256",
                                 "--config.context=100", "--config.prompt=64"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    row = json.loads(line)
    assert row["program"] == "decode" and row["fits"] and row["lint"] == {}
    assert "[specjax aot] decode b=1" in out.stderr
    assert "could not determine TPU" not in out.stderr and "E0000" not in out.stderr, out.stderr
