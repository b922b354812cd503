"""A tiny random target written as a Hugging Face checkpoint, fixed token data, and a
distillation config over them (no tokenizer, no network)."""
import json
import pathlib

import jax
import numpy as np

VOCAB = 64


def write_target(directory) -> pathlib.Path:
    from specjax import models
    cfg = models.ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=64, max_position=256)
    model = models.Llama(cfg)
    params = model.init_params(jax.random.key(0))
    # Larger weights than the init's 0.02 so that the toy target's distributions are peaked.
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)
    d = pathlib.Path(directory)
    models.export_hf(model, params, d)
    return d


def write_data(path, n: int = 48, seed: int = 0) -> pathlib.Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(rng.integers(12, 60))
            toks = rng.integers(0, VOCAB, length).tolist()
            f.write(json.dumps({"tokens": toks, "prompt_length": int(rng.integers(1, 8))}) + "\n")
    return pathlib.Path(path)


def write_shards(root, data_path, per_shard=6) -> list[str]:
    """The toy data set as two data-engine stages (shard directories ``stage0``, ``stage1``),
    alternate sequences in each, loss bits after each prompt."""
    from specjax.distill import shards
    recs = [json.loads(line) for line in pathlib.Path(data_path).read_text().splitlines()]
    dirs = []
    for d, part in enumerate((recs[0::2], recs[1::2])):
        sd = shards.ShardDir(pathlib.Path(root) / f"stage{d}", {"stage": d}, vocab_size=VOCAB, sources=["toy"])
        for k in range(0, len(part), per_shard):
            chunk = part[k:k + per_shard]
            sd.write(k // per_shard, shards.Sequences(
                [np.asarray(r["tokens"]) for r in chunk],
                [np.arange(len(r["tokens"])) >= r["prompt_length"] for r in chunk], ["toy"] * len(chunk),
                list(range(k, k + len(chunk)))))
        dirs.append(str(pathlib.Path(root) / f"stage{d}"))
    return dirs


def overrides(target_dir, data_path, data_root, *, budget=4000, head_vocab=0, divergence="fkl",
              checkpoint_every=5, export_dir="") -> dict:
    return {
        "target": str(target_dir), "data_root": str(data_root),
        "data.target_weight": 0.0, "data.fixed_weight": 1.0, "data.fixed_jsonl": str(data_path),
        "data.widths": (32, 64), "data.tokens_per_batch": 256,
        "draft.layers": (0,), "draft.head_vocab": head_vocab,
        "loss.divergence": divergence, "optim.learning_rate": 3e-3, "optim.warmup_steps": 3,
        "budget_tokens": budget, "checkpoint_every": checkpoint_every, "eval.every": 0, "progress": False,
        "export_dir": str(export_dir), "export_dtype": "float32",
    }


def config(**kw):
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from configs import distill
    from specjax.distill import with_overrides
    return with_overrides(distill.get_config(), overrides(**kw))


def cli_flags(**kw) -> list[str]:
    out = []
    for k, v in overrides(**kw).items():
        out.append(f"--config.{k}={v}")
    return out
