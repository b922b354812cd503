"""What is benchmarked: the target model, its prompts, and how to get the same model in transformers.

Two workloads:

* ``smollm2-135m-instruct`` (or any registry name / GGUF path): the model loaded by specjax from
  its GGUF (dequantized to float32), held-out Spec-Bench questions in the model's chat
  template (specjax's tokenizer), stop tokens from the tokenizer; transformers loads the very
  same GGUF file and receives the very same prompt token ids.
* ``tiny``: a small random Llama built in code for CI. With torch + transformers installed it
  is built as a transformers ``LlamaForCausalLM`` (seeded), saved as a Hugging Face checkpoint
  and loaded by specjax from that directory, so both frameworks run the same weights; without
  them it is a random specjax ``Llama`` and the transformers measurements are skipped. Prompts
  are random token ids (no tokenizer), one per selected held-out question (the question's id
  and category are kept so the per-category bookkeeping is the same), and there is no EOS.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

import numpy as np

from specjax import specbench

TINY = "tiny"


@dataclasses.dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    ids: tuple[int, ...]


@dataclasses.dataclass
class Workload:
    name: str
    target: Any                      # specjax Llama (hashable, static under jit)
    params: Any
    prompts: list[Prompt]
    eos_ids: tuple[int, ...]
    model_file: pathlib.Path         # the weights file whose sha256 is recorded
    model_sha256: str
    hf_factory: Callable[[], Any] | None   # returns a float32 transformers model, or None
    notes: str = ""

    @property
    def prompt_ids(self) -> list[int]:
        return [p.question_id for p in self.prompts]


def select_questions(num_prompts: int) -> list[specbench.Question]:
    """A fixed subset of the held-out Spec-Bench split: round-robin over the categories
    (in `specbench.CATEGORIES` order), taking each category's questions in id order; so
    26 prompts = the first 2 held-out questions of each of the 13 categories."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    by_cat: dict[str, list[specbench.Question]] = {c: [] for c in specbench.CATEGORIES}
    for q in sorted(specbench.load(split="held_out"), key=lambda q: q.question_id):
        by_cat.setdefault(q.category, []).append(q)
    out, rank = [], 0
    while len(out) < num_prompts:
        added = False
        for cat in specbench.CATEGORIES:
            if rank < len(by_cat[cat]) and len(out) < num_prompts:
                out.append(by_cat[cat][rank])
                added = True
        if not added:
            break
        rank += 1
    if len(out) < num_prompts:
        raise ValueError(f"only {len(out)} held-out questions exist, asked for {num_prompts}")
    return out


def load_registry_model(name: str, num_prompts: int, dtype: str = "float32", scan_layers: bool = False,
                        fuse_projections: bool = False) -> Workload:
    from specjax import build
    from specjax.models import registry
    from specjax.models.tokenizer import load_tokenizer

    path = registry.resolve(name)
    target, params = build.load_target(name, dtype=dtype, scan_layers=scan_layers, fuse_projections=fuse_projections)
    tok = load_tokenizer(name)
    prompts = []
    for q in select_questions(num_prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": q.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(Prompt(q.question_id, q.category, tuple(int(i) for i in ids)))

    def hf_factory():
        import torch
        import transformers
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    return Workload(name=name, target=target, params=params, prompts=prompts,
                    eos_ids=tuple(int(i) for i in tok.stop_token_ids), model_file=path,
                    model_sha256=registry.file_sha256(path), hf_factory=hf_factory,
                    notes=f"GGUF {path.name} dequantized to {dtype}; chat template applied")


TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)


def _tiny_prompts(num_prompts: int, vocab: int, seed: int) -> list[Prompt]:
    out = []
    for q in select_questions(num_prompts):
        rng = np.random.default_rng([seed, q.question_id])
        n = int(rng.integers(12, 48))
        # Low-entropy ids (a small alphabet) so prompt lookup finds some matches.
        ids = rng.integers(3, min(vocab, 64), size=n)
        out.append(Prompt(q.question_id, q.category, tuple(int(i) for i in ids)))
    return out


def load_tiny(num_prompts: int, workdir: pathlib.Path, seed: int = 0, with_transformers: bool = True,
              scan_layers: bool = False, fuse_projections: bool = False) -> Workload:
    from specjax.models import registry

    workdir = pathlib.Path(workdir)
    try:
        if not with_transformers:
            raise ImportError("transformers not requested")
        import torch
        import transformers
    except ImportError:
        torch = transformers = None

    if transformers is not None:
        from specjax.models import load
        ckpt = workdir / "tiny_llama_hf"
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(**TINY_CONFIG, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        hf_model = transformers.LlamaForCausalLM(cfg).eval()
        hf_model.generation_config.eos_token_id = None
        hf_model.generation_config.bos_token_id = None
        hf_model.generation_config.pad_token_id = 0
        hf_model.save_pretrained(str(ckpt))
        target, params = load(str(ckpt), dtype="float32", scan_layers=scan_layers, fuse_projections=fuse_projections)
        model_file = ckpt / "model.safetensors"

        def hf_factory():
            return hf_model

        notes = "random LlamaForCausalLM (transformers, seeded) saved as safetensors, loaded by both"
    else:
        import jax
        from specjax.models import Llama, ModelConfig
        c = TINY_CONFIG
        target = Llama(ModelConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                                   num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                                   num_kv_heads=c["num_key_value_heads"],
                                   head_dim=c["hidden_size"] // c["num_attention_heads"],
                                   ffn_size=c["intermediate_size"], rms_eps=c["rms_norm_eps"],
                                   scan_layers=scan_layers, fuse_projections=fuse_projections))
        params = target.init_params(jax.random.key(seed))
        workdir.mkdir(parents=True, exist_ok=True)
        model_file = workdir / "tiny_llama_params.npz"
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(model_file, **flat)
        params = target.prepare_params(params)
        hf_factory = None
        notes = "random specjax Llama (transformers not available: comparison skipped)"
    prompts = _tiny_prompts(num_prompts, target.vocab_size, seed)
    return Workload(name=TINY, target=target, params=params, prompts=prompts, eos_ids=(),
                    model_file=model_file, model_sha256=registry.file_sha256(model_file),
                    hf_factory=hf_factory, notes=notes + "; random prompt ids, no EOS")


LAYER_LOOPS = ("fused", "unrolled", "scan")   # fused = unrolled + fused projections


def load_workload(model: str, num_prompts: int, workdir: pathlib.Path, seed: int = 0,
                  with_transformers: bool = True, layers: str = "fused") -> Workload:
    """layers: 'fused' (unrolled, per-layer cache, fused q|k|v and gate|up: the fast path on
    CPU at batch 1), 'unrolled' (the same, unfused) or 'scan' (lax.scan over stacked layers)."""
    if layers not in LAYER_LOOPS:
        raise ValueError(f"layers must be one of {LAYER_LOOPS}, got {layers!r}")
    kw = dict(scan_layers=layers == "scan", fuse_projections=layers == "fused")
    if model == TINY:
        return load_tiny(num_prompts, workdir, seed, with_transformers, **kw)
    return load_registry_model(model, num_prompts, **kw)
