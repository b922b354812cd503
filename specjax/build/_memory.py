"""Memory estimates of a speculative round, checked against the machine before any weight loads."""

from __future__ import annotations

from specjax import decoding, drafters, trees
from specjax.build._settings import GenerateSettings, generation_config, not_settings

# Prompts are padded and cache capacities rounded up to this many tokens (`decoding.Generator`'s
# default pad_multiple), as the memory estimate assumes.
PAD_MULTIPLE = 64


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


def _block_setting(c: GenerateSettings, config: decoding.GenerationConfig) -> tuple[str, object]:
    """The setting that decides a config's largest verification block, with its value."""
    if c.drafter == drafters.TARGET_ONLY:
        return "max_new_tokens", c.max_new_tokens
    if c.tree:
        return "tree", c.tree
    if config.adaptive:
        largest = max(config.gammas, key=lambda g: g if isinstance(g, int) else g.num_nodes)
        if isinstance(largest, (trees.TreeShape, trees.DynamicTree)):
            return "adaptive_trees", tuple(c.adaptive_trees)
        return "adaptive_gammas", tuple(c.adaptive_gammas)     # a row budget drafts up to their largest
    return "gamma", c.gamma


def check_round_memory(c: GenerateSettings, target, batch: int = 1, available: int | None = None,
                       config: decoding.GenerationConfig | None = None) -> dict[str, int]:
    """Refuse a generation config whose round cannot fit in memory, before the model loads:
    `round_memory` of the target's `ModelConfig` ``target`` (from its header) for the config's
    largest block, a prompt of one token and ``batch`` rows, against ``available`` bytes
    (default: `available_memory` of this host, where the CPU backend runs the round; no backend
    is started to ask an accelerator). ValueError naming the setting that decides the block,
    with the estimate by item and the memory available; returns the estimate. ``config``: the
    engine's configuration of ``c`` where the caller has it (`generation_config`)."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("check_round_memory", c)
    config = generation_config(c, ()) if config is None else config
    block, capacity = config.max_block + 1, round_capacity(config)
    estimate = round_memory(target, block=block, capacity=capacity, batch=batch, tree=config.has_trees,
                            draft_rows=max(draft_rows(g) for g in config.gammas), dtype=c.dtype)
    total = sum(estimate.values())
    if available is None:
        # Looked up on the package: `specjax.build.available_memory` is the one to replace (a
        # job that knows its own limit, a test).
        import specjax.build
        available = specjax.build.available_memory()
    if available is None or total <= available:
        return estimate
    name, value = _block_setting(c, config)
    items = ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.2f} GB" for k, v in estimate.items() if v)
    raise ValueError(f"{name}={value!r}: a round needs an estimated {total / 1e9:.2f} GB ({items}; a block of "
                     f"{block} tokens over a cache of {capacity:,} slots, batch {batch}, target {c.target}) but "
                     f"{available / 1e9:.2f} GB of memory is available: use a smaller {name}, a smaller "
                     f"max_new_tokens or a machine with more memory")
