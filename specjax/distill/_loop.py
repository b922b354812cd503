"""The distillation run: data sources, the jitted step, checkpoints, evaluation, metrics.

`train(config, workdir)` is restartable: with a checkpoint in ``workdir/checkpoints`` it
resumes from the newest readable one with the same data order (batch i depends only on the
seed and i) and the same PRNG stream (the key lives in the train state), so an interrupted run
ends with the same parameters as an uninterrupted one. On-policy data generated during the
run is kept in ``workdir/onpolicy`` and reused on resume.

On a device mesh (the config's ``mesh`` block: ``data`` x ``fsdp`` x ``model``, -1 = the rest; used
whenever the job has more than one device, across processes too) the step runs sharded: the
global batch's rows over data x fsdp, the trainable parameters and their optimizer state
FSDP-sharded (`sharding.TRAIN_RULES`), the target's weights by the same rules; batch i, the
loss (a mean over the global batch) and the PRNG stream are those of one device, so the
result does not depend on the mesh or the process count (up to float summation order).
Checkpoints are saved and restored sharded (each process writes its own shards) and restore
onto any mesh. Only process 0 writes metrics, logs, ``final.json`` and the export; data sets
(training, evaluation, on-policy refreshes) are made by process 0 first and then read from the
cache by the others, so the workdir and ``data_root`` must be one file system all processes share.

Outputs in the workdir: ``metrics.jsonl`` (one JSON line per logged step, per evaluation, and
per event such as a resume; a run that died mid-write leaves a torn last line, which the next
run sets aside as ``metrics.jsonl.torn-<k>`` with a ``torn_metrics`` event; steps logged after
the last checkpoint run again after a ``rewind`` event, whose later records supersede them), TensorBoard events when `tensorboardX` or `torch` with
tensorboard is installed, ``final.json``, and the draft artifact when ``export_dir`` is set.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoint as ckpt_lib
from specjax import distributed, drafters, files, models, sharding
from specjax.distill import _data, _drafts, _heads, _prepare, _sources, _stream, _train

MIX_STREAM = 7     # a fixed stream id for the per-step source choice


def with_overrides(config, overrides: dict):
    """Set dotted keys (``{"loss.divergence": "rkl"}``) or nested ones (``{"loss": {"divergence":
    "rkl"}}``, set key by key) on a ConfigDict, in place; returns it."""
    for k, v in flatten(overrides).items():
        node = config
        parts = k.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = v
    return config


def _last_logged_step(path: pathlib.Path) -> int:
    """The largest step of a train record in a metrics file (0 when there is none)."""
    last = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "train":
                last = max(last, int(rec.get("step", 0)))
    return last


def _last_eval_at(path: pathlib.Path, step: int) -> dict | None:
    """The last evaluation record of `step` in a metrics file (None when there is none)."""
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:      # a torn record (recover_jsonl sets those aside when a run starts)
            continue
        if rec.get("kind") == "eval" and rec.get("step") == step:
            found = rec
    return found


class MetricsWriter:
    """JSON lines (always) and TensorBoard scalars (when a writer package is installed)."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / "metrics.jsonl"
        self.tb = None
        try:
            from tensorboardX import SummaryWriter  # type: ignore
            self.tb = SummaryWriter(str(workdir / "tb"))
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter  # type: ignore
                self.tb = SummaryWriter(str(workdir / "tb"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                self.tb = None

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


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


# Config keys that fix the shapes / structure of the checkpointed train state (the draft's
# parameters and the optimizer state): a workdir's checkpoints only restore under the same values.
STATE_KEYS = ("target", "dtype", "draft", "optim.accumulate")
# What a key absent from an older workdir's config.json meant (keys added since).
STATE_DEFAULTS = {"head.input_norm": False}


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict (a ConfigDict's ``to_dict()``) as one level of dotted keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(c, workdir) -> None:
    """``ValueError`` naming each differing key (old and new value) when `workdir` already holds
    checkpoints written under a config that differs from `c` on a `STATE_KEYS` key (or a key
    of its head kind's `HeadKind.state_keys`: a kind ignores the others, e.g. Medusa the input
    norm that configs/distill_head.py turns on). Reads only:
    called before anything in the workdir is written."""
    workdir = pathlib.Path(workdir)
    stored_path, ckpt_dir = workdir / "config.json", workdir / "checkpoints"
    if not stored_path.is_file() or not ckpt_dir.is_dir() or not any(ckpt_dir.iterdir()):
        return
    try:
        old = flatten(json.loads(stored_path.read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"{stored_path}: unreadable ({e}); cannot check that the checkpoints in {ckpt_dir} "
                         f"match this config. Use a new workdir.") from e
    new = flatten(json.loads(c.to_json_best_effort()))
    missing = object()
    diff = []
    kind = new.get("draft.kind")
    keys = STATE_KEYS + (drafters.head_kind_of(kind).state_keys if kind in drafters.head_kinds() else ())
    for k in sorted(set(old) | set(new)):
        if not any(k == s or k.startswith(s + ".") for s in keys):
            continue
        a, b = old.get(k, STATE_DEFAULTS.get(k, missing)), new.get(k, STATE_DEFAULTS.get(k, missing))
        if a != b:
            diff.append(f"{k}: {'(absent)' if a is missing else json.dumps(a)} -> "
                        f"{'(absent)' if b is missing else json.dumps(b)}")
    if diff:
        raise ValueError(f"{workdir} holds checkpoints of a different draft/optimizer state; the config differs "
                         f"on {'; '.join(diff)} (stored -> new). Use a new workdir, or restore the old values.")


def _checkpoint_signature(name: str) -> tuple:
    """What identifies the contents of a target given by name or path: a registry name as it is;
    a file or directory by its files' sizes and modification times."""
    path = pathlib.Path(name).expanduser()
    files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
    return (str(name),) + tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


@functools.lru_cache(maxsize=1)
def _load_target_cached(signature: tuple, name: str, dtype: str):
    from specjax import build
    return build.load_target(name, dtype, True)


@functools.lru_cache(maxsize=1)
def _tokenizer_cached(signature: tuple, name: str):
    from specjax.models.tokenizer import load_tokenizer
    return load_tokenizer(name)


# A process that trains several drafts of one target (a study, a sweep) loads it once: the last
# target and tokenizer are kept, keyed by the checkpoint's files (a rewritten checkpoint is
# read again). The parameters are immutable arrays, so runs cannot change each other's.
def _load_target(c):
    return _load_target_cached(_checkpoint_signature(c.target), c.target, c.dtype)


def _tokenizer(c):
    return _tokenizer_cached(_checkpoint_signature(c.target), c.target)


def train(c, workdir, *, log: Callable[[str], None] = print, stop_after_steps: int | None = None) -> dict:
    """Run (or resume) a distillation. Returns the final summary (also in final.json)."""
    # Optimizer settings first: a bad one (e.g. clip_norm < 0) fails before anything is loaded.
    _train.check_optimizer_settings(
        learning_rate=c.optim.learning_rate, warmup_steps=c.optim.warmup_steps,
        end_lr_fraction=c.optim.end_lr_fraction, clip_norm=c.optim.clip_norm,
        weight_decay=c.optim.weight_decay, accumulate=c.optim.accumulate)
    on_nonfinite = _train.check_on_nonfinite(c.optim.get("on_nonfinite", "stop"))
    lag = c.get("metrics_lag", 1)
    if lag not in (0, 1):
        raise ValueError(f"metrics_lag={lag!r}: expected 0 (read each step's metrics at once) or 1 (one step later)")
    workdir = pathlib.Path(workdir)
    mesh = _mesh_of(c)
    primary = distributed.is_primary()
    if not primary:
        log = _silent
    # Before anything in the workdir is written: its checkpoints must fit this config.
    check_resume_config(c, workdir)
    distributed.barrier("specjax-distill-checked")     # every process has read the old config.json
    if primary:
        workdir.mkdir(parents=True, exist_ok=True)
        tmp = workdir / "config.json.tmp"
        tmp.write_text(c.to_json_best_effort(indent=1))
        tmp.replace(workdir / "config.json")
    distributed.barrier("specjax-distill-workdir")
    if mesh is not None:
        log(f"mesh: {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process(es)")
    t_start = time.perf_counter()
    target, target_params = _load_target(c)
    tok = None

    def tokenizer():
        nonlocal tok
        if tok is None:
            tok = _tokenizer(c)
        return tok

    widths = tuple(c.data.widths)
    max_prompt = int(c.data.get("max_prompt_tokens", 0))
    is_head = c.draft.kind in drafters.head_kinds()
    # A head's features come with its data when the config caches them (head.feature_cache).
    feature_layers = _heads.feature_layers_of(c, target) if is_head else None
    # ---- data ----------------------------------------------------------------------------
    # Process 0 makes the data sets first; the others then find them in the cache.
    if not primary:
        distributed.barrier("specjax-distill-data")
    sources: dict[str, _data.BatchPlan] = {}
    weights: dict[str, float] = {}
    timings = {}
    # On-policy data alone still needs prompts (and a reduced head its tokens): the target's
    # data set then serves as their source without being trained on (weight 0).
    prompts_only = c.data.target_weight <= 0 and c.data.draft_weight > 0 and c.data.fixed_weight <= 0
    if c.data.target_weight > 0 or prompts_only:
        t0 = time.perf_counter()
        sources["target"] = _data.BatchPlan(_prepare.target_data(c, target, target_params, tokenizer(), log,
                                                                 feature_layers=feature_layers),
                                            c.seed, c.data.tokens_per_batch, widths, max_prompt)
        if not prompts_only:
            weights["target"] = c.data.target_weight
        timings["target_data_s"] = time.perf_counter() - t0
    if c.data.fixed_weight > 0:
        t0 = time.perf_counter()
        needs_tok = any("tokens" not in json.loads(l) for l in
                        pathlib.Path(c.data.fixed_jsonl).read_text().splitlines()[:1] if l.strip())
        sources["fixed"] = _data.BatchPlan(
            _prepare.fixed_data(c, target, target_params, tokenizer() if needs_tok else None, log,
                                feature_layers=feature_layers),
            c.seed + 1, c.data.tokens_per_batch, widths, max_prompt)
        weights["fixed"] = c.data.fixed_weight
        timings["fixed_data_s"] = time.perf_counter() - t0
    if c.data.draft_weight > 0:
        weights["draft"] = c.data.draft_weight
    sh = c.data.get("shards", None)
    if sh is not None and sh.weight > 0:
        if not sh.dirs:
            raise ValueError("data.shards.weight > 0 but data.shards.dirs is empty: name the data engine's answer "
                             "directories (e.g. WORKDIR/responses_greedy)")
        if not is_head:
            raise ValueError(f"data.shards (streamed shards, tokens only) trains feature heads; draft.kind="
                             f"{c.draft.kind!r} needs the teacher's states of its data: use target or fixed data")
        t0 = time.perf_counter()
        sources["shards"] = _stream.ShardStream(
            list(sh.dirs), seed=c.seed + 2, tokens_per_batch=c.data.tokens_per_batch, widths=widths,
            window=int(sh.window), max_prompt=max_prompt, max_loss_tokens=int(sh.max_loss_tokens))
        weights["shards"] = sh.weight
        st = sources["shards"]
        log(f"shards: {st.num_sequences} sequences, {st.loss_tokens_used()} loss tokens in {len(st.shards)} shards of "
            f"{', '.join(map(str, sh.dirs))} (the target's features computed in each step)")
        timings["shards_index_s"] = time.perf_counter() - t0
    if primary:
        distributed.barrier("specjax-distill-data")
    if not weights:
        raise ValueError("no data source: set target_weight, fixed_weight or draft_weight > 0")
    mixture = Mixture(list(weights), list(weights.values()), c.seed)

    # ---- draft ---------------------------------------------------------------------------
    if is_head and "draft" in weights:
        raise ValueError(f"draft.kind={c.draft.kind!r} (a feature head) trains on target or fixed data only: "
                         f"set data.draft_weight = 0 (on-policy data for heads is not built yet)")
    choice = _drafts.DraftChoice.from_config(c.draft)
    head_ids = None
    if choice.head_vocab:
        # (streamed answers end in the stop token and count it among their loss tokens)
        eos = _prepare.eos_ids(target, tok) if tok is not None or "shards" in sources else ()
        if not sources:
            raise ValueError("a reduced head needs target, fixed or shard data to pick its tokens from")
        counts = sum(p.token_counts(target.vocab_size) if isinstance(p, _stream.ShardStream)
                     else _sources.token_frequencies([p.data], target.vocab_size) for p in sources.values())
        head_ids = _prepare.head_vocabulary(counts, choice.head_vocab, always=eos)
        cover = counts[head_ids].sum() / max(int(counts.sum()), 1)
        log(f"reduced head: {len(head_ids)} tokens cover {cover:.4f} of the training continuations")
    if is_head:
        # The "draft" of the step is the head's static objective; its trainable params are the
        # head's own, and the target's params ride along in `frozen` (outside the gradient).
        draft = _heads.objective_from_config(c, target, head_ids)
        params = drafters.init_head_params(draft.config, _sources.key_for(c.seed, "draft-init"), head_ids=head_ids)
        trainable = draft.trainable
    else:
        draft, params = _drafts.build_draft(choice, target, target_params,
                                            key=_sources.key_for(c.seed, "draft-init"), head_ids=head_ids)
        trainable = choice.trainable
    spec = _train.LossSpec(c.loss.divergence, float(c.loss.beta), float(c.loss.temperature))
    # Loss tokens per step, for the schedule's length: the trained sources' (on-policy data alone:
    # its prompts' data set as the estimate).
    trained = [p for n, p in sources.items() if n in weights] or list(sources.values())
    mean_tokens = np.mean([p.mean_tokens_per_batch() for p in trained]) if trained else c.data.tokens_per_batch / 2
    total_steps = int(math.ceil(c.budget_tokens / max(mean_tokens, 1.0)))
    accumulate = int(c.optim.accumulate)
    optimizer, schedule = _train.make_optimizer(
        learning_rate=c.optim.learning_rate, warmup_steps=c.optim.warmup_steps,
        total_updates=max(1, total_steps // accumulate), end_lr_fraction=c.optim.end_lr_fraction,
        clip_norm=c.optim.clip_norm, weight_decay=c.optim.weight_decay, accumulate=accumulate)
    state, frozen = _train.init_state(params, trainable, optimizer, _sources.key_for(c.seed, "train"))
    head_UD = _train.teacher_head(target, target_params, head_ids)
    full_head = _train.teacher_head(target, target_params, None)
    if is_head:
        frozen = {**frozen, "target": target_params}
    # Evaluation, on-policy generation and the export read host copies (`own_params`); the
    # step reads the placed ones.
    frozen_local = frozen
    state_sh = None
    if mesh is not None:
        state_sh, frozen_sh, head_sh = _train_shardings(mesh, state, frozen, head_UD, optimizer, draft, target)
        state = sharding.put(state, state_sh)
        frozen, head_UD = sharding.put(frozen, frozen_sh), sharding.put(head_UD, head_sh)
    step_fn = _train.make_train_step(draft, spec, optimizer, skip_nonfinite=on_nonfinite == "skip",
                                     loss=_heads.head_loss if is_head else _train.loss_fn, state_shardings=state_sh)

    def own_params(state):
        return sharding.to_host(state.params) if mesh is not None else state.params

    def place_batch(b):
        if mesh is None:
            return {k: jnp.asarray(v) for k, v in b.items()}
        return sharding.put(b, sharding.batch_shardings(b, mesh))

    # ---- resume --------------------------------------------------------------------------
    if primary:     # a run that died mid-write left a torn last record: keep the whole ones
        kept, aside = files.recover_jsonl(workdir / "metrics.jsonl")
        if aside is not None:
            log(f"{workdir / 'metrics.jsonl'}: its last record was torn (a run stopped mid-write); kept {kept} "
                f"complete records, set the rest aside as {aside.name}")
    writer = MetricsWriter(workdir) if primary else _NullWriter(workdir)
    if primary and aside is not None:
        writer.write({"kind": "event", "event": "torn_metrics", "set_aside": aside.name, "records_kept": kept})
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", keep=c.keep_checkpoints, async_save=c.async_checkpoints)
    meta = {"tokens": 0, "elapsed_s": 0.0}
    restored = ckpt.restore_latest(state)
    # Streamed shards are read in an order fixed by their contents: a resumed run must see the same ones.
    fingerprints = {n: p.fingerprint() for n, p in sources.items() if isinstance(p, _stream.ShardStream)}
    if restored is not None:
        old = restored.meta.get("data_fingerprints", {})
        changed = [n for n, f in fingerprints.items() if n in old and old[n] != f]
        if changed:
            ckpt.close()
            raise ValueError(f"{workdir}: the checkpoints were trained on other shards than data.shards names now "
                             f"({', '.join(f'{n}: {old[n]} -> {fingerprints[n]}' for n in changed)}: shards added, "
                             f"removed or remade, or another max_loss_tokens); resuming would not continue the same "
                             f"data order. Use a new workdir, or restore the shards")
        state, meta = restored.state, restored.meta
        for s, err in restored.skipped:
            writer.write({"kind": "event", "event": "unreadable_checkpoint", "step": s, "error": err})
        writer.write({"kind": "event", "event": "resume", "step": restored.step, "tokens": meta["tokens"]})
        log(f"resumed from step {restored.step} ({meta['tokens']} tokens)")
    start = int(state.step)
    tokens_done = int(meta["tokens"])
    logged = _last_logged_step(writer.path) if primary else 0
    if logged > start:      # steps after the checkpoint run again: mark where the old records stop counting
        writer.write({"kind": "event", "event": "rewind", "step": start, "logged_up_to": logged})
        log(f"steps {start + 1}..{logged} were logged by an earlier run after its last checkpoint; they run again "
            f"(the records before the 'rewind' event are superseded)")

    # ---- evaluation ----------------------------------------------------------------------
    eval_plan = None
    if c.eval.every > 0:
        fixed_eval = c.eval.get("data_jsonl", "")
        needs_tok = not fixed_eval or any("tokens" not in json.loads(l) for l in
                                          pathlib.Path(fixed_eval).read_text().splitlines()[:1] if l.strip())
        if not primary:                  # process 0 makes the evaluation set; the others then read it
            distributed.barrier("specjax-distill-eval-data")
        eval_plan = _prepare.eval_plan(c, target, target_params, tokenizer() if needs_tok else None, log)
        if primary:
            distributed.barrier("specjax-distill-eval-data")

    def run_eval(step, state):
        if eval_plan is None:
            return None
        t0 = time.perf_counter()
        gammas = tuple(range(1, int(c.eval.gamma) + 1))
        if is_head:
            own = {**own_params(state), **{k: v for k, v in frozen_local.items() if k != "target"}}
            res = _heads.evaluate_head(draft, own, target_params, eval_plan, gammas)
        else:
            full = _train.merge_params(own_params(state), frozen_local)
            res = _train.evaluate(draft, full, full_head, eval_plan, gammas)
        res.update({"kind": "eval", "step": int(step), "tokens": tokens_done, "eval_s": time.perf_counter() - t0})
        writer.write(res)
        log(f"eval step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items() if isinstance(v, float)))
        return res

    # ---- on-policy data ------------------------------------------------------------------
    onpolicy: dict[int, _data.BatchPlan] = {}

    def train_prompts() -> list[list[int]]:
        """The distinct prompts of the target / fixed data (for the target data: the Spec-Bench
        train split), in first-seen order."""
        seen, out = set(), []
        limit = int(c.data.get("draft_max_prompt_tokens", 0)) or None
        for plan in sources.values():
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

    def draft_plan(step, state) -> tuple[_data.BatchPlan, int]:
        R = int(c.data.draft_refresh_every)
        r = step // R
        if r not in onpolicy:
            onpolicy.clear()
            t0 = time.perf_counter()
            prompts = train_prompts()
            pick = np.random.default_rng([c.seed, 11, r]).choice(len(prompts), min(c.data.draft_prompts, len(prompts)),
                                                                  replace=False)
            full = _train.merge_params(own_params(state), frozen_local)
            # a host copy of the key (the train state's lives on the mesh), in every process
            key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(sharding.to_host(state.key))), r)
            if not primary:         # process 0 writes the refresh; the others then read it
                distributed.barrier(f"specjax-onpolicy-{r}")
            data = _sources.generated_data(
                workdir / "onpolicy" / f"refresh_{r:05d}", draft, full, target, target_params,
                [prompts[i] for i in sorted(pick)],
                key=key, temperature=c.data.temperature, samples_per_prompt=1,
                max_new_tokens=c.data.draft_max_new_tokens, batch_size=c.data.gen_batch_size,
                eos_ids=_prepare.eos_ids(target, tok), widths=widths, source=f"draft-r{r}", log=log)
            if primary:
                distributed.barrier(f"specjax-onpolicy-{r}")
            if data.num_loss_tokens == 0:
                raise ValueError(f"on-policy refresh {r} at step {step}: the draft generated no tokens for "
                                 f"{len(pick)} prompts (source {data.seqs.source}; non-finite draft "
                                 f"parameters?), so there is no on-policy data to train on")
            onpolicy[r] = _data.BatchPlan(data, c.seed * 1000 + r, c.data.tokens_per_batch, widths)
            writer.write({"kind": "event", "event": "onpolicy_refresh", "step": step, "refresh": r,
                          "loss_tokens": data.num_loss_tokens, "seconds": time.perf_counter() - t0})
        return onpolicy[r], mixture.index_within(step, r * R)

    # ---- loop ----------------------------------------------------------------------------
    if start == 0 and c.eval.at_start:
        run_eval(0, state)
    bar = None
    if c.progress and primary:
        from tqdm import tqdm
        bar = tqdm(total=c.budget_tokens, initial=min(tokens_done, c.budget_tokens), unit="tok", dynamic_ncols=True,
                   desc="distill")
    step = start
    t_loop, tok_loop = time.perf_counter(), 0
    elapsed0 = float(meta.get("elapsed_s", 0.0))
    # A run resumed after its last evaluation (e.g. stopped before the export) keeps that record.
    last_eval = _last_eval_at(writer.path, start) if primary else None
    skipped = 0
    pending = None      # (step, source, tokens after it, lr, its metrics still on the device)

    def report(p):
        """Bring one step's metrics to the host, act on its on-device non-finite flag, log it."""
        nonlocal skipped
        at, name, tokens_at, loop_tokens_at, lr, aux = p
        aux = {k: float(v) for k, v in jax.device_get(aux).items()}
        if aux.pop("nonfinite"):
            what = f"non-finite loss ({aux['loss']}), gradient norm ({aux['grad_norm']}) or parameters"
            writer.write({"kind": "event", "event": "nonfinite", "step": at, "source": name,
                          "action": on_nonfinite, "loss": aux["loss"], "grad_norm": aux["grad_norm"]})
            if on_nonfinite == "stop":
                ckpt.wait()
                writer.close()
                ckpt.close()
                if bar is not None:
                    bar.close()
                raise FloatingPointError(
                    f"step {at} (source {name}): {what}; stopped (optim.on_nonfinite='stop'). The last "
                    f"checkpoint is from before this step; lower optim.learning_rate, or set "
                    f"optim.on_nonfinite='skip' to skip such steps")
            skipped += 1
            log(f"step {at} (source {name}): {what}; step skipped ({skipped} so far)")
        elapsed = time.perf_counter() - t_loop          # this step's metrics on the host, since the loop began
        writer.write({"kind": "train", "step": at, "tokens": tokens_at, "source": name, "skipped_steps": skipped,
                      "lr": lr, "tokens_per_s": loop_tokens_at / max(elapsed, 1e-9), "elapsed_s": elapsed, **aux})
        if bar is not None:
            bar.set_postfix(loss=f"{aux['loss']:.3f}", alpha=f"{aux['alpha_on_head']:.3f}", step=at)

    while tokens_done < c.budget_tokens:
        if stop_after_steps is not None and step >= stop_after_steps:
            break
        name = mixture.names[mixture.choice(step)]
        if name == "draft":
            # On-policy data is generated from the current draft and cached on disk: the last
            # step's non-finite check comes first, so no data is made from a broken draft.
            if pending is not None:
                report(pending)
                pending = None
            plan, idx = draft_plan(step, state)
        else:
            plan, idx = sources[name], mixture.index_within(step)
        host_batch = plan.batch(idx)
        # The step's loss tokens (its metrics' loss_tokens) counted from the host's batch, so the
        # budget needs nothing back from the device.
        n = int(np.sum(np.asarray(host_batch["mask"])))
        state, aux = step_fn(state, frozen, head_UD, place_batch(host_batch))
        step += 1
        tokens_done += n
        tok_loop += n
        if bar is not None:
            bar.update(n)
        # Metrics are read `metrics_lag` steps late, so the host dispatches the next step before
        # waiting on this one. The non-finite flag is computed on the device with the step
        # (`make_train_step`); every pending step is read before a checkpoint, an evaluation or
        # the end, so no non-finite state reaches a checkpoint or export (with 'skip' such a
        # step never changed the parameters; with 'stop' the run stops at the read).
        if pending is not None:
            report(pending)
            pending = None
        pending = (step, name, tokens_done, tok_loop, float(schedule(max(0, (step - 1) // accumulate))), aux)
        done = tokens_done >= c.budget_tokens
        if lag == 0 or done or step % c.checkpoint_every == 0 or (c.eval.every > 0 and step % c.eval.every == 0):
            report(pending)
            pending = None
        if step % c.checkpoint_every == 0 or done:
            meta = {"tokens": tokens_done, "elapsed_s": elapsed0 + time.perf_counter() - t_start,
                    "data_fingerprints": fingerprints}
            ckpt.save(step, state, meta, force=True)
        if c.eval.every > 0 and (step % c.eval.every == 0 or done):
            last_eval = run_eval(step, state)
    if pending is not None:         # a stop_after_steps break
        report(pending)
    ckpt.wait()
    if bar is not None:
        bar.close()
    summary = {"steps": step, "tokens": tokens_done, "train_tokens_per_s": tok_loop / max(time.perf_counter() - t_loop, 1e-9),
               "wall_s": time.perf_counter() - t_start, **timings, "divergence": spec.divergence,
               "skipped_steps": skipped,
               # Loss tokens of one pass over each fixed data set that is trained on (prompts longer than
               # max_prompt_tokens left out, as the batches leave them); on-policy data has no fixed size.
               "data_loss_tokens": {name: plan.loss_tokens_used() for name, plan in sources.items()
                                    if name in weights},
               "draft": ({"kind": c.draft.kind, **draft.config.to_dict(), "ttt_steps": draft.ttt_steps,
                          "feature_weight": draft.feature_weight, "feature_noise": draft.feature_noise} if is_head else
                         {k: getattr(choice, k) for k in ("kind", "layers", "num_layers", "head_vocab", "train_head")}),
               "eval": last_eval}
    # Host copies of the parameters in every process (gathering them is a collective), then
    # process 0 alone exports and writes.
    host_params = own_params(state) if tokens_done >= c.budget_tokens and c.export_dir else None
    if not primary:
        ckpt.close()
        return summary
    if tokens_done >= c.budget_tokens and c.export_dir and is_head:
        own = {**host_params, **{k: v for k, v in frozen_local.items() if k != "target"}}
        if not bool(_train.all_finite(own)):
            raise FloatingPointError(f"not exporting to {c.export_dir}: the head's parameters are not finite")
        desc = drafters.save_head(c.export_dir, draft.config, own, dtype=c.export_dtype, info={
            "target": c.target, "target_sha256": _target_sha(c.target), "divergence": spec.divergence,
            "ttt_steps": draft.ttt_steps, "feature_weight": draft.feature_weight,
            "feature_noise": draft.feature_noise, "tokens": tokens_done, "steps": step, "eval": last_eval})
        summary["export"] = {"dir": str(c.export_dir), "bytes": desc["bytes"], "sha256": desc["sha256"]}
        log(f"exported the head to {c.export_dir} ({desc['bytes'] / 1e6:.1f} MB)")
    elif tokens_done >= c.budget_tokens and c.export_dir:
        from specjax.models.draft_artifact import save_draft
        full = _train.merge_params(host_params, frozen_local)
        if not bool(_train.all_finite(full)):      # the loop's check makes this unreachable; never export NaN
            raise FloatingPointError(f"not exporting to {c.export_dir}: the draft's parameters are not finite")
        desc = save_draft(c.export_dir, draft, full, shared=choice.shared, dtype=c.export_dtype, info={
            "target": c.target, "target_sha256": _target_sha(c.target), "divergence": spec.divergence,
            "tokens": tokens_done, "steps": step, "eval": last_eval})
        summary["export"] = {"dir": str(c.export_dir), "bytes": desc["bytes"], "sha256": desc["sha256"]}
        log(f"exported the draft to {c.export_dir} ({desc['bytes'] / 1e6:.1f} MB)")
    (workdir / "final.json").write_text(json.dumps(summary, indent=1, default=str))
    writer.close()
    ckpt.close()
    return summary


def _silent(*_args, **_kwargs) -> None:
    """The log of processes other than 0."""


class _NullWriter:
    """The metrics writer of processes other than 0 (process 0 writes the one file)."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / "metrics.jsonl"

    def write(self, record: dict) -> None:
        pass

    def close(self):
        pass


def _mesh_of(c):
    """The config's mesh when the job has more than one device (across processes too), else
    None (one device: the plain jitted step)."""
    if jax.device_count() == 1:
        return None
    block = c.get("mesh", None)
    return sharding.mesh_from_config(block if block is not None else {"data": -1, "fsdp": 1, "model": 1})


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


def _target_sha(name: str) -> str:
    """The sha256 of the target's checkpoint file (recorded for known names)."""
    from specjax.models import registry
    if name in registry.KNOWN:
        return registry.KNOWN[name].sha256
    path = pathlib.Path(name)
    return registry.file_sha256(path) if path.is_file() else ""
