"""Build (or reuse from the on-disk cache) the training and evaluation data of a run's settings
(`DistillSettings`: every function here takes them as ``c``)."""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.distill import _data, _settings, _sources


def data_root(c) -> pathlib.Path:
    import os
    if c.data_root:
        return pathlib.Path(c.data_root)
    base = os.environ.get("SPECJAX_CACHE") or pathlib.Path.home() / ".cache" / "specjax"
    return pathlib.Path(base) / "distill"


def checkpoint_signature(name: str) -> tuple:
    """What identifies the contents of a target given by name or path: a registry name as it is;
    a file or directory by its files' sizes and modification times."""
    path = pathlib.Path(name).expanduser()
    files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
    return (str(name),) + tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


def eos_ids(target, tokenizer):
    ids = set(getattr(tokenizer, "stop_token_ids", ()) or ())
    e = target.config.eos_token_id
    if e is not None:
        ids |= set(e) if isinstance(e, tuple) else {int(e)}
    return tuple(sorted(ids))


def feature_spec(c, feature_layers) -> dict | None:
    """What a head's feature cache depends on (None: no cache; the step runs the target)."""
    dtype = c.head.feature_cache
    if dtype and dtype not in _data.FEATURE_DTYPES:
        raise ValueError(f"head.feature_cache must be '' (no cache) or one of {_data.FEATURE_DTYPES}, got {dtype!r}")
    if not feature_layers or not dtype:
        return None
    return {"layers": [int(i) for i in feature_layers], "dtype": str(dtype)}


def feature_file(spec: dict) -> str:
    return f"features-{_data.cache_key(**spec)}.npy"


def with_features(data: _data.TeacherData, directory, spec, target, target_params, widths, tokens_per_batch,
                  log=None) -> _data.TeacherData:
    """`data` with the target's features of ``spec["layers"]`` from ``directory`` (computed and
    stored there on first use)."""
    if spec is None:
        return data
    path = pathlib.Path(directory) / feature_file(spec)
    if path.is_file():
        try:
            feats = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{path}: unreadable feature cache ({e}); delete it to recompute the features "
                             f"(the data beside it is kept)") from None
        if feats.ndim != 2 or feats.shape[0] != data.feature_offsets[-1]:
            raise ValueError(f"{path}: {feats.shape} features for {int(data.feature_offsets[-1])} positions "
                             f"(stale feature cache?); delete it to recompute the features")
        if log:
            log(f"reusing cached features {path} ({feats.shape[0]} positions x {feats.shape[1]})")
    else:
        feats = _data.feature_states(target, target_params, data.seqs, spec["layers"], path=path, widths=widths,
                                     tokens_per_batch=tokens_per_batch, dtype=spec["dtype"], log=log)
    return data.with_features(feats)


def target_data(c, target, target_params, tokenizer, log=None, feature_layers=None) -> _data.TeacherData:
    """The target's greedy and temperature-1 continuations of the Spec-Bench train split, and
    with ``data.second_turns`` its greedy answers to the multi-turn questions' second turns
    (after its own greedy first answer); with the target's features of `feature_layers` when the
    config caches them (see `feature_spec`)."""
    d = c.data
    # Prompts longer than max_prompt_tokens are never trained on (`BatchPlan`): not generated either.
    max_prompt = d.max_prompt_tokens
    per_category = d.per_category     # > 0: the first n train prompts of each category only
    prompts, qids = _sources.spec_bench_prompts(tokenizer, "train", max_prompt_tokens=max_prompt,
                                                per_category=per_category)
    widths = tuple(d.widths)
    eos = eos_ids(target, tokenizer)
    parts, greedy = [], None
    stages = [("greedy", 0.0, d.greedy_samples), ("sampled", d.temperature, d.sampled_samples)]
    if d.second_turns:
        if d.greedy_samples != 1:
            raise ValueError("data.second_turns needs data.greedy_samples = 1 (the first answers it continues)")
        stages.append(("second-turn", 0.0, 1))
    for name, temp, n in stages:
        if n <= 0:
            continue
        # Greedy continuations do not depend on the seed: one cached set serves every seed.
        spec = dict(target=c.target, dtype=c.dtype, split="train", temperature=temp, samples=n,
                    max_new_tokens=d.max_new_tokens, seed=c.seed if temp > 0 else 0, widths=widths,
                    prompts=len(prompts))
        if per_category:
            spec["question_ids"] = list(qids)
        stage_prompts = prompts
        if name == "second-turn":
            stage_prompts, _ = _sources.second_turn_prompts(tokenizer, "train", greedy.seqs, qids, eos)
            stage_prompts = [p for p in stage_prompts if not max_prompt or len(p) <= max_prompt]
            spec["second_turn_prompts"] = len(stage_prompts)
        directory = _sources.data_dir(data_root(c), f"target-{name}", **spec)
        fspec = feature_spec(c, feature_layers)
        data = _sources.generated_data(
            directory, target, target_params, target, target_params, stage_prompts,
            key=_sources.key_for(c.seed, f"target-data-{name}"), temperature=temp, samples_per_prompt=n,
            max_new_tokens=d.max_new_tokens, batch_size=d.gen_batch_size, eos_ids=eos,
            widths=widths, source=f"target-{name}", log=log,
            features=None if fspec is None else (fspec["layers"], feature_file(fspec), fspec["dtype"]))
        if name == "greedy":
            greedy = data
        parts.append(with_features(data, directory, fspec, target, target_params, widths, d.tokens_per_batch, log))
    if not parts:
        raise ValueError("target_weight > 0 needs greedy_samples or sampled_samples > 0")
    return _data.concat(parts)


def eval_data(c, target, target_params, tokenizer, log=None) -> _data.TeacherData:
    """Greedy target continuations of held-out prompts (never trained on): the first
    ``eval.per_category`` of each category (among those of at most ``eval.max_prompt_tokens``
    when that is set)."""
    e = c.eval
    max_prompt = e.max_prompt_tokens
    prompts, _ = _sources.spec_bench_prompts(tokenizer, "held_out", per_category=e.per_category,
                                             max_prompt_tokens=max_prompt)
    widths = tuple(c.data.widths)
    spec = dict(target=c.target, dtype=c.dtype, split="held_out", per_category=e.per_category,
                max_new_tokens=e.max_new_tokens, widths=widths)
    if max_prompt:
        spec["max_prompt_tokens"] = max_prompt
    directory = _sources.data_dir(data_root(c), "eval-greedy", **spec)
    return _sources.generated_data(
        directory, target, target_params, target, target_params, prompts, key=_sources.key_for(0, "eval"),
        temperature=0.0, samples_per_prompt=1, max_new_tokens=e.max_new_tokens, batch_size=c.data.gen_batch_size,
        eos_ids=eos_ids(target, tokenizer), widths=widths, source="eval-greedy", log=log)


def eval_plan(c, target, target_params, tokenizer, log=None) -> _data.BatchPlan:
    """The held-out evaluation set of a training config in one fixed order: the target's greedy
    continuations of held-out Spec-Bench prompts (`eval_data`, cached), or, with
    ``eval.data_jsonl`` set, that fixed JSONL set (no tokenizer needed when it holds tokens).
    `c`: a distillation config or its `DistillSettings`."""
    c = _settings.distill_settings(c, extra="ignore")
    if c.eval.data_jsonl:
        data = fixed_data(c, target, target_params, tokenizer, log, path=c.eval.data_jsonl)
    else:
        data = eval_data(c, target, target_params, tokenizer, log)
    return _data.BatchPlan(data, 0, c.data.tokens_per_batch, tuple(c.data.widths))


def fixed_data(c, target, target_params, tokenizer, log=None, path=None, feature_layers=None) -> _data.TeacherData:
    """Teacher states of a fixed JSONL set (``data.fixed_jsonl``, or `path`), cached (with
    features as for `target_data`)."""
    path = pathlib.Path(c.data.fixed_jsonl if path is None else path)
    spec = dict(target=c.target, dtype=c.dtype, path=str(path.resolve()), size=path.stat().st_size,
                mtime=path.stat().st_mtime, widths=tuple(c.data.widths))
    directory = _sources.data_dir(data_root(c), "fixed", **spec)
    data = _sources.fixed_data(directory, path, tokenizer, target, target_params, widths=tuple(c.data.widths),
                               log=log)
    return with_features(data, directory, feature_spec(c, feature_layers), target, target_params,
                         tuple(c.data.widths), c.data.tokens_per_batch, log)


def head_vocabulary(counts, size: int, always=(), coverage: float = 0.0) -> np.ndarray:
    """The `size` most frequent continuation tokens by `counts` (per token id, e.g.
    `_sources.token_frequencies`; ties by id), plus `always` (e.g. EOS), sorted ascending.
    With ``coverage`` > 0: the fewest such tokens (`always` first) whose counts reach that share
    of all counts, at most ``size`` of them (``size`` 0: no cap)."""
    raw = np.asarray(counts, np.float64)
    counts = raw.copy()
    vocab_size = len(counts)
    counts[list(always)] = np.inf
    order = np.lexsort((np.arange(vocab_size), -counts))
    if coverage > 0:
        need = coverage * raw.sum()
        covered = np.cumsum(raw[order])
        n = int(np.searchsorted(covered, need * (1 - 1e-12), side="left")) + 1     # the first prefix reaching it
        n = max(n, len(set(always)), 1)
        size = min(n, size) if size else n
    return np.sort(order[:size]).astype(np.int32)
