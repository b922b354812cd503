"""From a config to the objects the engine runs: target, drafter, sampling, generation config,
and the `specjax.decoding.Generator` that ties them to a tokenizer (the request path)."""

from __future__ import annotations

import dataclasses
import numbers
import pathlib

from specjax import decoding, drafters, models, sampling, trees
from specjax.settings import generate_settings


# Distilled drafts shipped with the package, by target registry name (see experiments/distill).
ARTIFACTS = pathlib.Path(__file__).with_name("artifacts")
# The most new tokens a config may ask for before any model is read: above every released
# model's context; the target's own context length is checked once its header is read.
MAX_NEW_TOKENS_LIMIT = 1 << 22
# The longest draft a config may ask for (gamma, each of adaptive_gammas; a tree's depth is
# bounded alike, `trees.MAX_TREE_DEPTH`). A round verifies gamma + 1 tokens in one target pass
# and its cost grows with them, while the expected tokens per round saturate at 1 / (1 - alpha):
# the papers use gamma <= ~10 (Leviathan et al. 2023, Chen et al. 2023). Trees: at most
# `trees.MAX_TREE_NODES` nodes. Within these, a round's estimated memory (`round_memory`) is
# checked against the machine before the model loads (`check_round_memory`).
MAX_GAMMA = trees.MAX_TREE_DEPTH                # 64
# Prompts are padded and cache capacities rounded up to this many tokens (`decoding.Generator`'s
# default pad_multiple), as the memory estimate assumes.
PAD_MULTIPLE = 64
SHIPPED_DRAFTS = {"smollm2-135m-instruct": ARTIFACTS / "smollm2-135m-instruct-draft"}
# Feature-level draft heads shipped with the package (see experiments/heads: trained by
# `experiments.heads.train`, copied here by `experiments.heads.ship`).
SHIPPED_HEADS = {"smollm2-135m-instruct": ARTIFACTS / "smollm2-135m-instruct-head"}


def _shipped(table: dict, target_name: str, what: str, marker: str, made_by: str) -> pathlib.Path:
    if target_name not in table:
        raise ValueError(f"no {what} ships for target {target_name!r} (known: {sorted(table)}); "
                         f"set draft_model to a directory written by specjax.distill")
    d = table[target_name]
    if not (d / marker).is_file():
        raise FileNotFoundError(f"the shipped {what} {d} is missing (reinstall the package, or produce it with "
                                f"{made_by})")
    return d


def shipped_draft(target_name: str) -> pathlib.Path:
    return _shipped(SHIPPED_DRAFTS, target_name, "distilled draft", "draft.json", "experiments/distill/run.py")


def shipped_head(target_name: str) -> pathlib.Path:
    return _shipped(SHIPPED_HEADS, target_name, "draft head", "head.json",
                    "experiments/heads/train.py and experiments/heads/ship.py")


def enable_compilation_cache(directory: str) -> str | None:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so a second run of
    the same shapes skips XLA compilation. ``directory`` may use ``~``; "" leaves it off.
    Must run before the first compilation. Returns the directory used."""
    if not directory:
        return None
    import jax
    path = str(pathlib.Path(directory).expanduser())
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def limit_heap_retention(mmap_threshold: int = 1024 * 1024) -> bool:
    """glibc only: serve every allocation of at least `mmap_threshold` bytes with its own
    mapping, returned to the OS when freed. By default glibc raises that threshold after each
    large free, so the buffers freed while loading (dequantized tensors, per-layer splits) stay
    in the heap for good; pinning it lowers the peak resident memory of a generation process
    (measured in experiments/bench_speed/PROFILE.md). Call before loading.

    The threshold is 1 MiB, not glibc's initial 128 KiB: below it every speculative round's
    multi-token temporaries (e.g. the block's logits) are fresh mappings, faulted in and
    unmapped each round, which about doubled a verification round's time
    (experiments/bench_speed/PROFILE.md, "Memory").
    Returns whether it applied (False off Linux/glibc)."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3                  # <malloc.h> M_MMAP_THRESHOLD
        return libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
    except (OSError, AttributeError):
        return False


# XLA CPU options the fast path relies on (experiments/bench_speed/PROFILE.md, "What an XLA
# profile showed"): with XLA's default copy insertion every donated per-layer cache buffer that
# a layer reads (attention) and then updates in place was copied, twice, on every decode step;
# the region analysis proves the read precedes the write and drops them. Semantics are unchanged.
XLA_CPU_FLAGS = ("--xla_cpu_copy_insertion_use_region_analysis=true",)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):     # private API; if it moves, assume the worst
        return True


def tune_xla_cpu(flags: tuple[str, ...] = XLA_CPU_FLAGS) -> bool:
    """Add `flags` to XLA_FLAGS (those not already set there). XLA reads them when the first
    backend starts, so call this before anything runs on a device; returns False (and changes
    nothing) when a backend is already running. Set SPECJAX_XLA_DEFAULTS=0 to skip it. Every
    entry point calls it first, so it also leaves the TPU backend out where libtpu is installed
    but no TPU exists (`distributed.platforms_without_tpu`: no libtpu start-up errors)."""
    import os

    from specjax import distributed
    if _backend_started():
        return False
    distributed.platforms_without_tpu()
    if os.environ.get("SPECJAX_XLA_DEFAULTS", "1") == "0":
        return False
    current = os.environ.get("XLA_FLAGS", "")
    names = {f.split("=", 1)[0] for f in current.split()}
    extra = [f for f in flags if f.split("=", 1)[0] not in names]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return True


STRICT_PRECISION_FLAG = "--xla_allow_excess_precision=false"


def strict_precision(on: bool) -> bool:
    """With ``on``, make XLA round every bfloat16 (and float16) operation's result as the program
    says (``--xla_allow_excess_precision=false``). By default XLA may drop a round-trip through
    bfloat16 inside a fusion, so the same operation can round differently in programs that fuse
    differently (a target-only step and a speculative round); configs/generate_tpu.py and
    generate_gpu.py set ``strict_precision``. Call before the first backend starts; returns False (changing
    nothing) when a backend already runs, True otherwise."""
    import os
    if not on:
        return True
    if _backend_started():
        return False
    current = os.environ.get("XLA_FLAGS", "")
    if "--xla_allow_excess_precision" not in current:
        os.environ["XLA_FLAGS"] = f"{current} {STRICT_PRECISION_FLAG}".strip()
    return True


def load_target(name_or_path: str, dtype: str = "float32", scan_layers: bool = True,
                fuse_projections: bool = False, packed_projections: bool = False):
    return models.load(name_or_path, dtype=dtype, scan_layers=scan_layers, fuse_projections=fuse_projections,
                       packed_projections=packed_projections)


CPU_KERNEL_CHOICES = ("auto", "on", "off")


def use_cpu_kernel(c, backend: str | None = None) -> bool:
    """Whether a generation config's target runs on `specjax.kernels`' CPU matmul (the packed
    layout, ``ModelConfig.packed_projections``), from ``cpu_kernel``:

    * ``'off'``: never (XLA's own matmuls);
    * ``'on'``: always; an error unless the kernel was built, the layers are unrolled
      (``scan_layers=False``) and the dtype is float32;
    * ``'auto'`` (default): on the CPU backend when the kernel was built with a vector body for
      this CPU, the layers are unrolled and the dtype is float32.

    ``backend`` (default: JAX's default backend, which this starts) is only read for 'auto'. A
    bad value is a ValueError naming the setting; `check_config` calls this with ``backend=''``
    (validation only, no backend started)."""
    c = generate_settings(c)
    from specjax import kernels
    value = c.cpu_kernel
    if value not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernel={value!r}: expected one of {', '.join(CPU_KERNEL_CHOICES)}")
    fits = not c.scan_layers and c.dtype == "float32"
    if value == "off" or backend == "":
        if value == "on" and not fits:
            raise ValueError(f"cpu_kernel='on' needs scan_layers=False and dtype='float32' (got scan_layers="
                             f"{c.scan_layers}, dtype={c.dtype!r})")
        return False if value != "on" else fits
    if value == "on":
        if not fits:
            raise ValueError(f"cpu_kernel='on' needs scan_layers=False and dtype='float32' (got scan_layers="
                             f"{c.scan_layers}, dtype={c.dtype!r})")
        kernels.check_library()         # a foreign file in the library's place: named
        if not kernels.built():
            raise ValueError("cpu_kernel='on': specjax's CPU kernel was not built at install time (a C++ "
                             "compiler and jaxlib are needed; reinstall with `pip install -e .`), or use 'auto'")
        return True
    import jax
    if backend is None:
        backend = jax.default_backend()
    # On a mesh of several devices the kernel's custom call would run unpartitioned on every
    # device (its operands gathered): XLA's matmuls shard, so 'auto' keeps them there.
    return fits and backend == "cpu" and kernels.fast_on_this_cpu() and jax.device_count() == 1


# ---------------------------------------------------------------------------------------
# The built-in drafter kinds (`specjax.drafters.register_drafter`): each with its settings (the
# generation config keys it reads) and its builder. A kind of one's own registers the same way.
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NoSettings:
    """A kind that reads no setting."""


@dataclasses.dataclass(frozen=True)
class NGramSettings:
    max_ngram: int = 3
    min_ngram: int = 1


@dataclasses.dataclass(frozen=True)
class EarlyExitSettings:
    early_exit_layers: int = 4


@dataclasses.dataclass(frozen=True)
class DraftModelSettings:
    draft_model: str = ""            # a path or registry name ("" = the draft shipped for the target, where one is)


@dataclasses.dataclass(frozen=True)
class HybridSettings:
    hybrid_model: str = "head"       # the model half: one of HYBRID_MODELS
    min_match: int = 0               # 0: max_ngram
    max_ngram: int = 3
    min_ngram: int = 1
    draft_model: str = ""


HYBRID_MODELS = ("head", "distilled", "model")      # the model half of drafter='hybrid'


def _build_ngram(s: NGramSettings, ctx):
    return drafters.NGramDrafter(ctx.target.vocab_size, max_ngram=s.max_ngram, min_ngram=s.min_ngram), None


def _build_early_exit(s: EarlyExitSettings, ctx):          # shares the target's KV cache for its layers
    return drafters.EarlyExitDrafter.from_target(ctx.target, ctx.target_params, s.early_exit_layers)


def _build_early_exit_own_cache(s: EarlyExitSettings, ctx):  # the same draft as a model with its own cache
    params, cfg = models.truncate_layers(ctx.target_params, ctx.target.config, s.early_exit_layers)
    return drafters.ModelDrafter(models.Llama(cfg)), params


def _build_distilled(s: DraftModelSettings, ctx):
    from specjax.models.draft_artifact import load_draft
    model, params = load_draft(s.draft_model or shipped_draft(ctx.target_name), ctx.target, ctx.target_params)
    return drafters.ModelDrafter(model), params


def _build_head(s: DraftModelSettings, ctx):
    """A feature-level draft head (EAGLE / EAGLE-3 / Medusa, `specjax.drafters`): a directory
    written by `specjax.distill`, or an EAGLE-3 head in the reference / SpecForge or vLLM
    speculators layout (`drafters.load_eagle3`)."""
    if not s.draft_model and ctx.target_name not in SHIPPED_HEADS:
        raise ValueError("drafter='head' needs draft_model: a head directory written by specjax.distill "
                         "with draft.kind in ('eagle3', 'eagle', 'medusa') (no head ships for target "
                         f"{ctx.target_name!r})")
    directory = s.draft_model or shipped_head(ctx.target_name)
    if not drafters.is_head_dir(directory) and drafters.eagle3_layout(directory) is not None:
        return drafters.load_eagle3(directory, ctx.target, ctx.target_params)
    return drafters.load_head(directory, ctx.target, ctx.target_params)


def _check_model(s: DraftModelSettings, target_name: str) -> None:
    if not s.draft_model:
        raise ValueError("drafter='model' needs draft_model (a path or registry name)")


def _build_model(s: DraftModelSettings, ctx):
    _check_model(s, ctx.target_name)
    model, params = models.load(s.draft_model, dtype=ctx.dtype, scan_layers=ctx.scan_layers)
    if model.vocab_size != ctx.target.vocab_size:
        raise ValueError(f"vocab mismatch: draft model {s.draft_model} has {model.vocab_size} tokens, "
                         f"the target {ctx.target.vocab_size}")
    return drafters.ModelDrafter(model), params


def _build_hybrid(s: HybridSettings, ctx):
    """Prompt lookup where the suffix match has at least ``min_match`` tokens (0: ``max_ngram``),
    else the drafter ``hybrid_model`` (built as its own kind); see `drafters.HybridDrafter`."""
    if s.hybrid_model not in HYBRID_MODELS:
        raise ValueError(f"hybrid_model={s.hybrid_model!r}: expected one of {', '.join(HYBRID_MODELS)}")
    model, params = drafters.build_drafter(s.hybrid_model, {"draft_model": s.draft_model}, ctx)
    lookup = drafters.NGramDrafter(ctx.target.vocab_size, max_ngram=s.max_ngram, min_ngram=s.min_ngram)
    return drafters.HybridDrafter(lookup, model, min_match=int(s.min_match or s.max_ngram)), params


for _name, _settings, _build, _check, _doc in (
        ("distilled", DraftModelSettings, _build_distilled, None, "a draft written by specjax distill"),
        ("head", DraftModelSettings, _build_head, None, "a feature-level draft head"),
        ("ngram", NGramSettings, _build_ngram, None, "prompt lookup"),
        ("early_exit", EarlyExitSettings, _build_early_exit, None, "the target's first layers on its cache"),
        ("early_exit_own_cache", EarlyExitSettings, _build_early_exit_own_cache, None,
         "the target's first layers with a cache of their own"),
        ("model", DraftModelSettings, _build_model, _check_model, "any checkpoint with the target's vocabulary"),
        ("hybrid", HybridSettings, _build_hybrid, None, "prompt lookup, else a model (SAM-Decoding's rule)"),
        ("none", NoSettings, lambda s, ctx: (None, None), None, "target-only decoding")):
    drafters.register_drafter(_name, _settings, _build, check=_check, description=_doc)

DRAFTER_KINDS = drafters.drafter_kinds()     # the built-in kinds


def make_drafter(kind: str, target, target_params, *, dtype: str = "float32", scan_layers: bool = True,
                 target_name: str = "", **settings):
    """(drafter, draft_params) of a registered drafter kind (`drafters.drafter_kinds()`: the
    built-in 'distilled', 'head', 'ngram', 'hybrid', 'early_exit', 'early_exit_own_cache',
    'model', 'none', and any registered since), its settings from ``settings`` (each kind's
    frozen settings dataclass names the keys it reads; the others are ignored)."""
    ctx = drafters.BuildContext(target, target_params, target_name=target_name, dtype=dtype, scan_layers=scan_layers)
    return drafters.build_drafter(kind, settings, ctx)


def sampling_config(c) -> sampling.SamplingConfig:
    c = generate_settings(c)
    return sampling.SamplingConfig.make(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)


def _int_setting(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def _tree_setting(name: str, text):
    if not isinstance(text, str):
        raise ValueError(f"{name}={text!r}: expected a tree string such as 'branching:2,2,1'")
    try:
        return trees.parse_tree(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r}: {e}") from None


def check_generation_settings(c) -> None:
    """Validate every decoding setting of a generation config, whichever mode would read it
    (a bad ``gamma`` is an error with ``adaptive_gamma`` on, a bad ``adaptive_gammas`` with it
    off, a bad ``tree`` with ``drafter='none'``...): ``max_new_tokens``, ``gamma``,
    ``adaptive_gammas``, ``tree``, ``adaptive_trees``, ``verifier``, ``tree_verifier``,
    ``tree_children``, ``temperature``, ``top_k``, ``top_p``. Raises one ``ValueError`` that
    starts with ``setting=value``."""
    c = generate_settings(c)
    _int_setting("max_new_tokens", c.max_new_tokens, 1)
    if c.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
        # From the config alone: no checkpoint has a context this long, and the cache for it
        # would not fit in memory (the model's own context length is checked once its header
        # is read, `check_target_context`, and per batch by the engine).
        raise ValueError(f"max_new_tokens={c.max_new_tokens!r}: expected at most {MAX_NEW_TOKENS_LIMIT:,} "
                         f"(no model's context is longer; the target's own limit applies too)")
    _int_setting("gamma", c.gamma, 0)
    if c.gamma > MAX_GAMMA:
        raise ValueError(f"gamma={c.gamma!r}: expected at most {MAX_GAMMA} (a round verifies gamma + 1 tokens in one "
                         f"target pass; papers use gamma <= ~10)")
    raw_gammas = c.adaptive_gammas
    if isinstance(raw_gammas, (str, bytes)) or not hasattr(raw_gammas, "__iter__"):
        raise ValueError(f"adaptive_gammas={raw_gammas!r}: expected a tuple of integers >= 0")
    gammas = tuple(raw_gammas)
    for g in gammas:
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
            raise ValueError(f"adaptive_gammas={gammas!r}: expected integers >= 0, got {g!r}")
        if g > MAX_GAMMA:
            raise ValueError(f"adaptive_gammas={gammas!r}: expected integers <= {MAX_GAMMA} (a round verifies "
                             f"gamma + 1 tokens in one target pass), got {g!r}")
    tree = c.tree
    if tree:
        _tree_setting("tree", tree)
    raw_trees = c.adaptive_trees
    if isinstance(raw_trees, (str, bytes)) or not hasattr(raw_trees, "__iter__"):
        raise ValueError(f"adaptive_trees={raw_trees!r}: expected a tuple of tree strings")
    raw_trees = tuple(raw_trees)
    shapes = []
    for t in raw_trees:
        try:
            shapes.append(_tree_setting("tree", t))
        except ValueError as e:
            raise ValueError(f"adaptive_trees={raw_trees!r}: {e}") from None
    if gammas or shapes or c.adaptive_gamma:
        try:
            decoding.AdaptiveGamma(gammas=gammas)
        except ValueError as e:
            raise ValueError(f"adaptive_gammas={gammas!r}: {e}") from None
        try:
            decoding.AdaptiveGamma(gammas=gammas + tuple(shapes))
        except ValueError as e:
            raise ValueError(f"adaptive_trees={raw_trees!r}: {e}") from None
    # The verifier names, checked by GenerationConfig itself (its messages start with the
    # setting's name and give the value); a one-node chain makes it check the tree verifier's
    # exactness for tree_children too, as it would for a real tree.
    decoding.GenerationConfig(max_new_tokens=1, gamma=trees.TreeShape.chain(1), verifier=c.verifier,
                              tree_verifier=c.tree_verifier,
                              tree_children=c.tree_children)
    if not isinstance(c.block_tokens, int) or isinstance(c.block_tokens, bool) or c.block_tokens < -1:
        raise ValueError(f"block_tokens={c.block_tokens!r}: expected 0 (each target pass its own size), -1 (the "
                         f"largest block the drafter drafts) or a number of tokens >= that block")
    for name in ("temperature", "top_p"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r}: expected a number")
    _int_setting("top_k", c.top_k, 0)
    try:
        sampling_config(c)
    except ValueError as e:
        name = "temperature" if "temperature" in str(e) else "top_p" if "top_p" in str(e) else "top_k"
        raise ValueError(f"{name}={getattr(c, name)!r}: {e}") from None


def generation_config(c, eos_ids) -> decoding.GenerationConfig:
    c = generate_settings(c)
    check_generation_settings(c)
    tree = c.tree
    if c.drafter == "none":
        gamma = 0
    elif tree:
        gamma = trees.parse_tree(tree)
    elif c.adaptive_gamma:
        gamma = decoding.AdaptiveGamma(gammas=tuple(c.adaptive_gammas)
                                       + tuple(trees.parse_tree(t) for t in c.adaptive_trees))
    else:
        gamma = int(c.gamma)
    try:
        return decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=gamma, verifier=c.verifier,
                                         eos_ids=tuple(eos_ids), tree_verifier=c.tree_verifier,
                                         tree_children=c.tree_children, block_tokens=c.block_tokens)
    except ValueError as e:
        if str(e).startswith("block_tokens"):
            raise ValueError(f"block_tokens={c.block_tokens!r}: {e}") from None
        raise


def check_target_context(c):
    """Check ``max_new_tokens`` against the target's context length from its header only
    (``config.json`` of a Hugging Face directory, the metadata of a GGUF file, the recorded
    header of a registry name, `registry.known_config`), before any weights load: a prompt has
    at least one token, so ``max_new_tokens + 1`` positions must fit. A registry name's file is
    not looked at here (resolving it may fetch and hash it; the engine checks each batch against
    the loaded config). Returns the target's `ModelConfig` or None. Raises ValueError (numbers in
    the message), FileNotFoundError / ModelFetchError for a path that does not exist,
    CheckpointError for a header that does not parse."""
    c = generate_settings(c)
    from specjax.models import registry
    if c.target in registry.KNOWN:
        config = registry.known_config(c.target)
    else:
        config = _header_config(c, registry.resolve(c.target))   # an existing path, else ModelFetchError
    if config is None:
        return None                              # no recorded header, another layout: the loader decides
    if c.max_new_tokens + 1 > config.max_position:
        raise ValueError(f"max_new_tokens={c.max_new_tokens}: with a prompt of at least 1 token this exceeds "
                         f"the target's context length {config.max_position} ({c.target}); "
                         f"use max_new_tokens <= {config.max_position - 1} minus the prompt's tokens")
    return config


def _header_config(c, path):
    """The `ModelConfig` of a local target ``path`` from its header (HF ``config.json`` or GGUF
    metadata), no weights; None for another layout."""
    import json
    from specjax.models import gguf_loader, hf_loader
    if path.is_dir() or path.name == "config.json":
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.exists():
            raise FileNotFoundError(f"target={c.target!r}: no config.json in {cfg_file.parent}")
        try:
            config = hf_loader.config_from_hf(json.loads(cfg_file.read_text()))
        except (json.JSONDecodeError, KeyError) as e:
            raise models.CorruptCheckpointError(f"{cfg_file}: unreadable config ({type(e).__name__}: {e})") from e
    elif path.suffix == ".gguf":
        config = gguf_loader.config_from_gguf(gguf_loader.open_gguf(path), path=path)
    else:
        config = None
    return config


def param_count(config) -> int:
    """The parameters of a Llama-family target with `config` (a `models.ModelConfig`): the
    embedding (and an untied head), per layer the q/k/v/o projections (with Qwen2's biases),
    the gated MLP and two norms, and the final norm."""
    D, F, L = config.hidden_size, config.ffn_size, config.num_layers
    q, kv = config.q_size, config.kv_size
    per_layer = D * (q + 2 * kv) + q * D + 3 * D * F + 2 * D + ((q + 2 * kv) if config.attention_bias else 0)
    return config.vocab_size * D * (1 if config.tie_embeddings else 2) + L * per_layer + D


def round_memory(config, *, block: int, capacity: int, draft_rows: int, batch: int = 1, tree: bool = False,
                 dtype: str = "float32") -> dict[str, int]:
    """Bytes of the largest buffers alive in one speculative round of a target with `config`
    (a `models.ModelConfig`), by item: a verification ``block`` of tokens (gamma + 1, or a
    tree's nodes + 1) over a cache of ``capacity`` slots, ``batch`` rows, ``draft_rows`` drafted
    distributions over the vocabulary, weights and cache in ``dtype``:

    * ``weights``: the target's parameters (`param_count`);
    * ``kv_cache``: keys and values of every layer over the capacity;
    * ``attention_scores``: one layer's float32 scores of the block's queries (every head) over
      capacity + block keys, three times: the scores, their concatenation with the block's own
      and the softmax, as `models.llama.attention` materialises them (layers run in turn);
    * ``tree_mask``: the block's visibility over capacity + block slots, one byte each (trees);
    * ``logits``: the target's float32 logits over the vocabulary for the block, and the
      verifier's probabilities from them;
    * ``draft_q``: the drafter's float32 q over the vocabulary, ``draft_rows`` per row.

    A lower bound of the peak: the drafter's weights and cache and XLA's other temporaries are
    not counted."""
    width = {"float32": 4, "bfloat16": 2}[dtype]
    B, T, S, V = int(batch), int(block), int(capacity), config.vocab_size
    return {
        "weights": param_count(config) * width,
        "kv_cache": config.num_layers * 2 * B * config.kv_size * S * width,
        "attention_scores": 3 * B * config.num_heads * T * (S + T) * 4,
        "tree_mask": B * T * (S + T) if tree else 0,
        "logits": 2 * B * T * V * 4,
        "draft_q": B * int(draft_rows) * V * 4,
    }


def draft_rows(gamma) -> int:
    """The distributions over the vocabulary a drafter holds for one proposal: gamma for a
    chain, the nodes and the root for a static tree, and for a dynamic tree also every
    candidate it scored (`trees.dynamic_candidates`)."""
    if isinstance(gamma, int):
        return gamma
    if isinstance(gamma, trees.DynamicTree):
        return trees.dynamic_candidates(gamma.depth, gamma.topk) + gamma.num_nodes + 1
    return gamma.num_nodes + 1


def round_capacity(config: decoding.GenerationConfig, prompt_tokens: int = 1, pad_multiple: int = PAD_MULTIPLE) -> int:
    """The cache capacity a batch gets for a prompt of ``prompt_tokens`` under `config`
    (`decoding.make_batch`: the slots it needs rounded up to ``pad_multiple``, at least the
    padded prompt)."""
    up = lambda x: -(-int(x) // pad_multiple) * pad_multiple
    return max(up(config.slots_needed(prompt_tokens)), up(prompt_tokens))


def available_memory() -> int | None:
    """Bytes of memory this host can give a new process now: ``MemAvailable`` of /proc/meminfo
    (Linux), else the free physical pages (``os.sysconf``); None where neither is known."""
    import os
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _block_setting(c, config: decoding.GenerationConfig) -> tuple[str, object]:
    """The setting that decides a config's largest verification block, with its value."""
    if c.drafter == "none":
        return "max_new_tokens", c.max_new_tokens
    if c.tree:
        return "tree", c.tree
    if config.adaptive:
        largest = max(config.gammas, key=lambda g: g if isinstance(g, int) else g.num_nodes)
        if not isinstance(largest, int):
            return "adaptive_trees", tuple(c.adaptive_trees)
        return "adaptive_gammas", tuple(c.adaptive_gammas)
    return "gamma", c.gamma


def check_round_memory(c, target, batch: int = 1, available: int | None = None) -> dict[str, int]:
    """Refuse a generation config whose round cannot fit in memory, before the model loads:
    `round_memory` of the target's `ModelConfig` ``target`` (from its header) for the config's
    largest block, a prompt of one token and ``batch`` rows, against ``available`` bytes
    (default: `available_memory` of this host, where the CPU backend runs the round; no backend
    is started to ask an accelerator). ValueError naming the setting that decides the block,
    with the estimate by item and the memory available; returns the estimate."""
    c = generate_settings(c)
    config = generation_config(c, ())
    block, capacity = config.max_block + 1, round_capacity(config)
    estimate = round_memory(target, block=block, capacity=capacity, batch=batch, tree=config.has_trees,
                            draft_rows=max(draft_rows(g) for g in config.gammas), dtype=c.dtype)
    total = sum(estimate.values())
    available = available_memory() if available is None else available
    if available is None or total <= available:
        return estimate
    name, value = _block_setting(c, config)
    items = ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.2f} GB" for k, v in estimate.items() if v)
    raise ValueError(f"{name}={value!r}: a round needs an estimated {total / 1e9:.2f} GB ({items}; a block of "
                     f"{block} tokens over a cache of {capacity:,} slots, batch {batch}, target {c.target}) but "
                     f"{available / 1e9:.2f} GB of memory is available: use a smaller {name}, a smaller "
                     f"max_new_tokens or a machine with more memory")


def check_drafter_trees(c, config: decoding.GenerationConfig) -> None:
    """Refuse, before any model loads, a tree the configured drafter cannot draft where that
    needs no weights: the n-gram drafter drafts k chains from the root only
    (`drafters.NGramDrafter.check_tree`). Other drafters check their trees when the engine is
    built. ValueError naming ``tree`` or ``adaptive_trees``."""
    c = generate_settings(c)
    if c.drafter != "ngram":
        return
    lookup = drafters.NGramDrafter(vocab_size=1)
    name = "tree" if c.tree else "adaptive_trees"
    for g in config.gammas:
        if not isinstance(g, int):
            try:
                lookup.check_tree(g)
            except ValueError as e:
                value = c.tree if name == "tree" else tuple(c.adaptive_trees)
                raise ValueError(f"{name}={value!r}: {e}") from None


def check_hybrid_settings(c) -> None:
    """``hybrid_model`` and ``min_match`` (read by drafter='hybrid'; checked whatever the drafter)."""
    c = generate_settings(c)
    model = c.hybrid_model
    if model not in HYBRID_MODELS:
        raise ValueError(f"hybrid_model={model!r}: expected one of {', '.join(HYBRID_MODELS)}")
    if c.drafter == "hybrid" and model == "model" and not c.draft_model:
        raise ValueError("drafter='hybrid' with hybrid_model='model' needs draft_model (a path or registry name)")
    shipped = {"head": SHIPPED_HEADS, "distilled": SHIPPED_DRAFTS}.get(model)
    if c.drafter == "hybrid" and shipped is not None and not c.draft_model and c.target not in shipped:
        raise ValueError(f"drafter='hybrid' drafts with the {model} shipped for {', '.join(sorted(shipped))}, and none "
                         f"ships for target {c.target!r}: give draft_model=<a {model} directory written by "
                         f"specjax.distill>, or use drafter='ngram' (prompt lookup alone)")
    m = c.min_match
    if m:
        _int_setting("min_match", m, 1)
        if not c.min_ngram <= m <= c.max_ngram:
            raise ValueError(f"min_match={m!r}: expected an integer in [min_ngram, max_ngram] = "
                             f"[{c.min_ngram}, {c.max_ngram}]")


def check_seed(value, setting: str = "seed") -> int:
    """A seed is an integer >= 0 (random keys and numpy's generators take non-negative seeds; a
    negative one was accepted and silently meant another stream): ValueError naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{setting}={value!r}: expected an integer >= 0")
    return int(value)


def check_mesh(mesh, setting: str = "mesh") -> None:
    """The sizes of a ``mesh`` block (a mapping or (axis, size) pairs): each -1 (the devices
    the other axes leave) or an integer >= 1, at most one -1; checked whatever the device count
    (with one device no mesh is made, and ``model=0`` was accepted). ValueError naming the key."""
    pairs = list(mesh.items() if hasattr(mesh, "items") else mesh)
    for axis, size in pairs:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or (size != -1 and size < 1):
            raise ValueError(f"{setting}.{axis}={size!r}: expected -1 (the devices the other axes leave) or an "
                             f"integer >= 1")
    free = [axis for axis, size in pairs if size == -1]
    if len(free) > 1:
        raise ValueError(f"{setting}: {', '.join(f'{a}=-1' for a in free)}: at most one axis may be -1 (the rest)")


def check_config(c) -> None:
    """Validate a generation config's settings before anything heavy is loaded (ValueError
    naming the setting and its value). Every decoding setting is checked whichever mode reads
    it (`check_generation_settings`: gamma and trees within `MAX_GAMMA` and
    `trees.MAX_TREE_NODES`); a tree the n-gram drafter cannot draft is refused
    (`check_drafter_trees`); the target's header gives its context length
    (`check_target_context`) and a round's estimated memory, refused when this host has less
    available (`check_round_memory`)."""
    c = generate_settings(c)
    kind = drafters.drafter_kind(c.drafter)          # ValueError naming the registered kinds
    if kind.check is not None:
        kind.check(kind.settings_from(c), c.target)
    check_hybrid_settings(c)
    from specjax.models.config import SUPPORTED_DTYPES
    if c.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={c.dtype!r}: expected one of {', '.join(SUPPORTED_DTYPES)}")
    use_cpu_kernel(c, backend="")               # the value only; no backend started
    check_mesh(c.mesh)
    if c.write_then_attend and c.scan_layers:
        raise ValueError("write_then_attend=True needs scan_layers=False: the scanned layers write the cache "
                         "once, after the scan")
    check_generation_settings(c)
    if c.drafter == "hybrid" and (c.tree or c.adaptive_trees):
        setting = "tree" if c.tree else "adaptive_trees"
        raise ValueError(f"{setting}={getattr(c, setting)!r}: drafter='hybrid' (the default) drafts chains only; for "
                         f"token trees choose a drafter that drafts them (drafter='head', 'ngram', 'distilled', ...)")
    check_drafter_trees(c, generation_config(c, ()))
    target = check_target_context(c)            # reads a local target's header, no weights
    if target is not None:
        check_round_memory(c, target)           # the round's estimated memory against this host's


def load_target_with_tokenizer(c):
    """(target, params, tokenizer) of a generation config, from one read of the checkpoint, in
    the layout the config asks for (``scan_layers``, ``fuse_projections``, ``cpu_kernel``: the
    panel matmul and, with it, the attention kernel, see `use_cpu_attention`)."""
    c = generate_settings(c)
    packed = use_cpu_kernel(c)
    target, params, tokenizer = models.load_with_tokenizer(c.target, dtype=c.dtype, scan_layers=c.scan_layers,
                                                           fuse_projections=c.fuse_projections,
                                                           packed_projections=packed)
    if target.config.packed_projections and use_cpu_attention():
        target = type(target)(target.config.replace(cpu_attention=True))
    op = c.attention_op
    if op != target.config.attention_op:
        from specjax.models import attention
        attention.get_attention_op(op)          # an unknown op named before anything runs
        target = type(target)(target.config.replace(attention_op=op))
    if c.write_then_attend != target.config.write_then_attend:
        target = type(target)(target.config.replace(write_then_attend=c.write_then_attend))
    return target, params, tokenizer


def use_cpu_attention() -> bool:
    """Whether a target that runs on the CPU kernel's matmul (`use_cpu_kernel`) also attends
    through `specjax.kernels.decode_attention`: when that kernel was built with its AVX-512 body
    (its portable body is slower than XLA's einsum)."""
    from specjax import kernels
    return kernels.attention_fast_on_this_cpu()


def generator_for(c, target, params, tokenizer, pad_multiple: int = 64) -> decoding.Generator:
    """The drafter and engine of a generation config around an already loaded target (one
    target, several drafters: `specjax bench`). The caller has checked the settings with
    `check_config` before loading the target (as `load_generator` does)."""
    c = generate_settings(c)
    ctx = drafters.BuildContext(target, params, target_name=c.target, dtype=c.dtype, scan_layers=c.scan_layers)
    drafter, dparams = drafters.build_drafter(c.drafter, c, ctx)
    mesh = generation_mesh(c)
    engine = decoding.Engine(target, drafter, generation_config(c, tokenizer.stop_token_ids), mesh=mesh)
    eparams = decoding.EngineParams(target=params, draft=dparams)
    if mesh is not None:
        eparams = engine.place_params(eparams)
    return decoding.Generator(engine, eparams, tokenizer, pad_multiple=pad_multiple)


def generation_mesh(c):
    """The generation config's ``mesh`` (data x fsdp x model, -1 = the rest) when the job has
    more than one device (a multi-host job, or host devices from
    ``--xla_force_host_platform_device_count``), else None: one device runs without a mesh."""
    c = generate_settings(c)
    import jax
    if jax.device_count() == 1:
        return None
    from specjax import sharding
    return sharding.mesh_from_config(c.mesh_axes)


def load_generator(c, pad_multiple: int = 64) -> decoding.Generator:
    """The target (weights and tokenizer from one read of the checkpoint), the drafter and the
    engine of a generation config (`configs/generate.py`), as a `decoding.Generator`. The
    settings are checked before anything is loaded (`check_config`)."""
    c = generate_settings(c)
    check_config(c)
    return generator_for(c, *load_target_with_tokenizer(c), pad_multiple=pad_multiple)
