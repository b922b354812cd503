"""`specjax bench`: drafters against target-only decoding over a prompt set, per category.

The table follows Spec-Bench (Xia et al. 2024): per category, the speedup of each drafter over
target-only decoding of the same prompts in the same run, the mean accepted tokens per target
pass (committed tokens / target forwards) and the acceptance at each draft position. One
target is loaded; every prompt runs target-only once and once per drafter, batch 1, the
drafter's settings (gamma, adaptive gamma, trees, temperature, ...) from the same config as
`specjax generate`.

Timing: a run's *decode rate* is the tokens committed after its first round divided by the
wall time from the first round's end to the last's (`decode_tokens / decode_s`), so prompt
prefill and compilation are excluded, as in `specjax generate`'s tokens/s. A category's
speedup is the drafter's summed decode rate over the target-only one,
``(sum decode_tokens / sum decode_s)_drafter / (...)_target-only``. Adaptive gamma's round
times are measured once per drafter on the first prompt and reused for the others.

Output in ``out``: ``results.jsonl`` (one ``setup`` record: config, machine, commit; a ``run``
record per prompt and method; a ``summary`` record per method and category, ``all`` included)
and ``results.md``, both written by `run`; `markdown` rebuilds the table from the JSONL alone.
Records go to ``results.jsonl.partial`` while the run lasts (flushed per run), which replaces
``results.jsonl`` only when the run ends: an interrupted run loses no earlier results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from typing import Any

from specjax import reporting
from specjax.settings import Settings, field_types, typed_value

TARGET_ONLY = "target_only"


def _commit() -> str | None:
    """The git commit of the checkout specjax runs from (with '+dirty' for local changes), or None."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def read_utf8(path: pathlib.Path) -> str:
    """The text of a UTF-8 file; a byte that is not UTF-8 is a one-line ValueError naming the
    file, its line and the byte's offset in the file (not a bare UnicodeDecodeError)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: byte 0x{data[e.start]:02x} at byte offset {e.start} is not UTF-8 "
                         f"({e.reason}); the file must be UTF-8") from None


def load_prompts(path: str, per_category: int = 0, num_prompts: int = 0) -> list[dict]:
    """The prompts of a bench run as ``{"id", "category", "prompt"}``.

    ``path`` "" is the held-out Spec-Bench split shipped with specjax (`specjax.specbench`);
    otherwise a JSONL file whose lines are Spec-Bench questions (``question_id``, ``category``,
    ``turns``: the first turn is sent) or ``{"prompt": ...}`` with optional ``id`` and
    ``category`` (default ``"all"``). ``per_category`` > 0 keeps the first that many of each
    category (file order), ``num_prompts`` > 0 the first that many overall, after that.
    A malformed line, a byte that is not UTF-8 or a prompt that cannot be encoded as UTF-8 (a
    lone surrogate escape) is a ValueError naming the file and line, before any model loads."""
    from specjax import decoding, specbench
    if not path:
        rows = [{"id": q.question_id, "category": q.category, "prompt": q.prompt}
                for q in specbench.load(split="held_out")]
    else:
        p = pathlib.Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"prompts={path!r}: no such file")
        rows = []
        # Lines end at "\n" only: str.splitlines would also split inside a JSON string at a raw
        # U+2028, U+2029 or U+0085 (legal there), and give line numbers that differ from an editor's.
        for n, line in enumerate(read_utf8(p).split("\n"), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{p}:{n}: expected a JSON object")
            if "turns" in d and isinstance(d["turns"], list) and d["turns"] and isinstance(d["turns"][0], str):
                text = d["turns"][0]
            elif isinstance(d.get("prompt"), str):
                text = d["prompt"]
            else:
                raise ValueError(f"{p}:{n}: expected 'turns' (a list of strings) or 'prompt' (a string)")
            decoding.check_text(text, f"{p}:{n}", escaped_bytes=False)
            rows.append({"id": d.get("question_id", d.get("id", n)), "category": str(d.get("category", "all")),
                         "prompt": text})
    if per_category > 0:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            if seen.get(r["category"], 0) < per_category:
                seen[r["category"]] = seen.get(r["category"], 0) + 1
                kept.append(r)
        rows = kept
    if num_prompts > 0:
        rows = rows[:num_prompts]
    if not rows:
        raise ValueError(f"prompts={path!r}: no prompts selected (per_category={per_category}, "
                         f"num_prompts={num_prompts})")
    return rows


def _run_one(gen, batch, samp) -> tuple[list[int], dict]:
    import jax

    from specjax import decoding
    events, tokens = [], []
    for ev in gen.stream(batch, samp, precompile=True):      # adaptive candidates compile before round 1
        events.append(ev)
        tokens.extend(ev.new_tokens[0])
    m = jax.device_get(events[-1].output.metrics)
    t = decoding.timing_summary(events)
    decode_tokens, decode_s, ttft = t["decode_tokens"], t["decode_s"], t["ttft_s"]
    rec = {"new_tokens": len(tokens), "rounds": int(m.rounds_B[0]), "committed": int(m.committed_B[0]),
           "proposed": int(m.proposed_B[0]), "accepted": int(m.accepted_B[0]),
           "accepted_at": [int(x) for x in np.asarray(m.accepted_at_BG[0])],
           "tested_at": [int(x) for x in np.asarray(m.tested_at_BG[0])],
           "degenerate_residuals": int(m.degenerate_residual_B[0]),
           "gamma_rounds": [int(x) for x in np.asarray(m.gamma_rounds_Z)],
           "decode_tokens": decode_tokens, "decode_s": decode_s, "ttft_s": ttft,
           "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
           "status": events[-1].output.statuses()[0]}
    return tokens, rec


def _sum_lists(lists) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    out = [0] * width
    for x in lists:
        for j, v in enumerate(x):
            out[j] += v
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """``summary`` records per (method, category) and per method over ``all`` prompts from the
    ``run`` records (see the module docstring for the formulas)."""
    def rate(rs):
        s = sum(r["decode_s"] for r in rs)
        return sum(r["decode_tokens"] for r in rs) / s if s > 0 else float("nan")

    out = []
    methods = list(dict.fromkeys(r["method"] for r in runs))
    categories = list(dict.fromkeys(r["category"] for r in runs))
    for method in methods:
        for cat in categories + ["all"]:
            rs = [r for r in runs if r["method"] == method and (cat == "all" or r["category"] == cat)]
            base = [r for r in runs if r["method"] == TARGET_ONLY and (cat == "all" or r["category"] == cat)]
            if not rs:
                continue
            acc, tested = _sum_lists([r["accepted_at"] for r in rs]), _sum_lists([r["tested_at"] for r in rs])
            rec = {"kind": "summary", "method": method, "category": cat, "prompts": len(rs),
                   "tokens_per_s": rate(rs), "speedup": rate(rs) / rate(base) if base else float("nan"),
                   "mean_accepted_tokens": sum(r["committed"] for r in rs) / max(sum(r["rounds"] for r in rs), 1),
                   "acceptance_at": [a / t if t else None for a, t in zip(acc, tested)],
                   "degenerate_residuals": sum(r["degenerate_residuals"] for r in rs)}
            same = [r["same_as_target_only"] for r in rs if r.get("same_as_target_only") is not None]
            if same:
                rec["same_as_target_only"] = f"{sum(same)}/{len(same)}"
            out.append(rec)
    return out


def markdown(records: list[dict]) -> str:
    """The bench table (Markdown) from a ``results.jsonl``'s records alone."""
    setup = next(r for r in records if r["kind"] == "setup")
    sums = [r for r in records if r["kind"] == "summary"]
    methods = list(dict.fromkeys(r["method"] for r in sums))
    cats = list(dict.fromkeys(r["category"] for r in sums if r["category"] != "all")) + ["all"]
    by = {(r["method"], r["category"]): r for r in sums}
    c, machine = setup["config"], setup["machine"]
    lines = [f"# specjax bench: {c['target']}", "",
             f"- machine: {machine.get('cpu')} ({machine.get('cores')} cores, {machine.get('backend')}: "
             f"{machine.get('device')}); jax {machine.get('jax')}; commit {setup.get('commit')}",
             f"- command: `{setup['command']}`",
             f"- {setup['prompts']} prompts ({c['prompts'] or 'Spec-Bench held-out split'}), batch 1, "
             f"{c['max_new_tokens']} new tokens, temperature {c['temperature']}, top-k {c['top_k']}, top-p {c['top_p']}, "
             f"gamma {'adaptive ' + str(tuple(c['adaptive_gammas'])) if c['adaptive_gamma'] else c['gamma']}"
             + (f", tree {c['tree']}" if c.get("tree") else "") + f", seed {c['seed']}",
             "- speedup: summed decode rate (tokens after the first round / their wall time) over target-only's "
             "on the same prompts in this run; accepted tokens: committed tokens per target forward", "",
             "## Speedup over target-only", ""]
    lines += reporting.table_lines(["method"] + cats, [[m] + [reporting.fmt(by[m, k]["speedup"]) + "x" if (m, k) in by else "-" for k in cats]
                                        for m in methods])
    lines += ["", "## Mean accepted tokens per target pass", ""]
    lines += reporting.table_lines(["method"] + cats, [[m] + [reporting.fmt(by[m, k]["mean_accepted_tokens"]) if (m, k) in by else "-"
                                               for k in cats] for m in methods])
    width = max((len(by[m, "all"]["acceptance_at"]) for m in methods), default=0)
    lines += ["", "## Acceptance per draft position (all prompts) and decode rate", ""]
    lines += reporting.table_lines(["method", "tokens/s"] + [f"pos {j + 1}" for j in range(width)] + ["greedy = target-only",
                                                                                        "degenerate residuals"],
                    [[m, reporting.fmt(by[m, "all"]["tokens_per_s"], 1)]
                     + [reporting.fmt(a) for a in by[m, "all"]["acceptance_at"]]
                     + ["-"] * (width - len(by[m, "all"]["acceptance_at"]))
                     + [by[m, "all"].get("same_as_target_only", "-"), by[m, "all"]["degenerate_residuals"]]
                     for m in methods])
    return "\n".join(lines) + "\n"


# What one drafters entry may set for itself besides its kind's own settings: how it drafts and
# verifies. The target, the sampling settings and the length are shared by every method of a bench
# (one target-only reference).
COMMON_ENTRY_SETTINGS = ("gamma", "adaptive_gamma", "adaptive_gammas", "tree", "adaptive_trees", "tree_verifier",
                         "tree_children", "verifier")


def _split_entry(entry: str) -> tuple[str, list[str]]:
    """(kind, [key=value items]) of a drafters entry: ``@`` ends the kind, ``;`` separates items,
    neither counts inside a double-quoted JSON string (``head:"dir@2;b"``, ``draft_model="a;b"``)."""
    parts, cur, quoted, escaped = [], [], False, False
    kind = None
    for ch in entry:
        if quoted:
            cur.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch == "@" and kind is None:
            kind, cur = "".join(cur), []
            continue
        elif ch == ";" and kind is not None:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quoted:
        raise ValueError(f"drafters entry {entry!r}: a double quote is not closed")
    if kind is None:
        return "".join(cur), []
    parts.append("".join(cur))
    return kind, [p for p in parts if p]


def _unquote(text: str, entry: str) -> str:
    """A string value as written, or the JSON string it quotes (for paths holding ``@`` or ``;``)."""
    if not text.startswith('"'):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"drafters entry {entry!r}: {text} is not a JSON string") from None
    if not isinstance(value, str):
        raise ValueError(f"drafters entry {entry!r}: {text} is not a JSON string")
    return value


def entry_changes(entry: str) -> tuple[str, dict]:
    """(drafter kind, {config key: value}) of one ``drafters`` entry: a drafter kind, or
    ``KIND:VALUE`` (the kind's first setting, e.g. ``head:<directory>``: a head from that
    directory), optionally followed by ``@key=value;key=value`` overriding drafting settings for
    this entry alone (`COMMON_ENTRY_SETTINGS` and the kind's own, e.g. ``head@tree=dynamic:5,4,20``
    beside ``head``: the same head in a dynamic tree and in a chain; ``hybrid@draft_model=<dir>``:
    the hybrid with another head). String settings take the text as it is, or a double-quoted
    JSON string for text holding ``@`` or ``;`` (``head:"runs/a@b"``); the others read it as JSON
    (``gamma=4``, ``adaptive_gamma=true``). ValueError naming the entry for an unknown key, a key
    given twice, a setting the drafter does not read (``ngram@draft_model=...``) or a value that
    does not parse."""
    from specjax import build, drafters
    kind_text, items = _split_entry(entry)
    name, colon, main = kind_text.partition(":")
    if name == drafters.TARGET_ONLY:
        raise ValueError("drafters: 'none' is the target-only baseline every bench runs; list only drafters")
    try:
        kind = drafters.drafter_kind(name)
    except ValueError as e:
        raise ValueError(f"drafters entry {entry!r}: {e}") from None
    fields = dataclasses.fields(kind.settings)
    own, hints = {f.name: f for f in fields}, field_types(kind.settings)
    changes = {"drafter": name}
    if colon:
        if not fields:
            raise ValueError(f"drafters entry {entry!r}: drafter {name!r} reads no setting to give after ':'")
        changes[fields[0].name] = _unquote(main, entry)
    for item in items:
        key, sep, text = item.partition("=")
        if key in changes:
            raise ValueError(f"drafters entry {entry!r}: sets {key} twice; give it once")
        if not sep or (key not in COMMON_ENTRY_SETTINGS and key not in own):
            raise ValueError(f"drafters entry {entry!r}: {item!r} is not KEY=VALUE of a drafting setting of drafter "
                             f"{name!r} ({', '.join(COMMON_ENTRY_SETTINGS + tuple(own))}; the target, sampling and "
                             f"length are the bench's own)")
        is_text = key in build.STRING_FIELDS or (key in own and hints[key] is str)
        try:
            changes[key] = _unquote(text, entry) if is_text else json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"drafters entry {entry!r}: {key}={text!r} is not a JSON value") from None
    return name, changes


@dataclasses.dataclass(frozen=True)
class BenchSettings(Settings):
    """`specjax bench`'s settings, typed once from its config: the target-only baseline's
    generation settings, one per ``drafters`` entry, and the bench's own keys."""
    baseline: Any = None                   # `build.GenerateSettings` with drafter 'none'
    methods: tuple = ()                    # (entry, `build.GenerateSettings`) per drafters entry
    prompts: str = ""
    per_category: int = 1
    num_prompts: int = 0
    out: str = "bench_results"
    progress: bool = True
    seed: int = 0
    compilation_cache_dir: str = ""
    record: Any = None                     # the config's values as given (the setup record)


def bench_settings(c: Any) -> BenchSettings:
    """`BenchSettings` of a configs/bench.py config: each drafters entry's generation settings
    typed from the shared keys with the entry's own over them (ValueError naming the entry)."""
    from specjax import build, drafters
    values = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    kinds = tuple(values.get("drafters", ()))
    if not kinds:
        raise ValueError("drafters=(): name at least one drafter, e.g. ('ngram',)")
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise ValueError(f"drafters: {', '.join(map(repr, repeated))} listed more than once (each entry is one "
                         f"method of the bench; give it once, or give the copies different @settings)")
    methods = []
    for entry in kinds:
        _, changes = entry_changes(entry)
        try:
            methods.append((entry, build.generate_settings(values, **changes)))
        except ValueError as e:
            raise ValueError(f"drafters entry {entry!r}: {e}") from None
    hints = field_types(BenchSettings)
    own = {f.name: typed_value(f.name, hints[f.name], values[f.name]) for f in dataclasses.fields(BenchSettings)
           if f.name in values and f.name not in ("baseline", "methods", "record")}
    return BenchSettings(baseline=build.generate_settings(values, drafter=drafters.TARGET_ONLY), methods=tuple(methods),
                         record=values, **own)


def main(s: BenchSettings, command: str = "specjax bench") -> list[dict]:
    """`specjax bench` on typed settings: checks before anything loads, then `run`."""
    from specjax import build, files
    build.check_seed(s.seed)
    files.check_output_dir("out", s.out)         # a file or a symlink loop: before any model loads
    build.enable_compilation_cache(s.compilation_cache_dir)
    build.limit_heap_retention()
    summary = run(s, command=command)
    for r in summary:
        if r["category"] == "all":
            print(f"[specjax] {r['method']}: {r['tokens_per_s'] or float('nan'):.1f} tokens/s, speedup "
                  f"{r['speedup'] or float('nan'):.2f}x over target-only, mean accepted tokens "
                  f"{r['mean_accepted_tokens']:.2f} per target pass", flush=True)
    print(f"[specjax] table: {s.out}/results.md, records: {s.out}/results.jsonl", flush=True)
    return summary


def run(s: BenchSettings, command: str = "specjax bench") -> list[dict]:
    """Run the bench on typed settings; returns the summary records and writes ``results.jsonl``
    and ``results.md`` into ``s.out``."""
    import jax
    from tqdm import tqdm

    from specjax import build, calibration

    samp = build.sampling_config(s.baseline)
    build.check_configs((s.baseline, *(m for _, m in s.methods)))   # every drafter's, before anything loads
    prompts = load_prompts(s.prompts, s.per_category, s.num_prompts)
    out = pathlib.Path(s.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={s.out!r}: is a file; the bench writes results.jsonl and results.md into a directory")
    out.mkdir(parents=True, exist_ok=True)       # (every process: exist_ok)

    t0 = time.perf_counter()
    target, params, tokenizer = build.load_target_with_tokenizer(s.baseline)
    made = build.generators_for((s.baseline, *(m for _, m in s.methods)), target, params, tokenizer)
    gens = dict(zip((TARGET_ONLY, *(entry for entry, _ in s.methods)), made))
    load_s = time.perf_counter() - t0
    setup = {"kind": "setup", "command": command, "config": s.record, "commit": _commit(),
             "machine": calibration.machine_key(), "load_s": load_s, "prompts": len(prompts),
             "prompt_ids": [p["id"] for p in prompts], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    records, runs = [setup], []
    jsonl = out / "results.jsonl"
    partial = out / "results.jsonl.partial"       # an earlier run's results stay until this one ends
    from specjax import distributed
    primary = distributed.is_primary()             # several processes: process 0 writes the files
    with open(partial if primary else os.devnull, "w") as f:
        f.write(json.dumps(reporting.clean(setup), default=str) + "\n")
        bar = tqdm(total=len(prompts) * len(gens), disable=not (s.progress and primary), file=sys.stderr, unit="run",
                   desc="bench")
        for i, p in enumerate(prompts):
            ids = gens[TARGET_ONLY].encode(p["prompt"])
            reference = None
            for method, gen in gens.items():
                batch = gen.batch([ids], jax.random.fold_in(jax.random.key(s.seed), i))
                if i == 0 and gen.config.adaptive:
                    gen.calibrate(batch, samp, repeats=3)     # kept on `gen` for the later prompts
                bar.set_postfix_str(f"{method} on {p['category']} #{p['id']}")
                tokens, rec = _run_one(gen, batch, samp)
                if method == TARGET_ONLY:
                    reference = tokens
                rec.update(kind="run", method=method, id=p["id"], category=p["category"], prompt_tokens=len(ids),
                           same_as_target_only=(tokens == reference) if (s.baseline.temperature == 0 and method != TARGET_ONLY)
                           else None)
                if gen.round_time_s is not None:
                    rec["round_time_s"] = list(gen.round_time_s)
                runs.append(rec)
                f.write(json.dumps(reporting.clean(rec)) + "\n")
                f.flush()
                bar.update(1)
        bar.close()
        summary = summarize(runs)
        summary = [reporting.clean(r) for r in summary]
        for rec in summary:
            f.write(json.dumps(rec) + "\n")
    records += runs + summary
    if primary:
        partial.replace(jsonl)
        (out / "results.md").write_text(markdown(records))
    return summary
