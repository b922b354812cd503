"""The smaller commands: `specjax eval` (a draft's teacher-forced acceptance against its target),
`specjax export` (a model or a draft as a Hugging Face checkpoint directory) and `specjax data`
(the data engine). Each types its config once (`eval_job`, `export_job`, `distill.data_config`
with `build.generate_settings`) and runs on the settings."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any

from specjax import build, distill, drafters, files, models
from specjax.settings import Settings, field_types, typed_value


def _own(cls, values: dict, skip: tuple = ()) -> dict:
    hints = field_types(cls)
    return {f.name: typed_value(f.name, hints[f.name], values[f.name]) for f in dataclasses.fields(cls)
            if f.name not in skip and f.name in values}


@dataclasses.dataclass(frozen=True)
class EvalJob(Settings):
    """`specjax eval`'s settings: the distillation settings it shares with the trainer (target,
    data, eval), the drafter kind with its own settings block, the gammas and the output file."""
    data: Any = None                   # `distill.DistillSettings` (the target, data and eval keys)
    drafter: str = "distilled"
    draft: Any = None                  # the kind's own settings
    gammas: tuple[int, ...] = (1, 3, 5)
    out: str = ""


def eval_job(c: Any) -> EvalJob:
    values = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    own = _own(EvalJob, values, skip=("data", "draft"))
    kind = drafters.drafter_kind(own.get("drafter", EvalJob.drafter))
    if not kind.teacher_forced:
        scored = ", ".join(k for k in drafters.drafter_kinds() if drafters.drafter_kind(k).teacher_forced)
        raise ValueError(f"drafter={kind.name!r}: expected one of {scored} (prompt lookup has no draft distribution "
                         "to score; heads are evaluated by their training, metrics.jsonl)")
    for g in own.get("gammas", ()):
        if g < 1:
            raise ValueError(f"gammas={own['gammas']!r}: expected integers >= 1")
    return EvalJob(data=distill.distill_settings(c, extra="ignore"), draft=kind.settings_from(values), **own)


def eval_main(job: EvalJob) -> dict:
    """Teacher-forced alpha, greedy agreement and greedy tokens per target pass of a draft against
    its target (`specjax.distill.evaluate`; no wall-clock). Prints one JSON line; appends it to
    ``out`` when set."""
    s, kind = job.data, drafters.drafter_kind(job.drafter)
    if kind.check is not None:
        kind.check(job.draft, drafters.DraftJob(target=s.target))
    files.check_output_file("out", job.out)      # a directory, or a missing directory: before the evaluation runs
    build.check_seed(s.seed)
    target, params = build.load_target(s.target, s.dtype, True)
    tokenizer = None if s.eval.data_jsonl else models.load_tokenizer(s.target)
    # The draft as the engine would run it (loading, vocab check), in the form that is scored
    # teacher-forced (`DrafterKind.teacher_forced`: the early exit as a model with its own cache).
    ctx = drafters.BuildContext(target, params, target_name=s.target, dtype=s.dtype, scan_layers=True)
    drafter, dparams = drafters.build_drafter(kind.teacher_forced, job.draft, ctx)
    plan = distill.eval_plan(s, target, params, tokenizer, log=lambda m: print(f"[specjax] {m}", file=sys.stderr))
    result = distill.evaluate(drafter.model, dparams, distill.teacher_head(target, params, None), plan, job.gammas)
    result = {"target": s.target, "drafter": job.drafter, "draft_model": getattr(job.draft, "draft_model", ""),
              "data": s.eval.data_jsonl or f"held-out Spec-Bench, {s.eval.per_category} per category",
              **result}
    line = json.dumps(result)
    print(line, flush=True)
    if job.out:
        with open(job.out, "a") as f:
            f.write(line + "\n")
    return result


EXPORT_KINDS = ("model", "draft")
# The dtypes `export` writes: those specjax loads again (`models.config.SUPPORTED_DTYPES`); not
# float16 (the model config refuses it, and weights past 65504 would become inf).
EXPORT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ExportJob(Settings):
    what: str = "draft"
    source: str = ""
    target: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    out: str = ""


def export_job(c: Any) -> ExportJob:
    job = ExportJob(**_own(ExportJob, c.to_dict() if hasattr(c, "to_dict") else dict(c)))
    if job.what not in EXPORT_KINDS:
        raise ValueError(f"what={job.what!r}: expected one of {', '.join(EXPORT_KINDS)}")
    if job.dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={job.dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if not job.out:
        raise ValueError("out='': name the directory to write the checkpoint into")
    if job.what == "model" and not job.source:
        raise ValueError("source='': name the model to export (registry name, GGUF file or HF directory)")
    return job


def export_main(job: ExportJob) -> pathlib.Path:
    """A model or a draft as a Hugging Face checkpoint directory, written into a temporary
    directory beside ``out`` and renamed into place at the end (a failure, such as a full disk,
    leaves ``out`` as it was: `models.export.write_directory`)."""
    from specjax.models.export import write_directory
    out = pathlib.Path(job.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out={job.out!r} exists and is not an empty directory; nothing was written")
    if job.what == "model":
        model, params, tokenizer = models.load_with_tokenizer(job.source, dtype="float32")

        def write(d):
            models.export_hf(model, params, d, dtype=job.dtype)
            if tokenizer is not None:
                tokenizer.save(d)
    else:
        from specjax.models.draft_artifact import export_draft_hf
        target, params = build.load_target(job.target, "float32", True)

        def write(d):
            export_draft_hf(job.source or drafters.shipped_draft(job.target), target, params, d, dtype=job.dtype)
    write_directory(out, write)
    print(f"[specjax] wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})", flush=True)
    return out


def data_main(c, workdir: str) -> dict:
    """`specjax data`: run or resume (same command) the data engine in `workdir`."""
    build.check_seed(c.get("seed", 0))
    config = distill.data_config(c)          # the data engine's settings, typed once
    g = build.generate_settings(c.generate)  # the generator's settings, typed once
    build.check_config(g)
    build.limit_heap_retention()             # batches of other capacities reuse no retained heap
    generator = build.load_generator(g, check=False)
    report = distill.generate_data(config, generator, workdir)
    print(f"[specjax] data in {workdir}: " + ", ".join(
        f"{k} {v.get('sequences', 0)} seqs / {v.get('loss_tokens', 0)} loss tokens" for k, v in report["stages"].items()),
        flush=True)
    return report
