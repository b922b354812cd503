"""The heads' training summaries (``train-<name>.json``, written by `experiments.heads.train` and
by the learning curve's export): writing and reading one, and the data tokens of a run (its own
record, or one of a run on the same cached data). Shared by those writers, the heads' training
table and the learning curve's report."""

from __future__ import annotations

import json
import pathlib


# The settings the target's training data is generated and cached under (`specjax.distill`'s
# target data: its cache key), with that code's defaults for keys older configs lack.
DATA_SETTINGS = ("target", "dtype", "seed", "data.greedy_samples", "data.sampled_samples", "data.temperature",
                 "data.second_turns", "data.max_new_tokens", "data.widths", "data.max_prompt_tokens",
                 "data.per_category", "data.target_weight")
DATA_DEFAULTS = {"data.second_turns": False, "data.max_prompt_tokens": 0, "data.per_category": 0,
                 "data.target_weight": 1.0}


def data_settings(config: dict) -> tuple | None:
    """The run's `DATA_SETTINGS` values, or None when its config lacks one without a default."""
    out = []
    for key in DATA_SETTINGS:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        node = DATA_DEFAULTS.get(key) if node is None else node
        if node is None:
            return None
        out.append(json.dumps(node, sort_keys=True))
    sh = (config.get("data") or {}).get("shards") or {}
    out.append(json.dumps(list(sh.get("dirs", ())) if sh.get("weight", 0) > 0 else []))   # streamed shards, if any
    return tuple(out)


def data_tokens(runs: dict) -> dict:
    """{run: (target loss tokens of its training data, the run they were recorded by)}: the run's
    own record, else that of a run with the same `data_settings` (whose data is the same cached
    set), else (None, None)."""
    own = {name: (sum(run["summary"]["data_loss_tokens"].values()) if run["summary"].get("data_loss_tokens") else None,
                  data_settings(run["provenance"].get("config", {}))) for name, run in runs.items()}
    recorded = {}
    for name, (size, key) in own.items():
        if size is not None and key is not None:
            recorded.setdefault(key, (size, name))
    return {name: (size, name) if size is not None else recorded.get(key, (None, None))
            for name, (size, key) in own.items()}


def write_summary(results, name: str, summary: dict, provenance: dict, metrics, *, overwrite: bool = True) -> pathlib.Path:
    """Write a run's summary as ``results/train-<name>.json`` (``{"summary", "provenance"}``, the
    file `read_summary` reads; replaced in one rename) and its metrics file as
    ``train-<name>.jsonl``. ValueError, before anything is written, for an existing summary when
    not ``overwrite``."""
    results = pathlib.Path(results)
    path = summary_path(results, name, overwrite=overwrite)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"train-{name}.jsonl").write_bytes(pathlib.Path(metrics).read_bytes())
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps({"summary": summary, "provenance": provenance}, indent=1, default=str))
    tmp.replace(path)
    return path


def summary_path(results, name: str, *, overwrite: bool = True) -> pathlib.Path:
    """``results/train-<name>.json``; ValueError when it exists and not ``overwrite``."""
    path = pathlib.Path(results) / f"train-{name}.json"
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; choose another name")
    return path


def read_summary(path: pathlib.Path) -> dict:
    """A ``train-<name>.json`` summary; ValueError naming the file when it is not valid JSON or
    lacks 'summary' and 'provenance'."""
    try:
        run = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(run, dict) or not {"summary", "provenance"} <= run.keys():
        raise ValueError(f"{path}: not a training summary written by experiments.heads.train "
                         f"(no 'summary' and 'provenance')")
    return run
