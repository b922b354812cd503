"""How fast this CPU multiplies in bfloat16 through XLA and through PyTorch (oneDNN), float32 beside.

    python -m experiments.heads.bf16_gemm [out.jsonl]

A head's training step is mostly matrix products of a few thousand tokens by the hidden size
(576 for SmolLM2) and the reduced vocabulary (8,192). For one such product with its backward
shapes ([4096, 576] x [576, 8192]: the forward, then the two gradient products, under
`jax.value_and_grad` of a log-sum-exp loss), the median GFLOP/s of 5 calls after one warm-up, in
float32 and bfloat16 (float32 accumulation), once with XLA's default CPU flags and once per flag
in `XLA_VARIANTS` (each in its own process: XLA reads its flags when the backend starts); then
the same forward product in PyTorch on the same 2 threads (oneDNN, which uses AMX for bfloat16
where the CPU has it). One JSONL record per (library, flags), with the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

XLA_VARIANTS = ("", "--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_custom_call=true",
                "--xla_cpu_use_xnnpack=true")
M, K, N = 4096, 576, 8192


def _xla_child() -> dict:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    out = {}
    for name in ("float32", "bfloat16"):
        dtype = jnp.dtype(name)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((M, K)), dtype)
        w = jnp.asarray(np.random.default_rng(1).standard_normal((K, N)) * 0.02, dtype)

        def loss(w, x):
            return jnp.sum(jax.nn.logsumexp(jnp.dot(x, w, preferred_element_type=jnp.float32), axis=-1))

        f = jax.jit(jax.value_and_grad(loss))
        jax.block_until_ready(f(w, x))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(w, x))
            ts.append(time.perf_counter() - t0)
        out[name] = 3 * 2 * M * K * N / float(np.median(ts)) / 1e9      # forward + two gradient products
    return out


def _torch() -> dict:
    import time

    import numpy as np
    import torch
    torch.set_num_threads(2)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
        for _ in range(2):
            a @ b
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        out[name] = 2 * M * K * N / float(np.median(ts)) / 1e9
    return out


def main(out_path: str = "experiments/heads/results/2026-12-07-bf16/gemm.jsonl") -> None:
    """Every measurement to ``out_path`` (`toolkit.Jsonl`: the file is replaced only when all of
    them are in; a run that fails leaves the earlier file as it was and its own records in
    ``<out_path>.partial``)."""
    from experiments.lib import toolkit
    prov = toolkit.provenance("experiments.heads.bf16_gemm", with_backend=False)
    out = toolkit.Jsonl(out_path, prov, setting="out")
    for flags in XLA_VARIANTS:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        res = subprocess.run([sys.executable, "-m", "experiments.heads.bf16_gemm", "--xla-child"], env=env,
                             capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"error: the XLA measurement with XLA_FLAGS={flags!r} failed: {tail}; "
                             f"{out_path} is unchanged")
        gflops = json.loads(res.stdout.strip().splitlines()[-1])
        out.write("gemm", library="xla", xla_flags=flags, shape=[M, K, N], gflops=gflops)
        print(f"xla {flags or '(default flags)'}: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in gflops.items()))
    gflops = _torch()
    out.write("gemm", library="torch", shape=[M, K, N], gflops=gflops)
    print("torch: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in gflops.items()))
    out.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["--xla-child"]:
        print(json.dumps(_xla_child()))
    else:
        from experiments.lib.toolkit import OutputError
        try:
            main(*sys.argv[1:2])
        except OutputError as e:         # one line, not a traceback
            sys.exit(f"error: {e}")
