"""A distillation run before its first step: its data sources and the draft with its optimizer,
placed on the mesh. `specjax.distill.train` builds a `Sources` and then a `Trainee` from the
run's `DistillSettings`; the loop (`_loop`) only steps, checkpoints, evaluates and exports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed, drafters, models, sharding
from specjax.distill import _data, _drafts, _heads, _prepare, _sources, _stream, _train

MIX_STREAM = 7     # a fixed stream id for the per-step source choice


class Mixture:
    """Source choice per step: ``default_rng([seed, MIX_STREAM, step])`` draws from the weights;
    each source's own batch index is the number of earlier steps that chose it."""

    def __init__(self, names: list[str], weights: list[float], seed: int):
        w = np.asarray(weights, np.float64)
        if len(names) == 0 or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"source weights must be >= 0 with a positive sum, got {dict(zip(names, weights))}")
        self.names, self.p, self.seed = names, w / w.sum(), seed
        self._choices: list[int] = []
        self._prefix: list[tuple[int, ...]] = [(0,) * len(names)]   # per-source counts of steps < s

    def _extend(self, step: int) -> None:
        while len(self._choices) <= step:
            s = len(self._choices)
            c = int(np.random.default_rng([self.seed, MIX_STREAM, s]).choice(len(self.p), p=self.p))
            self._choices.append(c)
            counts = list(self._prefix[-1])
            counts[c] += 1
            self._prefix.append(tuple(counts))

    def choice(self, step: int) -> int:
        self._extend(step)
        return self._choices[step]

    def index_within(self, step: int, start: int = 0) -> int:
        """How many steps in [start, step) chose the same source as `step`."""
        c = self.choice(step)
        return self._prefix[step][c] - self._prefix[start][c]


@dataclasses.dataclass
class Sources:
    """The run's data: ``plans`` by name ('target', 'fixed', 'shards'; the target's set may be
    there for its prompts only), the mixture ``weights`` of the sources trained on ('draft' =
    on-policy data, made during the run), the per-step `Mixture` and the time each set took."""
    plans: dict
    weights: dict
    mixture: Mixture
    timings: dict

    def fingerprints(self) -> dict:
        """What each streamed source reads (a resumed run must read the same)."""
        return {n: p.fingerprint() for n, p in self.plans.items() if isinstance(p, _stream.ShardStream)}

    def loss_tokens(self) -> dict:
        """Loss tokens of one pass over each fixed set trained on (prompts longer than
        max_prompt_tokens left out, as the batches leave them)."""
        return {n: p.loss_tokens_used() for n, p in self.plans.items() if n in self.weights}

    def mean_tokens_per_batch(self, tokens_per_batch: int) -> float:
        """Loss tokens per step, for the schedule's length: the trained sources' (on-policy data
        alone: its prompts' data set as the estimate)."""
        trained = [p for n, p in self.plans.items() if n in self.weights] or list(self.plans.values())
        return float(np.mean([p.mean_tokens_per_batch() for p in trained])) if trained else tokens_per_batch / 2

    def prompts(self, limit: int | None) -> list[list[int]]:
        """The distinct prompts of the target / fixed data (for the target data: the Spec-Bench
        train split), in first-seen order, those longer than `limit` left out."""
        seen, out = set(), []
        for plan in self.plans.values():
            if isinstance(plan, _stream.ShardStream):
                continue
            for t, p in zip(plan.data.seqs.tokens, plan.data.seqs.prompt_lengths):
                if limit and p > limit:
                    continue
                key = tuple(int(x) for x in t[:p])
                if key not in seen:
                    seen.add(key)
                    out.append(list(key))
        if not out:
            raise ValueError("on-policy data (draft_weight > 0) needs target or fixed data for its prompts "
                             "(no prompt within draft_max_prompt_tokens?)")
        return out


def load_sources(s, target, target_params, tokenizer: Callable[[], Any], *, log) -> Sources:
    """The data sets of settings `s` (made by process 0 first; the others then read them from
    the cache). `tokenizer()` loads the target's tokenizer when a set needs it."""
    d = s.data
    primary = distributed.is_primary()
    feature_layers = _heads.feature_layers_of(s, target) if s.is_head else None
    if not primary:
        distributed.barrier("specjax-distill-data")
    plans: dict = {}
    weights: dict = {}
    timings = {}
    # On-policy data alone still needs prompts (and a reduced head its tokens): the target's
    # data set then serves as their source without being trained on (weight 0).
    prompts_only = d.target_weight <= 0 and d.draft_weight > 0 and d.fixed_weight <= 0
    if d.target_weight > 0 or prompts_only:
        t0 = time.perf_counter()
        plans["target"] = _data.BatchPlan(_prepare.target_data(s, target, target_params, tokenizer(), log,
                                                               feature_layers=feature_layers),
                                          s.seed, d.tokens_per_batch, d.widths, d.max_prompt_tokens)
        if not prompts_only:
            weights["target"] = d.target_weight
        timings["target_data_s"] = time.perf_counter() - t0
    if d.fixed_weight > 0:
        t0 = time.perf_counter()
        needs_tok = any("tokens" not in json.loads(l) for l in
                        pathlib.Path(d.fixed_jsonl).read_text().splitlines()[:1] if l.strip())
        plans["fixed"] = _data.BatchPlan(
            _prepare.fixed_data(s, target, target_params, tokenizer() if needs_tok else None, log,
                                feature_layers=feature_layers),
            s.seed + 1, d.tokens_per_batch, d.widths, d.max_prompt_tokens)
        weights["fixed"] = d.fixed_weight
        timings["fixed_data_s"] = time.perf_counter() - t0
    if d.draft_weight > 0:
        weights["draft"] = d.draft_weight
    sh = d.shards
    if sh.weight > 0:
        if not sh.dirs:
            raise ValueError("data.shards.weight > 0 but data.shards.dirs is empty: name the data engine's answer "
                             "directories (e.g. WORKDIR/responses_greedy)")
        if not s.is_head:
            raise ValueError(f"data.shards (streamed shards, tokens only) trains feature heads; draft.kind="
                             f"{s.draft.kind!r} needs the teacher's states of its data: use target or fixed data")
        t0 = time.perf_counter()
        st = plans["shards"] = shard_stream(s, target)
        weights["shards"] = sh.weight
        timings["shards_index_s"] = time.perf_counter() - t0
        where = "the target's features computed in each step"
        if s.head.feature_cache:
            t0 = time.perf_counter()
            feats = shard_features(s, st, target)
            if primary:
                feats.compute(_data.shard_feature_forward(target), target_params, log=log)
            st.with_features(feats)
            where = f"the target's features cached in {feats.dir}"
            timings["shard_features_s"] = time.perf_counter() - t0
        log(f"shards: {st.num_sequences} sequences, {st.loss_tokens_used()} loss tokens in {len(st.shards)} shards of "
            f"{', '.join(map(str, sh.dirs))} ({where})")
    if primary:
        distributed.barrier("specjax-distill-data")
    if not weights:
        raise ValueError("no data source: set target_weight, fixed_weight or draft_weight > 0")
    if s.is_head and "draft" in weights:
        raise ValueError(f"draft.kind={s.draft.kind!r} (a feature head) trains on target or fixed data only: "
                         f"set data.draft_weight = 0 (on-policy data for heads is not built yet)")
    return Sources(plans, weights, Mixture(list(weights), list(weights.values()), s.seed), timings)


def shard_stream(s, target=None) -> _stream.ShardStream:
    """The stream of a run's ``data.shards`` (its batches seeded by the run's seed); with
    ``target``, shards written for another vocabulary are refused naming both sizes."""
    d, sh = s.data, s.data.shards
    return _stream.ShardStream(list(sh.dirs), seed=s.seed + 2, tokens_per_batch=d.tokens_per_batch, widths=d.widths,
                               window=sh.window, max_prompt=d.max_prompt_tokens, max_loss_tokens=sh.max_loss_tokens,
                               vocab_size=None if target is None else target.vocab_size,
                               group_by_length=sh.group_by_length)


def shard_features(s, stream: _stream.ShardStream, target, layers=None) -> _stream.ShardFeatures:
    """The feature cache of a head's streamed shards (``head.feature_cache`` its dtype) under the
    run's data root, for the head's layers (`layers` to name others, e.g. to fill the cache for
    several head kinds in one forward)."""
    L = target.config.num_layers
    layers = _heads.feature_layers_of(s, target) if layers is None else layers
    key = dict(target=s.target, model_dtype=s.dtype)
    files = _prepare.checkpoint_signature(s.target)[1:]
    if files:       # a target given by path: its files (resolved), sizes and times, so a rewritten one is not matched
        key["files"] = [(str(pathlib.Path(f).resolve()), size, mtime) for f, size, mtime in files]
    return _stream.ShardFeatures(stream, _prepare.data_root(s), key=key, layers=[int(i) % L for i in layers],
                                 final_layer=L - 1, hidden_size=target.config.hidden_size,
                                 dtype=s.head.feature_cache or "float32")


def head_vocabulary(s, sources: Sources, target, tok, log) -> np.ndarray | None:
    """The reduced head's token ids (the ``draft.head_vocab`` most frequent continuation tokens
    of the data, plus the stop tokens; with ``draft.head_vocab_coverage``, the fewest covering
    that share of the data's continuation tokens, at most ``head_vocab``), or None for a full
    head."""
    if not s.draft.reduced:
        return None
    if not sources.plans:
        raise ValueError("a reduced head needs target, fixed or shard data to pick its tokens from")
    # (streamed answers end in the stop token and count it among their loss tokens)
    eos = _prepare.eos_ids(target, tok) if tok is not None or "shards" in sources.plans else ()
    counts = sum(p.token_counts(target.vocab_size) if isinstance(p, _stream.ShardStream)
                 else _sources.token_frequencies([p.data], target.vocab_size) for p in sources.plans.values())
    head_ids = _prepare.head_vocabulary(counts, s.draft.head_vocab, always=eos, coverage=s.draft.head_vocab_coverage)
    cover = counts[head_ids].sum() / max(int(counts.sum()), 1)
    chosen = f" (chosen for coverage >= {s.draft.head_vocab_coverage:g})" if s.draft.head_vocab_coverage else ""
    log(f"reduced head: {len(head_ids)} tokens{chosen} cover {cover:.4f} of the training continuations")
    return head_ids


def with_head_size(s, head_ids):
    """``s`` with ``draft.head_vocab`` the size of the head the data chose (`head_vocabulary`):
    what the objective, the draft and the export read. The workdir's config.json keeps the
    settings as given (a coverage, not a size), so a resume chooses again from the same data,
    which gives the same tokens (a resume on other data is refused unless
    ``allow_data_order_change``, and then the checkpoint's head shape must still match)."""
    if head_ids is None or s.draft.head_vocab == len(head_ids):
        return s
    return dataclasses.replace(s, draft=dataclasses.replace(s.draft, head_vocab=int(len(head_ids))))


@dataclasses.dataclass
class Trainee:
    """The draft being trained and everything its step reads: the objective (``draft``; a head's
    `HeadObjective`), the loss spec, the optimizer and its schedule, the train ``state`` and the
    ``frozen`` inputs (placed on the mesh when there is one; ``frozen_local`` the host copies),
    the teacher's head rows, and the jitted step."""
    draft: Any
    choice: _drafts.DraftChoice
    spec: _train.LossSpec
    schedule: Callable
    state: Any
    frozen: dict
    frozen_local: dict
    head_UD: Any
    full_head: Any
    step_fn: Callable
    mesh: Any

    def own_params(self, state) -> dict:
        """Host copies of the trained parameters (evaluation, on-policy data and the export read these)."""
        return sharding.to_host(state.params) if self.mesh is not None else state.params

    def place_batch(self, b: dict) -> dict:
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in b.items()}
        return sharding.put(b, sharding.batch_shardings(b, self.mesh))

    def head_params(self, state) -> dict:
        """A head's own parameters with its frozen ones (the target's left out)."""
        return {**self.own_params(state), **{k: v for k, v in self.frozen_local.items() if k != "target"}}

    def full_params(self, state) -> dict:
        """A standalone draft's parameters, trained and shared."""
        return _train.merge_params(self.own_params(state), self.frozen_local)

    def describe(self, s) -> dict:
        if s.is_head:
            d = self.draft
            return {"kind": s.draft.kind, **d.config.to_dict(), "ttt_steps": d.ttt_steps,
                    "feature_weight": d.feature_weight, "feature_noise": d.feature_noise}
        return {k: getattr(self.choice, k) for k in ("kind", "layers", "num_layers", "head_vocab", "train_head")}


def build_trainee(s, sources: Sources, target, target_params, head_ids, mesh) -> Trainee:
    """The draft of settings `s` (a head kind's objective, or a standalone draft built from the
    target), its optimizer over the run's length, the train state and the jitted step."""
    choice = s.draft
    if s.is_head:
        # The "draft" of the step is the head's static objective; its trainable params are the
        # head's own, and the target's params ride along in `frozen` (outside the gradient).
        draft = _heads.objective_from_config(s, target, head_ids)
        params = drafters.init_head_params(draft.config, _sources.key_for(s.seed, "draft-init"), head_ids=head_ids)
        trainable = draft.trainable
    else:
        draft, params = _drafts.build_draft(choice, target, target_params,
                                            key=_sources.key_for(s.seed, "draft-init"), head_ids=head_ids)
        trainable = choice.trainable
    spec = _train.LossSpec(s.loss.divergence, s.loss.beta, s.loss.temperature)
    o = s.optim
    total_steps = int(math.ceil(s.budget_tokens / max(sources.mean_tokens_per_batch(s.data.tokens_per_batch), 1.0)))
    optimizer, schedule = _train.make_optimizer(
        learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
        total_updates=max(1, total_steps // o.accumulate), end_lr_fraction=o.end_lr_fraction,
        clip_norm=o.clip_norm, weight_decay=o.weight_decay, accumulate=o.accumulate)
    state, frozen = _train.init_state(params, trainable, optimizer, _sources.key_for(s.seed, "train"))
    head_UD = _train.teacher_head(target, target_params, head_ids)
    full_head = _train.teacher_head(target, target_params, None)
    if s.is_head:
        frozen = {**frozen, "target": target_params}
    frozen_local = frozen
    state_sh = None
    if mesh is not None:
        state_sh, frozen_sh, head_sh = _train_shardings(mesh, state, frozen, head_UD, optimizer, draft, target)
        state = sharding.put(state, state_sh)
        frozen, head_UD = sharding.put(frozen, frozen_sh), sharding.put(head_UD, head_sh)
    step_fn = _train.make_train_step(draft, spec, optimizer, skip_nonfinite=o.on_nonfinite == "skip",
                                     loss=_heads.head_loss if s.is_head else _train.loss_fn, state_shardings=state_sh)
    return Trainee(draft, choice, spec, schedule, state, frozen, frozen_local, head_UD, full_head, step_fn, mesh)


def mesh_of(s):
    """The settings' mesh when the job has more than one device (across processes too), else
    None (one device: the plain jitted step)."""
    if jax.device_count() == 1:
        return None
    return sharding.mesh_from_config(dict(s.mesh))


def _train_shardings(mesh, state, frozen, head_UD, optimizer, draft, target):
    """Shardings of the train state, the frozen inputs and the teacher's head rows: Llama-layout
    parameters by `sharding.TRAIN_RULES` (a draft made of target layers by the draft's config,
    the target's own weights, which a head's step reads, by the target's), others by
    `sharding.fsdp_spec`."""
    draft_cfg = draft.config if isinstance(getattr(draft, "config", None), models.ModelConfig) else None
    state_sh = sharding.train_state_shardings(state, optimizer, mesh, config=draft_cfg)
    frozen_sh = {k: (sharding.param_shardings(v, mesh, config=target.config) if k == "target"
                     else sharding.param_shardings({k: v}, mesh, config=draft_cfg)[k])
                 for k, v in frozen.items()}
    head_sh = jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(("vocab", "embed"), sharding.TRAIN_RULES, mesh, np.shape(head_UD)))
    return state_sh, frozen_sh, head_sh
