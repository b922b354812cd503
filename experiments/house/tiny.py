"""Tiny checkpoints and data the traced commands run on (written once, before any tracing).

* ``pair/target`` and ``pair/draft``: a random 2-layer Llama target over SmolLM2's 49,152-token
  vocabulary and a 1-layer draft made of its first layer, as Hugging Face directories with
  SmolLM2's tokenizer.json (``generate`` and ``bench``);
* ``toy/target``: a random 3-layer Llama over 64 tokens, no tokenizer, and ``toy/data.jsonl``:
  fixed token sequences (``distill``);
* ``prompts.jsonl``: two bench prompts in two categories.

The same shapes as the test fixtures (tests/_cli_tiny.py, tests/_distill_toy.py), written with
the public API of the tree under trace.
"""

from __future__ import annotations

import json
import pathlib

PAIR_VOCAB = 49152
TOY_VOCAB = 64


def _scaled(params, factor: float):
    """Weights scaled up so that the random models' distributions are peaked."""
    import jax
    return jax.tree.map(lambda x: x * factor if x.ndim >= 2 else x, params)


def write_pair(directory) -> tuple[pathlib.Path, pathlib.Path]:
    """(target_dir, draft_dir) under `directory`."""
    import jax

    from specjax import models
    d = pathlib.Path(directory)
    cfg = models.ModelConfig(vocab_size=PAIR_VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=64, max_position=1024, tie_embeddings=True)
    target = models.Llama(cfg)
    params = _scaled(target.init_params(jax.random.key(0)), 6.0)
    models.export_hf(target, params, d / "target")
    draft_params, draft_cfg = models.truncate_layers(params, target.config, 1)
    models.export_hf(models.Llama(draft_cfg), draft_params, d / "draft")
    tok = models.load_tokenizer("smollm2-135m-instruct")
    for sub in ("target", "draft"):
        tok.save(d / sub)
    return d / "target", d / "draft"


def write_toy(directory, n: int = 48, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """(target_dir, data_jsonl) under `directory`."""
    import jax
    import numpy as np

    from specjax import models
    d = pathlib.Path(directory)
    cfg = models.ModelConfig(vocab_size=TOY_VOCAB, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=64, max_position=256)
    model = models.Llama(cfg)
    models.export_hf(model, _scaled(model.init_params(jax.random.key(0)), 8.0), d / "target")
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        tokens = rng.integers(0, TOY_VOCAB, int(rng.integers(12, 60))).tolist()
        lines.append(json.dumps({"tokens": tokens, "prompt_length": int(rng.integers(1, 8))}))
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    return d / "target", d / "data.jsonl"


def write_prompts(path) -> pathlib.Path:
    p = pathlib.Path(path)
    p.write_text("\n".join(json.dumps(r) for r in (
        {"question_id": 7, "category": "alpha", "turns": ["Count from one to ten."]},
        {"prompt": "Name three colours.", "category": "beta"})) + "\n")
    return p


def write_all(directory) -> dict:
    """Every fixture under `directory`; their paths by name."""
    d = pathlib.Path(directory)
    target, draft = write_pair(d / "pair")
    toy_target, toy_data = write_toy(d / "toy")
    prompts = write_prompts(d / "prompts.jsonl")
    return {"target": str(target), "draft": str(draft), "toy_target": str(toy_target), "toy_data": str(toy_data),
            "prompts": str(prompts)}
