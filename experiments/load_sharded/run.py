"""A checkpoint too big to copy: peak host memory and time of reading ~1.1B parameters onto 8
simulated devices, slice by slice (`sharding.load_sharded`) against the whole-checkpoint path
(`models.load` then `sharding.shard_params`).

    python -m experiments.load_sharded.run --out=experiments/load_sharded/results   # ~3 min, ~10 GB RAM

Writes a synthetic Llama-shaped checkpoint (random bfloat16, `model-0000i-of-0000n.safetensors`
+ index, ~500 MB files) to --ckpt (kept if present), then runs each path in its own process
with `--xla_force_host_platform_device_count=8` (a mesh of 8 on the model axis) and records
its peak RSS (ru_maxrss), its peak anonymous memory (RssAnon sampled every 2 ms: RSS also
counts the pages of the memory-mapped safetensors files, page cache that can be reclaimed),
both before loading, the bytes of the placed shards and the wall time, one JSON line per path,
with the CPU model. Simulated devices live in host memory, so the placed shards count in both
peaks; what differs is the transient memory above them.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys

from absl import app, flags

flags.DEFINE_string("out", "experiments/load_sharded/results", "results folder")
flags.DEFINE_string("ckpt", "/tmp/specjax-synthetic-1b", "where the synthetic checkpoint is written")
FLAGS = flags.FLAGS

# Llama-3.2-1B-like widths with 16 layers and a 32k vocabulary: 1.14B parameters
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
FILE_BYTES = 500 * 2 ** 20


def write_checkpoint(path: pathlib.Path) -> int:
    """The synthetic checkpoint; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file
    s = SHAPE
    D, F, V, hd = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["head_dim"]
    Q, KV = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (Q, D), p + "self_attn.k_proj.weight": (KV, D),
                       p + "self_attn.v_proj.weight": (KV, D), p + "self_attn.o_proj.weight": (D, Q),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    total = sum(2 * int(torch.Size(sh).numel()) for sh in shapes.values())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return total
    path.mkdir(parents=True, exist_ok=True)
    files, current, size = [], {}, 0
    gen = torch.Generator().manual_seed(0)
    for name, sh in shapes.items():
        current[name] = sh
        size += 2 * int(torch.Size(sh).numel())
        if size >= FILE_BYTES:
            files.append(current)
            current, size = {}, 0
    if current:
        files.append(current)
    weight_map = {}
    for k, group in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {n: (torch.ones(sh) if len(sh) == 1 else 0.02 * torch.randn(sh, generator=gen)).to(torch.bfloat16)
                   for n, sh in group.items()}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "hidden_act": "silu",
              "dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


_CHILD = """
import json, resource, sys, threading, time
import jax
from specjax import models, sharding
path, how = sys.argv[1], sys.argv[2]

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak = [0]
stop = threading.Event()

def sample():                      # the peak of anonymous memory (file pages of the mapped
    while not stop.is_set():       # safetensors are page cache, counted by RSS but reclaimable)
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

mesh = sharding.make_mesh(data=1, model=8)
jax.block_until_ready(jax.device_put(0))
before_anon = anon()
before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
if how == "load_sharded":
    model, params = sharding.load_sharded(path, mesh, dtype="bfloat16")
else:
    model, params = models.load(path, dtype="bfloat16")
    params = sharding.shard_params(params, model, mesh)
jax.block_until_ready(params)
dt = time.perf_counter() - t0
stop.set()
time.sleep(0.01)
resident = sum(sh.data.nbytes for x in jax.tree.leaves(params) for sh in x.addressable_shards)
print(json.dumps({"path": how, "mesh": dict(mesh.shape), "seconds": round(dt, 2),
                  "anon_before_bytes": before_anon, "peak_anon_bytes": peak[0],
                  "rss_before_bytes": before_rss,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "placed_bytes": resident, "devices": jax.device_count(),
                  "num_params": sum(x.size for x in jax.tree.leaves(params))}))
"""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(_):
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = pathlib.Path(FLAGS.ckpt)
    total = write_checkpoint(ckpt)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    rows = []
    for how in ("load_sharded", "load_then_shard"):
        r = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), how], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"{how} failed:\n{r.stderr[-4000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row.update(checkpoint_bytes=total, cpu=cpu_model(), cores=os.cpu_count())
        # host memory above the placed shards at the peak (anonymous memory: what cannot be reclaimed)
        row["transient_anon_bytes"] = row["peak_anon_bytes"] - row["anon_before_bytes"] - row["placed_bytes"]
        rows.append(row)
        print(json.dumps(row))
    with open(out / "results.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    app.run(main)
