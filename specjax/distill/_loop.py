"""The distillation run: data sources, the jitted step, checkpoints, evaluation, metrics.

`train(config, workdir)` is restartable: with a checkpoint in ``workdir/checkpoints`` it
resumes from the newest readable one with the same data order (batch i depends only on the
seed and i) and the same PRNG stream (the key lives in the train state), so an interrupted run
ends with the same parameters as an uninterrupted one. On-policy data generated during the
run is kept in ``workdir/onpolicy`` and reused on resume. A resume under another seed or other
data settings (`DATA_ORDER_KEYS`) would not continue that order: it is refused naming each
change, unless ``allow_data_order_change`` (then a ``data_order_change`` event records the old
and new values). One run per workdir: process 0 holds the directory's lock
(`specjax.files.workdir_lock`) from before it writes anything to the end.

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

import contextlib
import errno
import functools
import json
import os
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoint as ckpt_lib
from specjax import distributed, drafters, files, sharding
from specjax.distill import _data, _heads, _prepare, _settings, _setup, _sources, _train
from specjax.distill._setup import MIX_STREAM, Mixture  # noqa: F401  (re-exported)


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
        with naming(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


@contextlib.contextmanager
def naming(path):
    """An OSError raised inside without a file name (a ``write`` or ``close`` that hit a full
    disk, ENOSPC, or the file size limit, EFBIG) is raised again naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        if e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
        # numpy's short write ("91552 requested and 24968 written") carries no errno
        raise OSError(f"{path}: could not write ({e}): a full disk or the file size limit (ulimit -f)?") from e


# Config keys that fix the shapes / structure of the checkpointed train state (the draft's
# parameters and the optimizer state): a workdir's checkpoints only restore under the same values.
STATE_KEYS = ("target", "dtype", "draft", "optim.accumulate")
# Config keys that fix which batch step i trains on (batch i depends only on them, the data and
# i): the seed and every data setting, except the generation batch size (throughput only) and
# the shard directories' paths (their contents are checked by fingerprint, so shards moved
# elsewhere resume). A resume under other values is refused unless ``allow_data_order_change``.
DATA_ORDER_KEYS = ("seed", "data")
DATA_ORDER_FREE = ("data.gen_batch_size", "data.shards.dirs")
# What a run creates in its workdir: directories, and files (a file where a directory goes, or
# the reverse, is refused before anything is written).
WORKDIR_DIRS = ("checkpoints", "onpolicy", "tb")
WORKDIR_FILES = ("config.json", "metrics.jsonl", "final.json")


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict (a ConfigDict's ``to_dict()``) as one level of dotted keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _flat_settings(values) -> dict:
    """A config's dotted keys after the typed settings' defaults and types (so a key absent
    from an older workdir's config.json reads as the default it meant)."""
    return flatten(json.loads(json.dumps(_settings.distill_settings(values).to_dict())))


def _under(k: str, keys) -> bool:
    return any(k == s or k.startswith(s + ".") for s in keys)


_MISSING = object()      # a key one config lacks


def _changes(old: dict, new: dict, keys, free=()) -> dict:
    """{dotted key: (old, new)} of the keys under `keys` (not under `free`) whose values differ
    (`_MISSING` for a key one side lacks)."""
    return {k: (old.get(k, _MISSING), new.get(k, _MISSING)) for k in sorted(set(old) | set(new))
            if _under(k, keys) and not _under(k, free) and old.get(k, _MISSING) != new.get(k, _MISSING)}


def _shown(v) -> str:
    return "(absent)" if v is _MISSING else json.dumps(v)


def _listed(changes: dict) -> str:
    return "; ".join(f"{k}: {_shown(a)} -> {_shown(b)}" for k, (a, b) in changes.items())


def check_resume_config(c, workdir) -> dict:
    """Refuse to resume `workdir` under a config `c` (a config or `DistillSettings`) that its
    checkpoints were not trained under. When it holds checkpoints and a config.json:

    * ``ValueError`` naming each differing key (old and new value) of a `STATE_KEYS` key (or a
      key of its head kind's `HeadKind.state_keys`: a kind ignores the others, e.g. Medusa the
      input norm that configs/distill_head.py turns on): the state would not restore;
    * ``ValueError`` naming each differing data-order key (`DATA_ORDER_KEYS`: the seed, the
      batch size, the shard window, the mixture, the data sets) unless ``c`` sets
      ``allow_data_order_change``: the run would continue with other batches than it had.

    Returns the data-order changes allowed ({key: (old, new)}; empty when none), which the run
    records as a ``data_order_change`` event. Reads only: called before anything in the workdir
    is written."""
    workdir = pathlib.Path(workdir)
    stored_path, ckpt_dir = workdir / "config.json", workdir / "checkpoints"
    if not stored_path.is_file() or not ckpt_dir.is_dir() or not any(ckpt_dir.iterdir()):
        return {}
    try:
        old = _flat_settings(json.loads(stored_path.read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"{stored_path}: unreadable or not a distillation config this trainer reads ({e}); "
                         f"cannot check that the checkpoints in {ckpt_dir} match this config. Use a new workdir.") \
            from e
    s = _settings.distill_settings(c)
    new = _flat_settings(s)
    kind = new.get("draft.kind")
    keys = STATE_KEYS + (drafters.head_kind_of(kind).state_keys if kind in drafters.head_kinds() else ())
    state = _changes(old, new, keys)
    if state:
        raise ValueError(f"{workdir} holds checkpoints of a different draft/optimizer state; the config differs "
                         f"on {_listed(state)} (stored -> new). Use a new workdir, or restore the old values.")
    order = _changes(old, new, DATA_ORDER_KEYS, DATA_ORDER_FREE)
    if order and not s.allow_data_order_change:
        raise ValueError(f"{workdir} holds checkpoints trained in another data order; the config differs on "
                         f"{_listed(order)} (stored -> new), so the resumed run would not see the batches it would "
                         f"have. Restore the old values, use a new workdir, or set allow_data_order_change=True to "
                         f"continue in the new order (recorded as a data_order_change event in metrics.jsonl)")
    return order


def check_workdir(workdir) -> pathlib.Path:
    """The run directory as a path: ValueError when it is empty or blank (which would mean the
    current directory), a file, a symlink loop, or holds a file where the run makes a directory
    (`WORKDIR_DIRS`) or a directory where it writes a file (`WORKDIR_FILES`). Reads only."""
    if workdir is None or not str(workdir).strip():
        raise ValueError(f"workdir={'' if workdir is None else str(workdir)!r}: empty; name the run directory (an "
                         f"empty value would mean the current directory)")
    workdir = pathlib.Path(workdir).expanduser()
    problem = files.path_problem(workdir, True)
    if problem is None and workdir.is_dir():
        problem = next(filter(None, [files.path_problem(workdir / d, True) for d in WORKDIR_DIRS]
                              + [files.path_problem(workdir / f, False) for f in WORKDIR_FILES]), None)
    if problem:
        raise ValueError(f"workdir {workdir}: {problem}; nothing was written")
    return workdir


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
    return _load_target_cached(_prepare.checkpoint_signature(c.target), c.target, c.dtype)


def _tokenizer(c):
    return _tokenizer_cached(_prepare.checkpoint_signature(c.target), c.target)


def check_settings(s) -> None:
    """The settings `train` checks before it loads anything (optimizer, non-finite policy,
    metrics lag): ``ValueError`` naming the setting."""
    o = s.optim
    _train.check_optimizer_settings(
        learning_rate=o.learning_rate, warmup_steps=o.warmup_steps, end_lr_fraction=o.end_lr_fraction,
        clip_norm=o.clip_norm, weight_decay=o.weight_decay, accumulate=o.accumulate)
    _train.check_on_nonfinite(o.on_nonfinite)
    if s.metrics_lag not in (0, 1):
        raise ValueError(f"metrics_lag={s.metrics_lag!r}: expected 0 (read each step's metrics at once) or 1 "
                         f"(one step later)")
    from specjax import build
    build.check_seed(s.seed)
    build.check_mesh(s.mesh)
    if s.export_dir:        # written only after the whole training: a file there is refused now
        problem = files.path_problem(pathlib.Path(s.export_dir).expanduser(), True)
        if problem:
            raise ValueError(f"export_dir={s.export_dir!r}: {problem}; the draft is written there at the end of "
                             f"training (nothing was run)")


def _claim_workdir(s, workdir: pathlib.Path) -> dict:
    """Check the workdir's checkpoints against `s` (before anything is written), then record `s`
    as its config.json. Returns the data-order changes allowed (`check_resume_config`)."""
    changes = check_resume_config(s, workdir)
    distributed.barrier("specjax-distill-checked")     # every process has read the old config.json
    if distributed.is_primary():
        workdir.mkdir(parents=True, exist_ok=True)
        tmp = workdir / "config.json.tmp"
        with naming(tmp):
            tmp.write_text(json.dumps(s.to_dict(), indent=1))
        tmp.replace(workdir / "config.json")
    distributed.barrier("specjax-distill-workdir")
    return changes


class _Tokenizer:
    """The target's tokenizer, loaded on first call (a run on tokenized data never loads it)."""

    def __init__(self, s):
        self.s, self.loaded = s, None

    def __call__(self):
        if self.loaded is None:
            self.loaded = _tokenizer(self.s)
        return self.loaded


def train(config, workdir, *, log: Callable[[str], None] = print, stop_after_steps: int | None = None) -> dict:
    """Run (or resume) a distillation. `config`: a ConfigDict of configs/distill.py's layout, a
    nested mapping, or `DistillSettings` (typed here, once). Returns the final summary (also in
    final.json)."""
    s = _settings.distill_settings(config)
    check_settings(s)        # a bad setting fails before anything is loaded
    workdir = check_workdir(workdir)
    check_resume_config(s, workdir)     # read only: a refused resume leaves the workdir untouched
    mesh = _setup.mesh_of(s)
    if not distributed.is_primary():
        log = _silent
    # One run per workdir: process 0 holds the directory's lock (released when it exits, however
    # it exits) from here to the end; a second run on it stops here, naming the holder.
    lock = files.workdir_lock(workdir, "specjax distill") if distributed.is_primary() else contextlib.nullcontext()
    with lock:
        changes = _claim_workdir(s, workdir)
        if mesh is not None:
            log(f"mesh: {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process(es)")
        t_start = time.perf_counter()
        target, target_params = _load_target(s)
        tokenizer = _Tokenizer(s)
        with naming(s.data_root or "the data cache (data_root)"):
            sources = _setup.load_sources(s, target, target_params, tokenizer, log=log)
        head_ids = _setup.head_vocabulary(s, sources, target, tokenizer.loaded, log)
        s = _setup.with_head_size(s, head_ids)
        trainee = _setup.build_trainee(s, sources, target, target_params, head_ids, mesh)
        run = _Run(s, workdir, trainee, sources, target, target_params, tokenizer, log, t_start,
                   data_order_changes=changes)
        try:
            run.loop(stop_after_steps)
        except BaseException:
            run.close(abort=True)
            raise
        run.close()
        return run.finish(time.perf_counter() - t_start)


def fill_shard_features(configs, *, log: Callable[[str], None] = print) -> int:
    """Cache, in one target forward per shard, the streamed-shard features every config in
    `configs` reads (the union of their heads' layers and the last; all must name the same
    target, data root, shards and cache dtype), so that runs of several head kinds over the same
    shards do not each run the target over them. Returns the positions computed (0: all there)."""
    settings = [_settings.distill_settings(c) for c in configs]
    keys = {(x.target, x.dtype, x.data_root, x.head.feature_cache, x.data.shards.dirs, x.data.widths,
             x.data.max_prompt_tokens) for x in settings}
    if len(keys) != 1 or not all(x.head.feature_cache and x.is_head for x in settings):
        raise ValueError("fill_shard_features: the configs must be feature heads caching features "
                         "(head.feature_cache) of the same target, data root, shards, widths and prompt limit")
    s = max(settings, key=lambda x: x.data.shards.max_loss_tokens or float("inf"))   # the most shards
    target, target_params = _load_target(s)
    layers = sorted({int(i) % target.config.num_layers for x in settings for i in _heads.feature_layers_of(x, target)})
    feats = _setup.shard_features(s, _setup.shard_stream(s, target), target, layers=layers)
    return feats.compute(_data.shard_feature_forward(target), target_params, log=log)


class _Run:
    """One distillation's loop: metrics, checkpoints (resumed from the newest readable one),
    evaluation, on-policy data, the steps, the summary and the export."""

    def __init__(self, s, workdir: pathlib.Path, trainee: _setup.Trainee, sources: _setup.Sources, target,
                 target_params, tokenizer: _Tokenizer, log, t_start: float, data_order_changes: dict | None = None):
        self.s, self.workdir, self.t, self.sources, self.log = s, workdir, trainee, sources, log
        self.data_order_changes = data_order_changes or {}
        self.target, self.target_params, self.tokenizer = target, target_params, tokenizer
        self.primary = distributed.is_primary()
        self.t_start = t_start
        self.bar = None
        self.skipped = 0
        self.last_eval = None
        self._onpolicy: dict[int, _data.BatchPlan] = {}
        self.writer = self.ckpt = None
        try:
            self._open()
            self.eval_plan = self._eval_plan()
        except BaseException:
            self._close_files(quiet=True)
            raise

    # ----------------------------------------------------------------------------- resume
    def _open(self) -> None:
        s, workdir, log = self.s, self.workdir, self.log
        aside = None
        if self.primary:     # a run that died mid-write left a torn last record: keep the whole ones
            kept, aside = files.recover_jsonl(workdir / "metrics.jsonl")
            if aside is not None:
                log(f"{workdir / 'metrics.jsonl'}: its last record was torn (a run stopped mid-write); kept {kept} "
                    f"complete records, set the rest aside as {aside.name}")
        self.writer = writer = MetricsWriter(workdir) if self.primary else _NullWriter(workdir)
        if aside is not None:
            writer.write({"kind": "event", "event": "torn_metrics", "set_aside": aside.name, "records_kept": kept})
        self.ckpt = ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", keep=s.keep_checkpoints,
                                                 async_save=s.async_checkpoints)
        # The run owns the state from here (a restored one replaces the initial one, which is freed).
        (self.state, self.t.state), meta = (self.t.state, None), {"tokens": 0, "elapsed_s": 0.0}
        restored = ckpt.restore_latest(self.state)
        # Streamed shards are read in an order fixed by their contents: a resumed run must see the same ones.
        self.fingerprints = fingerprints = self.sources.fingerprints()
        if restored is not None:
            old = restored.meta.get("data_fingerprints", {})
            changed = [n for n, f in fingerprints.items() if n in old and old[n] != f]
            if changed:
                ckpt.close()
                raise ValueError(f"{workdir}: the checkpoints were trained on other shards than data.shards names now "
                                 f"({', '.join(f'{n}: {old[n]} -> {fingerprints[n]}' for n in changed)}: shards added, "
                                 f"removed or remade, or another max_loss_tokens); resuming would not continue the "
                                 f"same data order. Use a new workdir, or restore the shards")
            self.state, meta = restored.state, restored.meta
            for step, err in restored.skipped:
                writer.write({"kind": "event", "event": "unreadable_checkpoint", "step": step, "error": err})
            writer.write({"kind": "event", "event": "resume", "step": restored.step, "tokens": meta["tokens"]})
            log(f"resumed from step {restored.step} ({meta['tokens']} tokens)")
            if self.data_order_changes:      # allowed by allow_data_order_change; config.json holds the new values
                writer.write({"kind": "event", "event": "data_order_change", "step": restored.step,
                              "changes": {k: {"old": None if a is _MISSING else a, "new": None if b is _MISSING else b}
                                          for k, (a, b) in self.data_order_changes.items()}})
                log(f"data order changed at step {restored.step} (allow_data_order_change): "
                    f"{_listed(self.data_order_changes)} (stored -> new)")
        self.start = self.step = int(self.state.step)
        self.tokens_done = int(meta["tokens"])
        self.elapsed0 = float(meta.get("elapsed_s", 0.0))
        logged = _last_logged_step(writer.path) if self.primary else 0
        if logged > self.start:      # steps after the checkpoint run again: mark where the old records stop counting
            writer.write({"kind": "event", "event": "rewind", "step": self.start, "logged_up_to": logged})
            log(f"steps {self.start + 1}..{logged} were logged by an earlier run after its last checkpoint; they run "
                f"again (the records before the 'rewind' event are superseded)")
        # A run resumed after its last evaluation (e.g. stopped before the export) keeps that record.
        self.last_eval = _last_eval_at(writer.path, self.start) if self.primary else None

    # ----------------------------------------------------------------------------- evaluation
    def _eval_plan(self):
        s = self.s
        if s.eval.every <= 0:
            return None
        needs_tok = not s.eval.data_jsonl or any("tokens" not in json.loads(l) for l in
                                                 pathlib.Path(s.eval.data_jsonl).read_text().splitlines()[:1]
                                                 if l.strip())
        if not self.primary:             # process 0 makes the evaluation set; the others then read it
            distributed.barrier("specjax-distill-eval-data")
        plan = _prepare.eval_plan(s, self.target, self.target_params, self.tokenizer() if needs_tok else None,
                                  self.log)
        if self.primary:
            distributed.barrier("specjax-distill-eval-data")
        return plan

    def evaluate(self) -> dict | None:
        if self.eval_plan is None:
            return None
        t0 = time.perf_counter()
        gammas = tuple(range(1, self.s.eval.gamma + 1))
        t = self.t
        if self.s.is_head:
            res = _heads.evaluate_head(t.draft, t.head_params(self.state), self.target_params, self.eval_plan, gammas)
        else:
            res = _train.evaluate(t.draft, t.full_params(self.state), t.full_head, self.eval_plan, gammas)
        res.update({"kind": "eval", "step": self.step, "tokens": self.tokens_done,
                    "eval_s": time.perf_counter() - t0})
        self.writer.write(res)
        self.log(f"eval step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items() if isinstance(v, float)))
        return res

    # ----------------------------------------------------------------------------- on-policy data
    def onpolicy_plan(self) -> tuple[_data.BatchPlan, int]:
        """The current refresh's on-policy data (made from the current draft on first use, kept in
        workdir/onpolicy) and this step's batch index within it."""
        s, d, step = self.s, self.s.data, self.step
        R = d.draft_refresh_every
        r = step // R
        if r not in self._onpolicy:
            self._onpolicy.clear()
            t0 = time.perf_counter()
            prompts = self.sources.prompts(d.draft_max_prompt_tokens or None)
            pick = np.random.default_rng([s.seed, 11, r]).choice(len(prompts), min(d.draft_prompts, len(prompts)),
                                                                 replace=False)
            # Host copies of the draft and the key (the train state lives on the mesh), gathered in
            # every process before the barrier (gathers are collectives, in the same order everywhere).
            params = self.t.full_params(self.state)
            key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(sharding.to_host(self.state.key))), r)
            if not self.primary:         # process 0 writes the refresh; the others then read it
                distributed.barrier(f"specjax-onpolicy-{r}")
            where = self.workdir / "onpolicy" / f"refresh_{r:05d}"
            with naming(where):
                data = _sources.generated_data(
                    where, self.t.draft, params,
                    self.target, self.target_params, [prompts[i] for i in sorted(pick)],
                    key=key, temperature=d.temperature, samples_per_prompt=1, max_new_tokens=d.draft_max_new_tokens,
                    batch_size=d.gen_batch_size, eos_ids=_prepare.eos_ids(self.target, self.tokenizer.loaded),
                    widths=d.widths, source=f"draft-r{r}", log=self.log)
            if self.primary:
                distributed.barrier(f"specjax-onpolicy-{r}")
            if data.num_loss_tokens == 0:
                raise ValueError(f"on-policy refresh {r} at step {step}: the draft generated no tokens for "
                                 f"{len(pick)} prompts (source {data.seqs.source}; non-finite draft "
                                 f"parameters?), so there is no on-policy data to train on")
            self._onpolicy[r] = _data.BatchPlan(data, s.seed * 1000 + r, d.tokens_per_batch, d.widths)
            self.writer.write({"kind": "event", "event": "onpolicy_refresh", "step": step, "refresh": r,
                               "loss_tokens": data.num_loss_tokens, "seconds": time.perf_counter() - t0})
        return self._onpolicy[r], self.sources.mixture.index_within(step, r * R)

    # ----------------------------------------------------------------------------- steps
    def report(self, p) -> None:
        """Bring one step's metrics to the host, act on its on-device non-finite flag, log it."""
        at, name, tokens_at, loop_tokens_at, lr, aux = p
        aux = {k: float(v) for k, v in jax.device_get(aux).items()}
        if aux.pop("nonfinite"):
            mode = self.s.optim.on_nonfinite
            what = f"non-finite loss ({aux['loss']}), gradient norm ({aux['grad_norm']}) or parameters"
            self.writer.write({"kind": "event", "event": "nonfinite", "step": at, "source": name, "action": mode,
                               "loss": aux["loss"], "grad_norm": aux["grad_norm"]})
            if mode == "stop":
                raise FloatingPointError(
                    f"step {at} (source {name}): {what}; stopped (optim.on_nonfinite='stop'). The last "
                    f"checkpoint is from before this step; lower optim.learning_rate, or set "
                    f"optim.on_nonfinite='skip' to skip such steps")
            self.skipped += 1
            self.log(f"step {at} (source {name}): {what}; step skipped ({self.skipped} so far)")
        elapsed = time.perf_counter() - self.t_loop          # this step's metrics on the host, since the loop began
        self.writer.write({"kind": "train", "step": at, "tokens": tokens_at, "source": name,
                           "skipped_steps": self.skipped, "lr": lr, "tokens_per_s": loop_tokens_at / max(elapsed, 1e-9),
                           "elapsed_s": elapsed, **aux})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{aux['loss']:.3f}", alpha=f"{aux['alpha_on_head']:.3f}", step=at)

    def loop(self, stop_after_steps: int | None) -> None:
        s, t, mixture = self.s, self.t, self.sources.mixture
        if self.start == 0 and s.eval.at_start:
            self.evaluate()
        if s.progress and self.primary:
            from tqdm import tqdm
            self.bar = tqdm(total=s.budget_tokens, initial=min(self.tokens_done, s.budget_tokens), unit="tok",
                            dynamic_ncols=True, desc="distill")
        self.t_loop, self.tok_loop = time.perf_counter(), 0
        accumulate = s.optim.accumulate
        pending = None      # (step, source, tokens after it, loop tokens, lr, its metrics still on the device)
        while self.tokens_done < s.budget_tokens:
            if stop_after_steps is not None and self.step >= stop_after_steps:
                break
            name = mixture.names[mixture.choice(self.step)]
            if name == "draft":
                # On-policy data is generated from the current draft and cached on disk: the last
                # step's non-finite check comes first, so no data is made from a broken draft.
                if pending is not None:
                    self.report(pending)
                    pending = None
                plan, idx = self.onpolicy_plan()
            else:
                plan, idx = self.sources.plans[name], mixture.index_within(self.step)
            host_batch = plan.batch(idx)
            if s.is_head:                   # the origins its loss reads (`_heads.loss_origins`)
                host_batch = _heads.with_loss_origins(t.draft, host_batch)
            # The step's loss tokens (its metrics' loss_tokens) counted from the host's batch, so the
            # budget needs nothing back from the device.
            n = int(np.sum(np.asarray(host_batch["mask"])))
            self.state, aux = t.step_fn(self.state, t.frozen, t.head_UD, t.place_batch(host_batch))
            self.step += 1
            self.tokens_done += n
            self.tok_loop += n
            if self.bar is not None:
                self.bar.update(n)
            # Metrics are read `metrics_lag` steps late, so the host dispatches the next step before
            # waiting on this one. The non-finite flag is computed on the device with the step
            # (`make_train_step`); every pending step is read before a checkpoint, an evaluation or
            # the end, so no non-finite state reaches a checkpoint or export (with 'skip' such a
            # step never changed the parameters; with 'stop' the run stops at the read).
            if pending is not None:
                self.report(pending)
            pending = (self.step, name, self.tokens_done, self.tok_loop,
                       float(t.schedule(max(0, (self.step - 1) // accumulate))), aux)
            done = self.tokens_done >= s.budget_tokens
            at_checkpoint = self.step % s.checkpoint_every == 0 or done
            at_eval = s.eval.every > 0 and (self.step % s.eval.every == 0 or done)
            if s.metrics_lag == 0 or at_checkpoint or at_eval:
                self.report(pending)
                pending = None
            if at_checkpoint:
                meta = {"tokens": self.tokens_done, "elapsed_s": self.elapsed0 + time.perf_counter() - self.t_start,
                        "data_fingerprints": self.fingerprints}
                self.ckpt.save(self.step, self.state, meta, force=True)
            if at_eval:
                self.last_eval = self.evaluate()
        if pending is not None:         # a stop_after_steps break
            self.report(pending)

    def close(self, abort: bool = False) -> None:
        """Wait for the checkpoint writes and close the progress bar; `abort` (the loop raised):
        close the metrics and the checkpointer too (`finish` closes them otherwise), whatever
        the wait raises (the loop's error is the one reported)."""
        try:
            self.ckpt.wait()
        except Exception:  # noqa: BLE001
            if not abort:
                raise
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            if abort:
                self._close_files(quiet=True)

    def _close_files(self, quiet: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.ckpt is not None:
            try:
                self.ckpt.close()
            except Exception:  # noqa: BLE001 - closing after a failure: the failure is reported
                if not quiet:
                    raise

    # ----------------------------------------------------------------------------- the end
    def finish(self, wall_s: float) -> dict:
        """The summary (final.json) and, at the end of the budget, the export; closes the run."""
        s, t = self.s, self.t
        summary = {"steps": self.step, "tokens": self.tokens_done,
                   "train_tokens_per_s": self.tok_loop / max(time.perf_counter() - self.t_loop, 1e-9),
                   "wall_s": wall_s, **self.sources.timings, "divergence": t.spec.divergence,
                   "skipped_steps": self.skipped, "data_loss_tokens": self.sources.loss_tokens(),
                   "draft": t.describe(s), "eval": self.last_eval}
        finished = self.tokens_done >= s.budget_tokens and bool(s.export_dir)
        # Host copies of the parameters in every process (gathering them is a collective), then
        # process 0 alone exports and writes.
        host_params = t.own_params(self.state) if finished else None
        try:
            if not self.primary:
                return summary
            if finished:
                summary["export"] = self._export(host_params)
            with naming(self.workdir / "final.json"):
                (self.workdir / "final.json").write_text(json.dumps(summary, indent=1, default=str))
            return summary
        finally:
            self._close_files()

    def _export(self, own: dict) -> dict:
        s, t = self.s, self.t
        # What it learned from: loss tokens of one pass over each trained set, and what each
        # streamed set read (its shards' sha256s and cut).
        info = {"target": s.target, "target_sha256": _target_sha(s.target), "divergence": t.spec.divergence,
                "data": {"loss_tokens": self.sources.loss_tokens(), "fingerprints": self.fingerprints}}
        if s.is_head:
            params = {**own, **{k: v for k, v in t.frozen_local.items() if k != "target"}}
            if not bool(_train.all_finite(params)):
                raise FloatingPointError(f"not exporting to {s.export_dir}: the head's parameters are not finite")
            desc = drafters.save_head(s.export_dir, t.draft.config, params, dtype=s.export_dtype, info={
                **info, "ttt_steps": t.draft.ttt_steps, "feature_weight": t.draft.feature_weight,
                "feature_noise": t.draft.feature_noise, "tokens": self.tokens_done, "steps": self.step,
                "eval": self.last_eval})
            what = "head"
        else:
            from specjax.models.draft_artifact import save_draft
            params = _train.merge_params(own, t.frozen_local)
            if not bool(_train.all_finite(params)):   # the loop's check makes this unreachable; never export NaN
                raise FloatingPointError(f"not exporting to {s.export_dir}: the draft's parameters are not finite")
            desc = save_draft(s.export_dir, t.draft, params, shared=t.choice.shared, dtype=s.export_dtype, info={
                **info, "tokens": self.tokens_done, "steps": self.step, "eval": self.last_eval})
            what = "draft"
        self.log(f"exported the {what} to {s.export_dir} ({desc['bytes'] / 1e6:.1f} MB)")
        return {"dir": str(s.export_dir), "bytes": desc["bytes"], "sha256": desc["sha256"]}


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


def _target_sha(name: str) -> str:
    """The sha256 of the target's checkpoint file (recorded for known names)."""
    from specjax.models import registry
    if name in registry.KNOWN:
        return registry.KNOWN[name].sha256
    path = pathlib.Path(name)
    return registry.file_sha256(path) if path.is_file() else ""
