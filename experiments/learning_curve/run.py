"""Learning curve of the feature heads against data size (issue 38 item 4); see config.py.

    python -m experiments.learning_curve.run --config=experiments/learning_curve/config.py

For each data size (loss tokens, nested prefixes of the shards) and head kind: a training run
(`specjax.distill.train`, resumable in ``workdir/<kind>-<size>``) and its held-out evaluation
at the end: greedy agreement of the k-th drafted token, alpha at T = 1 and simulated chain
tokens per target pass. One record per point is appended to ``out`` as soon as the point ends,
so a stopped run started again skips the points it has and resumes the one it was in. The
table, the fit and the plot: `python -m experiments.learning_curve.report OUT`.
"""

from __future__ import annotations

import json
import pathlib

from experiments.lib import head_runs, toolkit


def budget(c, size: int) -> int:
    """Training tokens of a point: epochs x size within [min_budget, max_budget]."""
    return int(min(max(c.epochs * size, c.min_budget), c.max_budget))


def point_config(c, kind: str, size: int):
    """The training config of one point: configs/distill_head.py, the kind's overrides, the
    shards as the only data (cut at `size` loss tokens), evaluation at the end only, `c.set`."""
    from configs import distill_head
    from specjax import distill

    h = distill_head.get_config()
    h.draft.kind = kind
    distill.with_overrides(h, c.kind_overrides[kind].to_dict())
    h.data.target_weight = 0.0
    h.data.shards.update(dirs=tuple(c.shard_dirs), weight=1.0, window=int(c.window), max_loss_tokens=int(size))
    if c.widths:
        h.data.widths = tuple(int(w) for w in c.widths)
    h.budget_tokens = budget(c, size)
    h.eval.every = 1 << 40               # only the evaluation at the end
    h.eval.at_start = False
    h.eval.gamma = int(c.eval_gamma)
    h.export_dir = ""
    h.progress = bool(c.progress)
    distill.with_overrides(h, c.set.to_dict())
    return h


def _records(path) -> list[dict]:
    """The point records of the results file (a torn last line set aside first); [] when absent."""
    from specjax import files
    path = pathlib.Path(path)
    files.recover_jsonl(path)
    return toolkit.read_jsonl(path) if path.is_file() else []


def done_points(path) -> set[tuple[str, int, str]]:
    """(kind, size, series) of the points already in the results file (a torn last line set aside)."""
    return {(r["kind_of_head"], int(r["size"]), r.get("series", "")) for r in _records(path)}


def point_name(c, kind: str, size: int) -> str:
    """A point's workdir name: ``<kind>-<size>`` (``-<series>`` for a series of its own)."""
    return f"{kind}-{size}" + (f"-{c.series}" if c.series else "")


def run(c, log=print) -> list[dict]:
    """Train and evaluate every missing point; returns this call's records."""
    from specjax import distill

    out = pathlib.Path(c.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    have = done_points(out)
    prov = toolkit.provenance("experiments.learning_curve.run", exclude=[out.parent], with_backend=False,
                              config=c.to_dict())
    made = []
    for size in sorted(int(s) for s in c.sizes):
        todo = [point_config(c, kind, size) for kind in c.kinds if (kind, size, c.series) not in have]
        if todo and todo[0].head.feature_cache:     # every kind's layers in one target pass per shard
            also = [point_config(c, k, size) for k in c.feature_kinds if k not in c.kinds]
            n = distill.fill_shard_features(todo + also, log=lambda m: log(f"[features {size}] {m}"))
            log(f"features at {size:,} loss tokens: {n:,} positions computed")
        for kind in c.kinds:
            if (kind, size, c.series) in have:
                log(f"{kind} at {size:,} loss tokens: in {out} already")
                continue
            h = point_config(c, kind, size)
            log(f"{kind} at {size:,} loss tokens of data, {h.budget_tokens:,} training tokens")
            s = distill.train(h, pathlib.Path(c.workdir) / point_name(c, kind, size),
                              log=lambda m: log(f"[{kind} {size}] {m}"))
            rec = {"kind": "point", "kind_of_head": kind, "size": size, "series": c.series,
                   "data_loss_tokens": s["data_loss_tokens"]["shards"], "budget_tokens": h.budget_tokens,
                   "steps": s["steps"], "train_tokens": s["tokens"], "wall_s": s["wall_s"],
                   "train_tokens_per_s": s["train_tokens_per_s"], "eval": s["eval"],
                   "head": s["draft"], "provenance": prov}
            with open(out, "a", encoding="utf-8") as f:
                f.write(json.dumps(toolkit._clean(rec)) + "\n")
            made.append(rec)
    return made


# Settings an export may differ on from the point's training: where the head goes, the progress
# bar, and the feature cache (an export reads no batch).
EXPORT_ONLY_KEYS = ("export_dir", "progress", "head.feature_cache")


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e}); the point's record is damaged, run it again") from None


def export_point(c, kind: str, size: int, dest, log=print, force: bool = False) -> dict:
    """Export the head of a finished point (its workdir's last checkpoint) to ``dest``, in the
    format `experiments.heads.ship` takes, with the point's data tokens, training tokens and
    held-out evaluation (the one recorded at its last step) in head.json. Returns the export's
    summary (dir, bytes, sha256).

    Nothing is trained and the point's records stay as they were: the stored config must equal
    this curve's config of the point (ValueError naming the keys that differ), `distill.train`
    resumes it with ``stop_after_steps`` at its last step, and config.json, final.json and
    metrics.jsonl are put back afterwards. ValueError for a point that has not finished, an
    existing head at ``dest`` (unless ``force``) or a point without an evaluation."""
    from specjax import distill
    workdir = pathlib.Path(c.workdir) / point_name(c, kind, size)
    dest = pathlib.Path(dest)
    if not (workdir / "final.json").is_file():
        raise ValueError(f"{workdir}: no finished {kind} point at {size:,} loss tokens (no final.json); "
                         "run the curve first")
    if (dest / "head.json").exists() and not force:
        raise ValueError(f"{dest} already holds a head (head.json); choose another directory or force")
    h = point_config(c, kind, size)
    final, stored = (_read_json(workdir / name) for name in ("final.json", "config.json"))
    stored = distill.flatten(distill.distill_settings(stored).to_dict())
    wanted = distill.flatten(distill.distill_settings(h).to_dict())
    diff = sorted(k for k in set(stored) | set(wanted)
                  if stored.get(k) != wanted.get(k) and not k.startswith(EXPORT_ONLY_KEYS))
    if diff:
        raise ValueError(f"{workdir} was trained under another config than this curve's {kind} point at {size:,}: "
                         + "; ".join(f"{k}: {stored.get(k)!r} (stored) vs {wanted.get(k)!r}" for k in diff))
    if final["tokens"] < h.budget_tokens:
        raise ValueError(f"{workdir}: the point stopped at {final['tokens']:,} of {h.budget_tokens:,} training tokens")
    if not final.get("eval"):
        raise ValueError(f"{workdir}: the point has no held-out evaluation to export with its head")
    h.export_dir = str(dest)
    h.head.feature_cache = ""
    h.progress = False
    kept = {name: (workdir / name).read_bytes() for name in ("config.json", "final.json", "metrics.jsonl")}
    try:
        s = distill.train(h, workdir, log=lambda m: log(f"[{kind} {size}] {m}"), stop_after_steps=final["steps"])
    finally:
        for name, data in kept.items():
            (workdir / name).write_bytes(data)
    if "export" not in s or s["steps"] != final["steps"]:
        raise ValueError(f"{workdir}: the export did not resume at step {final['steps']} (got {s['steps']}); "
                         "nothing exported")
    return s["export"]


def write_summary(c, kind: str, size: int, export: dict, results, name: str, command: str = "") -> pathlib.Path:
    """Write a finished point's training summary beside the heads' own runs
    (`head_runs.write_summary`: the point's final.json plus ``export``, the provenance of the
    curve's run that trained it with the point's training config, its metrics), so
    `experiments.heads.training_report` gives an exported head its row. ValueError when ``c.out``
    holds no record of the point or its final.json is another run's; an existing summary of
    that name is not overwritten."""
    head_runs.summary_path(results, name, overwrite=False)
    workdir = pathlib.Path(c.workdir) / point_name(c, kind, size)
    recs = [r for r in _records(c.out) if (r["kind_of_head"], int(r["size"]), r.get("series", ""))
            == (kind, size, c.series)]
    if not recs:
        raise ValueError(f"{c.out} holds no record of the {kind} point at {size:,} loss tokens"
                         + (f" (series {c.series!r})" if c.series else ""))
    final = _read_json(workdir / "final.json")
    if recs[-1]["steps"] != final["steps"]:
        raise ValueError(f"{workdir}/final.json (step {final['steps']}) is not the point recorded in {c.out} "
                         f"(step {recs[-1]['steps']})")
    prov = {**recs[-1]["provenance"], "config": point_config(c, kind, size).to_dict()}
    if command:
        prov["exported_by"] = command
    return head_runs.write_summary(results, name, {**final, "export": export}, prov, workdir / "metrics.jsonl",
                                   overwrite=False)


def main(c):
    run(c)
    from experiments.learning_curve import report
    report.write(c.out)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"), "learning-curve settings")
