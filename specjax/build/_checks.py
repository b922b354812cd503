"""Checks of generation settings before anything heavy loads: each a ValueError that starts with
``setting=value`` (`check_config` runs them all)."""

from __future__ import annotations

import math
import numbers

from specjax import decoding, drafters, models, sampling, trees
from specjax.build._memory import check_round_memory
from specjax.build._settings import GenerateSettings, budget_candidates, generation_config, not_settings

# The most new tokens a config may ask for before any model is read: above every released
# model's context; the target's own context length is checked once its header is read.
MAX_NEW_TOKENS_LIMIT = 1 << 22
# The longest draft a config may ask for (gamma, each of adaptive_gammas; a tree's depth is
# bounded alike, `trees.MAX_TREE_DEPTH`). A round verifies gamma + 1 tokens in one target pass
# and its cost grows with them, while the expected tokens per round saturate at 1 / (1 - alpha):
# the papers use gamma <= ~10 (Leviathan et al. 2023, Chen et al. 2023). Trees: at most
# `trees.MAX_TREE_NODES` nodes. Within these, a round's estimated memory (`round_memory`) is
# checked against the machine before the model loads (`check_round_memory`).
MAX_GAMMA = trees.MAX_TREE_DEPTH


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


def check_generation_settings(c: GenerateSettings) -> None:
    """Validate every decoding setting of a generation config, whichever mode would read it
    (a bad ``gamma`` is an error with ``adaptive_gamma`` on, a bad ``adaptive_gammas`` with it
    off, a bad ``tree`` with ``drafter='none'``...): ``max_new_tokens``, ``gamma``,
    ``adaptive_gammas``, ``adaptive_budgets``, ``tree``, ``adaptive_trees``, ``verifier``, ``tree_verifier``,
    ``tree_children``, ``temperature``, ``top_k``, ``top_p`` and the three penalties. Raises one ``ValueError`` that
    starts with ``setting=value``."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("check_generation_settings", c)
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
    gammas = c.adaptive_gammas                  # a tuple (`GenerateSettings` types it)
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
    shapes = []
    for t in raw_trees:
        try:
            shapes.append(_tree_setting("tree", t))
        except ValueError as e:
            raise ValueError(f"adaptive_trees={raw_trees!r}: {e}") from None
    widths = c.adaptive_budgets
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"adaptive_budgets={widths!r}: expected numbers (positions scored per row), got {w!r}")
    try:
        budgets = budget_candidates(gammas, widths)
    except ValueError as e:
        raise ValueError(f"adaptive_budgets={widths!r}: {e} (a budget drafts up to the largest of "
                         f"adaptive_gammas={gammas!r})") from None
    if gammas or shapes or c.adaptive_gamma:
        try:
            decoding.AdaptiveGamma(gammas=gammas)
        except ValueError as e:
            raise ValueError(f"adaptive_gammas={gammas!r}: {e}") from None
        try:
            decoding.AdaptiveGamma(gammas=gammas + budgets)
        except ValueError as e:
            raise ValueError(f"adaptive_budgets={widths!r}: {e}") from None
        try:
            decoding.AdaptiveGamma(gammas=gammas + budgets + tuple(shapes))
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
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r}: expected a number")
    _int_setting("top_k", c.top_k, 0)
    try:
        sampling.SamplingConfig.make(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                                     repetition_penalty=c.repetition_penalty, presence_penalty=c.presence_penalty,
                                     frequency_penalty=c.frequency_penalty)
    except ValueError as e:
        name = str(e).split(" ")[0]          # the messages begin with the setting's name
        raise ValueError(f"{name}={getattr(c, name)!r}: {e}") from None


def check_target_context(c: GenerateSettings):
    """Check ``max_new_tokens`` against the target's context length from its header only
    (``config.json`` of a Hugging Face directory, the metadata of a GGUF file, the recorded
    header of a registry name, `registry.known_config`), before any weights load: a prompt has
    at least one token, so ``max_new_tokens + 1`` positions must fit. A registry name's file is
    not looked at here (resolving it may fetch and hash it; the engine checks each batch against
    the loaded config). Returns the target's `ModelConfig` or None. Raises ValueError (numbers in
    the message), FileNotFoundError / ModelFetchError for a path that does not exist,
    CheckpointError for a header that does not parse."""
    if not isinstance(c, GenerateSettings):
        raise not_settings("check_target_context", c)
    from specjax.models import registry
    if c.target in registry.KNOWN:
        config = registry.known_config(c.target)
    else:
        config = _header_config(c.target, registry.resolve(c.target))   # an existing path, else ModelFetchError
    if config is None:
        return None                              # no recorded header, another layout: the loader decides
    if c.max_new_tokens + 1 > config.max_position:
        raise ValueError(f"max_new_tokens={c.max_new_tokens}: with a prompt of at least 1 token this exceeds "
                         f"the target's context length {config.max_position} ({c.target}); "
                         f"use max_new_tokens <= {config.max_position - 1} minus the prompt's tokens")
    return config


def _header_config(target: str, path):
    """The `ModelConfig` of a local target ``path`` from its header (HF ``config.json`` or GGUF
    metadata), no weights; None for another layout."""
    import json
    from specjax.models import gguf_loader, hf_loader
    if path.is_dir() or path.name == "config.json":
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.exists():
            raise FileNotFoundError(f"target={target!r}: no config.json in {cfg_file.parent}")
        try:
            config = hf_loader.config_from_hf(json.loads(cfg_file.read_text()))
        except (json.JSONDecodeError, KeyError) as e:
            raise models.CorruptCheckpointError(f"{cfg_file}: unreadable config ({type(e).__name__}: {e})") from e
    elif path.suffix == ".gguf":
        config = gguf_loader.config_from_gguf(gguf_loader.open_gguf(path), path=path)
    else:
        config = None
    return config


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


CPU_KERNEL_CHOICES = ("auto", "on", "off")


def check_cpu_kernel(value: str, scan_layers: bool, dtype: str) -> None:
    """``cpu_kernel`` is one of `CPU_KERNEL_CHOICES`, and 'on' has the layout the kernel needs
    (unrolled layers, float32). Whether the kernel was built is `use_cpu_kernel`'s to check."""
    if value not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernel={value!r}: expected one of {', '.join(CPU_KERNEL_CHOICES)}")
    if value == "on" and (scan_layers or dtype != "float32"):
        raise ValueError(f"cpu_kernel='on' needs scan_layers=False and dtype='float32' (got scan_layers="
                         f"{scan_layers}, dtype={dtype!r})")


def check_config(c: GenerateSettings) -> None:
    """Validate generation settings before anything heavy is loaded (ValueError naming the
    setting and its value). Every decoding setting is checked whichever mode reads it
    (`check_generation_settings`: gamma and trees within `MAX_GAMMA` and `trees.MAX_TREE_NODES`);
    the drafter kind checks its own block and the trees it must draft (`DrafterKind.check`); the
    target's header gives its context length (`check_target_context`) and a round's estimated
    memory, refused when this host has less available (`check_round_memory`)."""
    check_configs((c,))


def check_configs(settings: tuple) -> None:
    """`check_config` of several generation settings (a bench's methods), in three passes: the
    settings' values, each drafter kind's own check, then what the target's header decides."""
    for c in settings:
        if not isinstance(c, GenerateSettings):
            raise not_settings("check_config", c)
        _check_values(c)
    for c in settings:
        kind = c.drafter_kind
        if kind.check is not None:
            kind.check(c.draft, _draft_job(c.target, c.tree, c.adaptive_trees))
    configs = [generation_config(c, ()) for c in settings]
    targets = [check_target_context(c) for c in settings]     # a local target's header, no weights
    for c, target, config in zip(settings, targets, configs):
        if target is not None:                  # the round's estimated memory against this host's
            check_round_memory(c, target, config=config)


def _check_values(c: GenerateSettings) -> None:
    from specjax.models.config import SUPPORTED_DTYPES
    if c.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={c.dtype!r}: expected one of {', '.join(SUPPORTED_DTYPES)}")
    check_cpu_kernel(c.cpu_kernel, c.scan_layers, c.dtype)
    check_mesh(c.mesh)
    if c.write_then_attend and c.scan_layers:
        raise ValueError("write_then_attend=True needs scan_layers=False: the scanned layers write the cache "
                         "once, after the scan")
    check_generation_settings(c)


def _draft_job(target: str, tree: str, adaptive_trees: tuple) -> drafters.DraftJob:
    """What a drafter kind's ``check`` reads: the target and the run's trees (checked by
    `check_generation_settings` first)."""
    parsed = (trees.parse_tree(tree),) if tree else tuple(trees.parse_tree(t) for t in adaptive_trees)
    return drafters.DraftJob(target=target, trees=parsed, tree_setting="tree" if tree else "adaptive_trees",
                             tree_value=tree if tree else tuple(adaptive_trees))
