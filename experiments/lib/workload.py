"""What is measured on: the target, its prompts, its drafters, and the same model for transformers.

* A registry name, GGUF path or HF checkpoint dir: the weights as specjax loads them (a GGUF
  dequantized to ``dtype``), held-out Spec-Bench questions in the model's chat template, stop
  tokens from the tokenizer; transformers loads the very same file and gets the same ids.
* ``preset:<size>``: random weights with the shapes of a real checkpoint (`PRESETS`), drawn
  leaf by leaf on the default device in ``dtype`` (no host or float32 copy of a large model).
  Prompts are random ids from a 64-token alphabet (so prompt lookup finds matches), one per
  selected held-out question (its id and category kept for the bookkeeping); no EOS. Small
  presets are also written as a Hugging Face checkpoint for the transformers comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import build, decoding, drafters, models, specbench

from experiments.lib import toolkit

_ROPE_1B_3B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# Shapes from the checkpoints' config.json; KNOWN_PARAMS: their published parameter counts.
PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_size=128, rope_theta=10000.0, max_position=2048),
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    ffn_size=1536, rope_theta=100000.0, max_position=8192),
    "1b": dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               ffn_size=8192, rope_theta=500000.0, rope_scaling=_ROPE_1B_3B, max_position=131072),
    "3b": dict(vocab_size=128256, hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
               ffn_size=8192, rope_theta=500000.0, rope_scaling=_ROPE_1B_3B, max_position=131072),
    "8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn_size=14336, rope_theta=500000.0, rope_scaling={**_ROPE_1B_3B, "factor": 8.0},
               tie_embeddings=False, max_position=131072),
}
KNOWN_PARAMS = {"smollm2": 134_515_008, "1b": 1_235_814_400, "3b": 3_212_749_824, "8b": 8_030_261_248}
SHAPES_OF = {"tiny": "(CI)", "smollm2": "SmolLM2-135M", "1b": "Llama-3.2-1B", "3b": "Llama-3.2-3B",
             "8b": "Llama-3.1-8B"}


@dataclasses.dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    ids: tuple[int, ...]


@dataclasses.dataclass
class Workload:
    name: str
    target: Any
    params: Any
    prompts: list[Prompt]
    eos_ids: tuple[int, ...]
    model_file: str | None
    model_sha256: str | None
    notes: str
    random_weights: bool
    hf_source: dict | None = None           # kwargs of transformers' from_pretrained, or None
    drafters: dict = dataclasses.field(default_factory=dict)


def check_workload(name: str, key: str = "config.workload") -> None:
    """ValueError naming `key` for an unknown ``preset:<size>`` (other names are checked on load)."""
    if name.startswith("preset:") and name.split(":", 1)[1] not in PRESETS:
        raise ValueError(f"{key}: unknown preset {name!r}; choose from {[f'preset:{k}' for k in PRESETS]}, "
                         f"or give a registry name, GGUF path or HF checkpoint dir")


def select_questions(n: int) -> list[specbench.Question]:
    """The first n held-out Spec-Bench questions round-robin over `specbench.CATEGORIES`, each
    category's in id order (26 = the first 2 of each of the 13 categories)."""
    by_cat = {c: sorted((q for q in specbench.load(split="held_out") if q.category == c), key=lambda q: q.question_id)
              for c in specbench.CATEGORIES}
    out = [qs[r] for r in range(max(map(len, by_cat.values()))) for qs in by_cat.values() if r < len(qs)][:n]
    if len(out) < n:
        raise ValueError(f"only {len(out)} held-out questions exist, asked for {n}")
    return out


# the benchmark's names of the target's parameter layouts (`specjax.models.llama`, "Layout")
LAYOUTS = ("packed", "fused", "unrolled", "scan")


def layout(name: str) -> dict:
    """The `ModelConfig` layout fields of a layout name (see LAYOUTS)."""
    if name not in LAYOUTS:
        raise ValueError(f"layers must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return dict(scan_layers=name == "scan", fuse_projections=name in ("fused", "packed"),
                linear_op="panels" if name == "packed" else "xla")


def layers_of(g) -> str:
    """The layout name of the target that a generation config (`configs/generate.py`) runs, as
    `specjax.build.load_generator` chooses it (``cpu_kernel`` resolved on this backend)."""
    s = g if isinstance(g, build.GenerateSettings) else build.generate_settings(g)
    if build.use_cpu_kernel(s):
        return "packed"
    return "scan" if s.scan_layers else ("fused" if s.fuse_projections else "unrolled")


def in_layout(target, params, name: str):
    """(model, params) of the same target in another layout (shared arrays where they match)."""
    model = models.Llama(target.config.replace(**layout(name)))
    return model, model.prepare_params(params)


def preset_config(size: str, dtype: str = "float32", scan_layers: bool = True, fuse_projections: bool = False,
                  linear_op: str = "xla"):
    if size not in PRESETS:
        raise ValueError(f"unknown preset {size!r}; choose from {sorted(PRESETS)}")
    return models.ModelConfig(**PRESETS[size], dtype=dtype, scan_layers=scan_layers, fuse_projections=fuse_projections,
                              linear_op=linear_op)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _normal(key, *, shape, dtype, std):
    return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)


def random_params(config, key, std: float = 0.02) -> dict:
    """Canonical random params in ``config.dtype`` on the default device: normal(0, std) weights,
    unit norms; one jitted program per leaf, so nothing larger than one leaf is ever a temporary."""
    dtype = jnp.dtype(config.dtype)
    shapes = models.param_shapes(config)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = [jnp.ones(s, dtype) if "norm" in jax.tree_util.keystr(p) else
              _normal(jax.random.fold_in(key, i), shape=tuple(s), dtype=dtype, std=float(std))
              for i, (p, s) in enumerate(paths)]
    return jax.tree.unflatten(treedef, leaves)


def _random_prompts(questions, prompt_len: int, vocab: int, seed: int) -> list[Prompt]:
    out = []
    for q in questions:
        rng = np.random.default_rng([seed, q.question_id])
        n = prompt_len or int(rng.integers(12, 48))
        out.append(Prompt(q.question_id, q.category, tuple(int(i) for i in rng.integers(3, min(vocab, 64), n))))
    return out


def load(c, workdir, with_transformers: bool = False) -> Workload:
    """The workload of config `c` (see config.py); `workdir` holds exported checkpoints."""
    fields = layout(c.layers)
    questions = select_questions(c.num_prompts)
    if c.workload.startswith("preset:"):
        size = c.workload.split(":", 1)[1]
        target = models.Llama(preset_config(size, c.dtype, **fields).replace(
            write_then_attend=bool(c.get("write_then_attend", False)), attention_op=c.get("attention_op", "reference"),
            ordered_tail=bool(c.get("ordered_tail", False))))
        canonical = random_params(target.config, jax.random.key(c.seed), c.init_std)
        params = jax.block_until_ready(target.prepare_params(canonical))
        w = Workload(c.workload, target, params, _random_prompts(questions, c.prompt_len, target.vocab_size, c.seed),
                     (), None, None, f"random normal(0, {c.init_std}) weights in {c.dtype}, seed {c.seed}, "
                     f"shapes of {SHAPES_OF[size]}; random prompt ids, no EOS", True)
        if with_transformers:
            ckpt = pathlib.Path(workdir) / f"{size}_{c.dtype}_hf"
            models.export_hf(target, params, ckpt)
            w.model_file, w.hf_source = str(ckpt / "model.safetensors"), {"pretrained_model_name_or_path": str(ckpt)}
            w.model_sha256 = toolkit.sha256(w.model_file)
        return w
    target, params, tok = models.load_with_tokenizer(c.workload, dtype=c.dtype, **fields)
    if c.get("write_then_attend", False) or c.get("attention_op", "reference") != "reference":
        target = models.Llama(target.config.replace(write_then_attend=bool(c.get("write_then_attend", False)),
                                                    attention_op=c.get("attention_op", "reference"),
                                                    ordered_tail=bool(c.get("ordered_tail", False))))
    prompts = [Prompt(q.question_id, q.category, tuple(decoding.encode_prompt(tok, q.prompt))) for q in questions]
    path = models.resolve(c.workload)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    hf = {"pretrained_model_name_or_path": str(path)} if path.is_dir() else \
        {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return Workload(c.workload, target, params, prompts, tuple(int(i) for i in tok.stop_token_ids),
                    str(files[0]) if files else str(path), toolkit.sha256(files[0]) if files else None,
                    f"{path.name} as {c.dtype}; chat template applied", False, hf)


def _has(directory: str, shipped, name: str) -> bool:
    """Whether a draft (head) is given or ships for the target `name` (`build.shipped_draft` / `shipped_head`)."""
    try:
        return bool(directory) or bool(shipped(name))
    except (ValueError, FileNotFoundError):
        return False


def has_distilled(w: Workload, c) -> bool:
    return _has(c.draft_model, build.shipped_draft, w.name)


def has_head(w: Workload, c) -> bool:
    return _has(c.head_model, build.shipped_head, w.name)


def early_exit_layers(w: Workload, c) -> int:
    L = w.target.config.num_layers
    return max(1, min(c.early_exit_layers or L // 8, L - 1))


def drafter(w: Workload, kind: str, c):
    """(drafter, draft params) of a kind, built once per workload; the oracle's params are the
    reference tokens, set per batch."""
    if kind not in w.drafters:
        if kind == "oracle":
            w.drafters[kind] = (OracleDrafter(w.target.vocab_size), None)
        elif kind == "head" or kind.startswith("head:"):   # a feature-level draft head: head_model (""
            # = the one shipped for the target) or head:<directory>
            directory = c.head_model if kind == "head" else kind.split(":", 1)[1]
            w.drafters[kind] = build.make_drafter("head", w.target, w.params, draft_model=directory,
                                                  target_name=w.name)
        elif kind == "hybrid":      # prompt lookup + the head (head_model) or the distilled draft (draft_model)
            directory = c.head_model if c.hybrid_model == "head" else c.draft_model
            w.drafters[kind] = build.make_drafter("hybrid", w.target, w.params, draft_model=directory,
                                                  max_ngram=c.max_ngram, target_name=w.name,
                                                  hybrid_model=c.hybrid_model, min_match=c.min_match)
        else:
            w.drafters[kind] = build.make_drafter(kind, w.target, w.params, early_exit_layers=early_exit_layers(w, c),
                                                  max_ngram=c.max_ngram, draft_model=c.draft_model, target_name=w.name)
    return w.drafters[kind]


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Proposes the next gamma tokens of a reference sequence (its params: a [B, capacity] token
    array, e.g. the target-only greedy output of the same batch), one-hot q, no forward pass.
    Greedy, every proposal is accepted (up to float near-ties), so a round costs the (gamma+1)-token
    verification plus the loop's own work: the per-round cost, whatever random weights do to
    acceptance."""
    vocab_size: int
    capabilities = drafters.Capabilities()          # stateless, chains only

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return None

    def propose(self, ref_BL, state, context: drafters.DraftContext, key_B, gamma, sampling):
        idx_BG = jnp.clip(context.lengths_B[:, None] + jnp.arange(gamma)[None], 0, ref_BL.shape[1] - 1)
        toks_BG = jnp.take_along_axis(ref_BL, idx_BG, axis=1).astype(jnp.int32)
        return toks_BG, jax.nn.one_hot(toks_BG, self.vocab_size, dtype=jnp.float32), state

    def commit(self, state, new_lengths_B):
        return state

    def forward_passes(self, gamma: int) -> int:
        return 0
