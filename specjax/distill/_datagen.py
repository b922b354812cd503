"""The data engine (`specjax data --config=configs/data.py --workdir=DIR`): prompts the target
writes itself, cleaned, and the target's answers to them, as resumable shards.

Stages, each a shard directory under the workdir (`specjax.distill._shards`; one command runs
the missing ones and resumes a stopped one at its last complete shard):

1. ``instructions``: Magpie requests (`_corpus`): per request, a seed task's steering system
   message and the template's opening of a user turn; the target completes the turn.
2. ``corpus.jsonl`` + ``corpus_report.json`` / ``.md``: the Spec-Bench training split's first
   turns and the finished Magpie requests, cleaned (`_corpus.build_corpus`: rejects, exact and
   near duplicates, leaks into the held-out Spec-Bench questions and the evaluation texts).
3. ``responses_greedy`` and ``responses_sampled``: the target's answer to every corpus prompt,
   greedy and at the sampled setting (default T = 1, top-p 0.95); loss on the answer's tokens.
4. ``followups``: for the first ``followups.n`` corpus prompts, the target writes the user's
   next turn after its own greedy answer (Magpie again, over the conversation);
   ``followup_responses``: its greedy answer to that turn (finished follow-ups only), loss on
   that last answer.

Every request of a stage is keyed by ``fold_in(stage key, request id)``, so a stage's output
does not depend on its shard or batch layout (at a fixed gamma; see `decoding.generate_batched`).
With a drafter (the engine's, e.g. the shipped head) generation is speculative and still the
target's distribution exactly. Batches are sorted by prompt length within a shard.

Checks. A run holds the workdir's lock (`specjax.files.workdir_lock`) from before it touches
anything: a second run on the same workdir is refused naming the holder. Every stage's
settings record the digest of the target's weights (``target_sha256``, `target_digest`), so a
resume with other weights at the same path is refused naming both digests, before anything in
the workdir changes. A request that does not finish normally (the engine's status is not
``eos`` or ``max_new_tokens``, e.g. ``nan_logits``: the target's logits were not finite) is not
training data: it is left out of its shard and counted per status in the shard's manifest entry
(``dropped``), the stage's totals, its log line and the report; a stage with no usable row, or
where more than ``max_dropped_fraction`` of the requests so far were dropped, stops with one
ValueError naming the statuses (the shards written are kept). An empty corpus (no Magpie requests
and no Spec-Bench prompts, or none kept by the cleaning) is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import sys
import time
import zlib
from typing import Callable, Sequence

import jax
import numpy as np

from specjax import decoding, files, serving, specbench
from specjax import sampling as sampling_lib
from specjax.distill import _corpus, _shards

STAGES = ("instructions", "corpus", "responses_greedy", "responses_sampled", "followups", "followup_responses")
# the files a run writes at the workdir's top (besides each stage's directory)
WORKDIR_FILES = ("corpus.jsonl", "corpus_report.json", "report.json", "REPORT.md")
# Engine statuses of a request that finished normally (an end-of-turn token, or its token budget);
# any other (``nan_logits``, ...) is dropped from the data (see the module docstring).
FINISHED_STATUSES = ("eos", "max_new_tokens")
STATUS_MEANING = {"nan_logits": "the target's logits were not finite (NaN or inf): broken weights, or an overflow "
                                "in its dtype",
                  "running": "the engine returned it unfinished"}
DEFAULT_MAX_DROPPED_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """How one generation stage samples: temperature (0 = greedy), top-p, new tokens per request."""
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data command's settings (`configs/data.py`), checked once."""
    target: str
    seed: int
    batch_size: int
    shard_requests: int
    pad_multiple: int
    prefill_chunk: int
    magpie_requests: int
    magpie: StageSettings
    spec_bench_train: bool
    spec_bench_per_category: int
    responses: StageSettings
    sampled_responses: bool
    followups: int
    followup: StageSettings
    followup_response: StageSettings
    eval_texts: tuple[str, ...] = ()
    refill_rounds: int = 16
    # Stop a stage when more than this fraction of its requests so far did not finish normally.
    max_dropped_fraction: float = DEFAULT_MAX_DROPPED_FRACTION

    def __post_init__(self):
        for name in ("batch_size", "shard_requests", "pad_multiple", "prefill_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 1")
        for name in ("magpie_requests", "followups", "spec_bench_per_category", "refill_rounds"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 0")
        if not 0.0 <= float(self.max_dropped_fraction) <= 1.0:
            raise ValueError(f"max_dropped_fraction={self.max_dropped_fraction!r}: expected a fraction in [0, 1]")
        if int(self.magpie_requests) == 0 and not self.spec_bench_train:
            raise ValueError("magpie.requests=0 and spec_bench_train=False: the corpus would be empty (no "
                             "prompts to answer); set magpie.requests > 0 or spec_bench_train=True")
        for name in ("magpie", "responses", "followup", "followup_response"):
            s = getattr(self, name)
            sampling_lib.SamplingConfig.make(temperature=s.temperature, top_p=s.top_p)     # raises on bad values
            if s.max_new_tokens < 1:
                raise ValueError(f"{name}.max_new_tokens={s.max_new_tokens!r}: expected >= 1")


@dataclasses.dataclass
class Request:
    ids: list[int]           # prompt token ids
    source: str
    category: str


def _digest(requests: Sequence[Request]) -> str:
    h = hashlib.sha256()
    for r in requests:
        h.update(np.asarray(r.ids, np.int64).tobytes() + b"|" + r.source.encode() + b"|" + r.category.encode() + b"\n")
    return h.hexdigest()


def _stage_key(seed: int, stage: str) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(stage.encode()))


@dataclasses.dataclass
class Context:
    """What every stage shares: the generator (target, drafter, tokenizer), the config, a log."""
    generator: decoding.Generator
    config: DataConfig
    workdir: pathlib.Path
    log: Callable[[str], None]
    throughput: dict = dataclasses.field(default_factory=dict)
    target_sha256: str = ""          # `target_digest` of the generator's target, recorded in every stage

    @property
    def tokenizer(self):
        return self.generator.tokenizer


def run_stage(ctx: Context, stage: str, requests: Sequence[Request], settings: StageSettings,
              progress: bool = True) -> _shards.ShardDir:
    """Generate the missing shards of one stage (request k * shard_requests .. of shard k)."""
    c = ctx.config
    sources = sorted({r.source for r in requests}) or ["none"]
    shard_settings = {"stage": stage, "target": c.target, "target_sha256": ctx.target_sha256, "seed": c.seed,
                      **dataclasses.asdict(settings),
                      "requests": len(requests), "requests_sha256": _digest(requests),
                      "shard_requests": c.shard_requests,
                      "drafter": type(ctx.generator.engine.drafter).__name__ if ctx.generator.engine.drafter else "none"}
    sd = _shards.ShardDir(ctx.workdir / stage, shard_settings, vocab_size=ctx.generator.engine.target.vocab_size,
                          sources=sources, log=ctx.log, recorded_later=("target_sha256",),
                          describe={"target_sha256": ("target weights sha256", _weights_changed(ctx))})
    num_shards = -(-len(requests) // c.shard_requests)
    todo = [k for k in range(num_shards) if not sd.done(k)]
    _check_dropped(ctx, stage, sd, final=not todo)       # a resumed stage that already failed fails again
    if not todo:
        ctx.log(f"{stage}: complete ({sd.totals()})")
        return sd
    engine = dataclasses.replace(ctx.generator.engine, config=dataclasses.replace(
        ctx.generator.engine.config, max_new_tokens=settings.max_new_tokens, prefill_chunk=c.prefill_chunk))
    samp = sampling_lib.SamplingConfig.make(temperature=settings.temperature, top_p=settings.top_p)
    key = _stage_key(c.seed, stage)
    done_requests = sum(min(c.shard_requests, len(requests) - k * c.shard_requests)
                        for k in range(num_shards) if sd.done(k))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), initial=done_requests, unit="req", desc=stage, file=sys.stderr,
                   dynamic_ncols=True)
    stats = ctx.throughput.setdefault(stage, {"new_tokens": 0, "prompt_tokens": 0, "seconds": 0.0, "batches": []})
    t_start = time.perf_counter()
    shown = [0]

    def show(n_requests: int, new_tokens: int):
        shown[0] += new_tokens
        if bar is not None:
            bar.update(n_requests)
            bar.set_postfix_str(f"{shown[0] / max(time.perf_counter() - t_start, 1e-9):.0f} tok/s, "
                                f"{shown[0]} new tokens")

    for k in todo:
        lo, hi = k * c.shard_requests, min(len(requests), (k + 1) * c.shard_requests)
        chunk = requests[lo:hi]
        out: dict[int, list[int]] = {}
        status: dict[int, str] = {}          # by index into chunk
        # This shard's generation, recorded in its manifest entry (a corpus grown over several
        # runs keeps every shard's throughput, not only the last run's).
        made = {"new_tokens": 0, "prompt_tokens": 0, "seconds": 0.0, "batches": 0, "max_rows": 0}
        if c.refill_rounds:
            def group_done(g):
                _count(stats, made, new_tokens=g["new_tokens"], prompt_tokens=0, seconds=g["seconds"], rows=g["rows"],
                       record={k: round(v, 3) if isinstance(v, float) else v for k, v in g.items()})

            def finished(res):
                status[res.id - lo] = res.status
                show(1, len(res.tokens))

            toks = serving.generate_offline(engine, ctx.generator.params, [r.ids for r in chunk], samp, key,
                                            request_ids=list(range(lo, hi)), slots=c.batch_size,
                                            pad_multiple=c.pad_multiple, rounds_per_sync=c.refill_rounds,
                                            on_finish=finished, on_group=group_done)
            out = {rid - lo: t for rid, t in toks.items()}
            _count(stats, made, new_tokens=0, prompt_tokens=sum(len(r.ids) for r in chunk), seconds=0.0, rows=0)
        else:
            for results, rep in decoding.generate_batched(engine, ctx.generator.params, [r.ids for r in chunk], samp,
                                                          key, batch_size=c.batch_size, pad_multiple=c.pad_multiple,
                                                          request_ids=list(range(lo, hi))):
                out.update((res.index, res.tokens) for res in results)
                status.update((res.index, res.status) for res in results)
                _count(stats, made, new_tokens=rep.new_tokens, prompt_tokens=rep.prompt_tokens, seconds=rep.seconds,
                       rows=rep.rows, record={"rows": rep.rows, "width": rep.width, "new_tokens": rep.new_tokens,
                                              "prefill_s": round(rep.prefill_s, 3), "decode_s": round(rep.decode_s, 3)})
                show(len(results), rep.new_tokens)
        # Only requests that finished normally are data (a row stopped by non-finite logits is cut short).
        keep = [i for i in range(len(chunk)) if status.get(i, "running") in FINISHED_STATUSES]
        dropped: dict[str, int] = {}
        for i in range(len(chunk)):
            if status.get(i, "running") not in FINISHED_STATUSES:
                dropped[status.get(i, "running")] = dropped.get(status.get(i, "running"), 0) + 1
        seqs = _shards.Sequences(
            tokens=[np.asarray(chunk[i].ids + out[i], np.int32) for i in keep],
            loss_masks=[np.asarray([False] * len(chunk[i].ids) + [True] * len(out[i])) for i in keep],
            sources=[chunk[i].source for i in keep], requests=[lo + i for i in keep])
        made["seconds"] = round(made["seconds"], 2)
        sd.write(k, seqs, requests=[lo, hi], cpu=_cpu_model(), backend=jax.default_backend(),
                 made_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), generation=made,
                 dropped=dict(sorted(dropped.items())))
        if dropped:
            ctx.log(f"{stage}: {_shards.shard_name(k)}: dropped {sum(dropped.values())} of {len(chunk)} requests "
                    f"that did not finish normally ({_reasons(dropped)})")
        _check_dropped(ctx, stage, sd, final=False)
    if bar is not None:
        bar.close()
    _check_dropped(ctx, stage, sd, final=True)
    ctx.log(f"{stage}: {sd.totals()}")
    return sd


def _reasons(dropped: dict) -> str:
    return ", ".join(f"{n} {k}" + (f": {STATUS_MEANING[k]}" if k in STATUS_MEANING else "")
                     for k, n in sorted(dropped.items()))


def _check_dropped(ctx: Context, stage: str, sd: _shards.ShardDir, *, final: bool) -> None:
    """Stop the stage (ValueError naming the statuses; its shards are kept) when more than
    ``max_dropped_fraction`` of its requests so far were dropped, or (``final``) none is usable."""
    t = sd.totals()
    dropped = sum(t["dropped"].values())
    rows = t["sequences"] + dropped
    limit = float(ctx.config.max_dropped_fraction)
    too_many = dropped > 0 and dropped / rows > limit
    if not (too_many or (final and rows and not t["sequences"])):
        return
    why = "no usable row" if not t["sequences"] else f"more than max_dropped_fraction={limit:g}"
    raise ValueError(f"{stage}: {dropped} of the {rows} requests so far did not finish normally "
                     f"({_reasons(t['dropped'])}): {why}; the {t['shards']} shards written are kept in {sd.dir} "
                     f"(their usable rows only, counted per status in its manifest): check the target (weights, "
                     f"dtype) and use a new --workdir, or raise max_dropped_fraction to accept the dropped rows")


def _weights_changed(ctx: Context) -> str:
    return (f"the target {ctx.config.target!r} does not hold the weights that made these shards (its weights "
            f"changed at the same path?); shards of two targets are never mixed: use a new --workdir for these "
            f"weights (everything in {ctx.workdir} is kept as it is)")


def _count(run: dict, shard: dict, *, new_tokens: int, prompt_tokens: int, seconds: float, rows: int,
           record: dict | None = None) -> None:
    """Add generated work to this run's stage totals (``record``: one batch's entry of its list)
    and to the shard's (``batches``: records counted, ``max_rows``: the most rows of one)."""
    for d in (run, shard):
        d["new_tokens"] += new_tokens
        d["prompt_tokens"] += prompt_tokens
        d["seconds"] += seconds
    if record is not None:
        run["batches"].append(record)
        shard["batches"] += 1
        shard["max_rows"] = max(shard["max_rows"], int(rows))


def _stage_texts(sd: _shards.ShardDir, num_shards: int, stop_ids: Sequence[int]) -> dict:
    """{request id: (prompt ids, generated ids without the stop token, finished)} of a stage's
    usable rows (a dropped request has no entry)."""
    out = {}
    for k in range(num_shards):
        seqs = sd.read(k)
        for toks, mask, rid in zip(seqs.tokens, seqs.loss_masks, seqs.requests):
            n_prompt = int(np.argmax(mask)) if mask.any() else len(toks)
            gen = toks[n_prompt:].tolist()
            finished = bool(gen) and gen[-1] in stop_ids
            out[rid] = (toks[:n_prompt].tolist(), gen[:-1] if finished else gen, finished)
    return out


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz", ".npy", ".msgpack", ".h5", ".ckpt")


def target_digest(target: str, params=None) -> tuple[str, str]:
    """(sha256 hex, what it is the digest of) of the target's weights, computed once per run: a
    registry name's recorded sha256 (its file is checked against it when loaded); a file, its
    sha256 (what ``sha256sum`` prints); a Hugging Face directory (or a file in one), the sha256
    of the lines "<relative name> <sha256>" of the weight files a load reads
    (`hf_loader.weight_files`: other files beside them, e.g. a trainer's optimizer state or a
    GGUF export, do not count) and config.json; otherwise (a
    target without files, e.g. a preset in a test) a digest of ``params``' leaves."""
    from specjax.models import registry
    if target in registry.KNOWN:
        return registry.KNOWN[target].sha256, f"the recorded sha256 of {target}"
    path = pathlib.Path(str(target)).expanduser()
    if path.is_file() and (path.suffix == ".safetensors" or path.name == "config.json"):
        path = path.parent
    if path.is_file():
        return files.file_sha256(path), f"sha256 of {path}"
    if path.is_dir():
        from specjax.models import hf_loader
        weights = [f for f in hf_loader.weight_files(path) if f.is_file()]
        found = sorted(weights + [path / "config.json"] if (path / "config.json").is_file() else weights)
        if any(f.suffix in WEIGHT_SUFFIXES for f in found):
            h = hashlib.sha256()
            for f in found:
                h.update(f"{f.relative_to(path).as_posix()} {files.file_sha256(f)}\n".encode())
            return h.hexdigest(), f"sha256 over {len(found)} files of {path}"
    if params is None:
        raise ValueError(f"target {target!r}: no weight files to digest and no params given")
    h = hashlib.sha256()
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(kp)} {a.dtype} {a.shape}\n".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest(), "sha256 of the target's parameters"


def magpie_requests(tokenizer, n: int) -> list[Request]:
    """Request i: seed task i mod len(SEED_TASKS), its steering message, the user-turn opening."""
    prefixes = [(cat, _corpus.template_prefix(tokenizer, [{"role": "system", "content": msg}]))
                for cat, msg in _corpus.SEED_TASKS]
    return [Request(ids=list(prefixes[i % len(prefixes)][1]), source="magpie", category=prefixes[i % len(prefixes)][0])
            for i in range(n)]


def _chat(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def run(config: DataConfig, generator: decoding.Generator, workdir, *, log: Callable[[str], None] = print,
        progress: bool = True) -> dict:
    """Every stage (see the module docstring); returns the report also written to
    ``report.json`` and ``REPORT.md`` in the workdir. The workdir's lock is held throughout
    (`specjax.files.WorkdirBusy`, naming the holder, while another run holds it)."""
    workdir = pathlib.Path(workdir)
    problem = files.path_problem(workdir, want_dir=True) or next(filter(None, (
        [files.path_problem(workdir / stage, want_dir=True) for stage in STAGES if stage != "corpus"]
        + [files.path_problem(workdir / name, want_dir=False) for name in WORKDIR_FILES])), None)
    if problem:                  # before hours of generation, not when the stage's turn comes
        raise ValueError(f"workdir {workdir}: {problem}; nothing was run")
    with files.workdir_lock(workdir, "specjax data"):
        try:
            return _run(config, generator, workdir, log=log, progress=progress)
        except OSError as e:
            if e.filename is None and e.errno is not None:   # a short write names no file: name the workdir
                raise OSError(e.errno, e.strerror, str(workdir)) from e
            raise


def _check_target_digest(ctx: Context) -> None:
    """Refuse, before anything in the workdir changes, a workdir whose stages were made by other
    target weights (their recorded ``target_sha256``), naming both digests."""
    for stage in STAGES:
        d = ctx.workdir / stage
        if (d / _shards.MANIFEST).is_file():
            old = _shards.read_manifest(d)["settings"].get("target_sha256")
            if old is not None and old != ctx.target_sha256:
                raise ValueError(f"{d / _shards.MANIFEST}: its shards were made with target weights sha256 {old!r}, "
                                 f"this run has {ctx.target_sha256!r}; {_weights_changed(ctx)}")


def _check_same_corpus(ctx: Context, asks: Sequence[Request]) -> None:
    """Refuse, before ``corpus.jsonl`` is replaced, a corpus other than the one the workdir's
    answers were made for (e.g. other ``eval_prompts`` or Magpie settings)."""
    for stage in ("responses_greedy", "responses_sampled"):
        d = ctx.workdir / stage
        if (d / _shards.MANIFEST).is_file():
            old = _shards.read_manifest(d)["settings"].get("requests_sha256")
            if old is not None and old != _digest(asks):
                raise ValueError(f"{d / _shards.MANIFEST}: its shards answer another corpus (requests_sha256 "
                                 f"{old[:16]}..., this run's corpus {_digest(asks)[:16]}... of {len(asks)} prompts: "
                                 f"the Magpie, spec_bench or eval_prompts settings changed); use a new --workdir "
                                 f"(corpus.jsonl and the shards here are left as they are)")


def _run(config: DataConfig, generator: decoding.Generator, workdir: pathlib.Path, *, log, progress) -> dict:
    ctx = Context(generator, config, workdir, log)
    tok, c = generator.tokenizer, config
    stop_ids = tuple(generator.config.eos_ids)
    if not stop_ids:
        raise ValueError("the data engine needs the target's end-of-turn ids (the generator's eos_ids) to tell "
                         "finished requests and answers")
    t0 = time.perf_counter()
    ctx.target_sha256, what = target_digest(c.target, generator.params.target)
    log(f"target weights: {what} = {ctx.target_sha256} ({time.perf_counter() - t0:.1f} s)")
    _check_target_digest(ctx)

    # 1. Magpie requests
    magpie = magpie_requests(tok, c.magpie_requests)
    candidates = []
    if c.spec_bench_train:
        taken: dict[str, int] = {}
        for q in specbench.load(split="train"):
            taken[q.category] = taken.get(q.category, 0) + 1
            if not c.spec_bench_per_category or taken[q.category] <= c.spec_bench_per_category:
                candidates.append(_corpus.Candidate(q.prompt, "spec_bench_train", q.category))
    if magpie:
        sd = run_stage(ctx, "instructions", magpie, c.magpie, progress)
        texts = _stage_texts(sd, sd.totals()["shards"], stop_ids)
        for i, req in enumerate(magpie):
            if i in texts:               # (a dropped request is no candidate)
                _, gen, finished = texts[i]
                candidates.append(_corpus.Candidate(tok.decode(gen, skip_special_tokens=False), "magpie",
                                                    req.category, finished=finished, generated=True))

    # 2. the cleaned corpus
    banned = [q.prompt for q in specbench.load(split="held_out")] + list(c.eval_texts)
    kept, corpus_report = _corpus.build_corpus(candidates, banned)
    asks = [Request(_chat(tok, [{"role": "user", "content": k.text}]), k.source, k.category) for k in kept]
    _check_same_corpus(ctx, asks)
    with open(workdir / "corpus.jsonl.tmp", "w", encoding="utf-8") as f:
        for cand in kept:
            f.write(json.dumps({"text": cand.text, "source": cand.source, "category": cand.category}) + "\n")
    pathlib.Path(workdir / "corpus.jsonl.tmp").replace(workdir / "corpus.jsonl")
    (workdir / "corpus_report.json").write_text(json.dumps(corpus_report, indent=1) + "\n")
    log(f"corpus: {corpus_report['total']}")
    if not kept:
        raise ValueError(f"corpus: none of the {len(candidates)} candidate prompts was kept "
                         f"({corpus_report['total']}; see {workdir / 'corpus_report.json'}): nothing to answer; more magpie.requests or "
                         f"spec_bench_train=True")

    # 3. answers
    greedy = run_stage(ctx, "responses_greedy", asks, dataclasses.replace(c.responses, temperature=0.0), progress)
    if c.sampled_responses:
        run_stage(ctx, "responses_sampled", asks, c.responses, progress)

    # 4. follow-up turns on the greedy answers, then the answers to them
    n_follow = min(c.followups, len(kept))
    if n_follow:
        answers = _stage_texts(greedy, greedy.totals()["shards"], stop_ids)
        firsts = [(k, answers[i]) for i, k in enumerate(kept[:n_follow]) if i in answers]    # dropped: skipped
        convs = [[{"role": "user", "content": k.text}, {"role": "assistant", "content": tok.decode(a[1])}]
                 for k, a in firsts]
        follow_reqs = [Request(_corpus.template_prefix(tok, conv), f"followup:{k.source}", k.category)
                       for conv, (k, _) in zip(convs, firsts)]
        fsd = run_stage(ctx, "followups", follow_reqs, c.followup, progress)
        turns = _stage_texts(fsd, fsd.totals()["shards"], stop_ids)
        second = []
        for i, (conv, req) in enumerate(zip(convs, follow_reqs)):
            if i not in turns:
                continue
            _, gen, finished = turns[i]
            text = tok.decode(gen).strip()
            if finished and len(text.split()) >= _corpus.MIN_WORDS and "<|" not in text:
                second.append(Request(_chat(tok, conv + [{"role": "user", "content": text}]), req.source, req.category))
        corpus_report["followups"] = {"asked": n_follow, "finished_and_kept": len(second)}
        if second:
            run_stage(ctx, "followup_responses", second, c.followup_response, progress)

    report = {"config": dataclasses.asdict(c) | {"eval_texts": len(c.eval_texts)}, "corpus": corpus_report,
              "stages": {}, "machine": {"cpu": _cpu_model(), "backend": jax.default_backend()}}
    for stage in STAGES:
        d = workdir / stage
        if (d / _shards.MANIFEST).is_file():
            m = _shards.read_manifest(d)
            t = _shards.totals(m)
            report["stages"][stage] = {k: t[k] for k in ("sequences", "tokens", "loss_tokens", "bytes", "dropped")}
            report["stages"][stage]["recorded"] = recorded_throughput(m)
    for stage, s in ctx.throughput.items():
        report["stages"].setdefault(stage, {})["this_run"] = {
            "new_tokens": s["new_tokens"], "prompt_tokens": s["prompt_tokens"], "seconds": round(s["seconds"], 2),
            "new_tokens_per_s": s["new_tokens"] / s["seconds"] if s["seconds"] else None}
    (workdir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (workdir / "REPORT.md").write_text(report_markdown(report))
    return report


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


GENERATION_KEYS = ("new_tokens", "prompt_tokens", "seconds")     # summed over a stage's recorded shards


def recorded_throughput(manifest: dict) -> list[dict]:
    """Generation throughput of a stage from its manifest, per (CPU, backend): the shards whose
    entries record their generation (``generation``: new and prompt tokens, seconds, batches,
    most rows), summed. Shards written before entries recorded it are counted apart
    (``shards_unrecorded``)."""
    groups: dict[tuple[str, str], dict] = {}
    for e in manifest["shards"].values():
        g = groups.setdefault((e.get("cpu", "?"), e.get("backend", "?")), {
            "cpu": e.get("cpu", "?"), "backend": e.get("backend", "?"), "shards": 0, "shards_unrecorded": 0,
            "new_tokens": 0, "prompt_tokens": 0, "seconds": 0.0, "max_rows": 0})
        made = e.get("generation")
        if not isinstance(made, dict) or not all(isinstance(made.get(k), (int, float)) for k in GENERATION_KEYS):
            g["shards_unrecorded"] += 1          # older entries (or a hand-edited one): nothing to sum
            continue
        g["shards"] += 1
        for k in GENERATION_KEYS:
            g[k] += made[k]
        g["max_rows"] = max(g["max_rows"], int(made.get("max_rows", 0)))
    for g in groups.values():
        g["seconds"] = round(g["seconds"], 2)
        g["new_tokens_per_s"] = round(g["new_tokens"] / g["seconds"], 1) if g["seconds"] else None
    return list(groups.values())


def report_markdown(report: dict) -> str:
    lines = ["# Data engine report", "", f"Machine: {report['machine']['cpu']} ({report['machine']['backend']}).", "",
             "## Corpus", "", _corpus.report_markdown(report["corpus"])]
    if "followups" in report["corpus"]:
        f = report["corpus"]["followups"]
        lines += [f"Follow-up turns: {f['finished_and_kept']} of {f['asked']} finished and kept.", ""]
    lines += ["## Stages", "", "Dropped: requests that did not finish normally (by the engine's status), left out "
              "of the data.", "",
              "| stage | sequences | tokens | loss tokens | MB | dropped | this run: new tokens/s |",
              "|---|---:|---:|---:|---:|---|---:|"]
    for stage, s in report["stages"].items():
        rate = s.get("this_run", {}).get("new_tokens_per_s")
        dropped = ", ".join(f"{n} {k}" for k, n in s.get("dropped", {}).items()) or "0"
        lines.append(f"| {stage} | {s.get('sequences', 0)} | {s.get('tokens', 0)} | {s.get('loss_tokens', 0)} | "
                     f"{s.get('bytes', 0) / 1e6:.2f} | {dropped} | {'' if rate is None else f'{rate:.1f}'} |")
    lines += ["", "## Generation throughput, every run (from the shards' manifest entries)", "",
              "Generated tokens over generation seconds (prefill included) of the shards that record them, "
              "per CPU; the machine may have been shared with other jobs.", "",
              "| stage | CPU (backend) | shards | new tokens | seconds | new tokens/s | most rows a batch | "
              "shards without a record |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for stage, s in report["stages"].items():
        for g in s.get("recorded", []):
            timed = g["shards"] > 0          # else: shards from before entries recorded it, nothing to sum
            new, secs = (str(g["new_tokens"]), f"{g['seconds']:.0f}") if timed else ("", "")
            rate = "" if g["new_tokens_per_s"] is None else f"{g['new_tokens_per_s']:.1f}"
            lines.append(f"| {stage} | {g['cpu']} ({g['backend']}) | {g['shards']} | {new} | {secs} | {rate} | "
                         f"{g['max_rows'] or ''} | {g['shards_unrecorded']} |")
    return "\n".join(lines) + "\n"


def config_from_dict(c) -> DataConfig:
    """A `DataConfig` from ``configs/data.py``'s ConfigDict (the CLI's one reading of it)."""
    def stage(d):
        return StageSettings(temperature=float(d.temperature), top_p=float(d.top_p), max_new_tokens=int(d.max_new_tokens))
    eval_texts = read_eval_prompts(c.eval_prompts) if c.eval_prompts else ()
    return DataConfig(target=c.generate.target, seed=int(c.seed), batch_size=int(c.batch_size),
                      shard_requests=int(c.shard_requests), pad_multiple=int(c.pad_multiple),
                      prefill_chunk=int(c.prefill_chunk), magpie_requests=int(c.magpie.requests),
                      magpie=stage(c.magpie), spec_bench_train=bool(c.spec_bench_train),
                      spec_bench_per_category=int(c.spec_bench_per_category), responses=stage(c.responses),
                      sampled_responses=bool(c.responses.sampled), followups=int(c.followup.requests),
                      followup=stage(c.followup), followup_response=stage(c.followup.response),
                      eval_texts=eval_texts, refill_rounds=int(c.get("refill_rounds", 0)),
                      max_dropped_fraction=float(c.get("max_dropped_fraction", DEFAULT_MAX_DROPPED_FRACTION)))


def read_eval_prompts(name) -> tuple[str, ...]:
    """The texts of an ``eval_prompts`` JSONL file (per non-blank line ``{"turns": [str, ...]}``,
    its first turn, or ``{"text": str}``); anything else is one ValueError naming the file and
    line (FileNotFoundError when there is no file)."""
    path = pathlib.Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"eval_prompts={str(name)!r}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"eval_prompts {path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"save the file as UTF-8") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"eval_prompts {path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: a JSON {type(rec).__name__}, expected an object with 'turns' or 'text'")
        if "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not turns:
                raise ValueError(f"{where}: 'turns' = {turns!r}: expected a non-empty list of strings")
            bad = [t for t in turns if not isinstance(t, str)]
            if bad:
                raise ValueError(f"{where}: 'turns' holds {bad[0]!r}, not a string")
            out.append(turns[0])
        elif "text" in rec:
            if not isinstance(rec["text"], str):
                raise ValueError(f"{where}: 'text' = {rec['text']!r}: expected a string")
            out.append(rec["text"])
        else:
            raise ValueError(f"{where}: no 'turns' or 'text' (keys: {sorted(rec)})")
    return tuple(out)
