"""The drafts that ship inside the package, by target registry name: a distilled draft model
(`experiments/distill`) and a feature-level draft head (`experiments/heads`: trained by
`experiments.heads.train`, copied here by `experiments.heads.ship`)."""

from __future__ import annotations

import pathlib

ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"
SHIPPED_DRAFTS = {"smollm2-135m-instruct": ARTIFACTS / "smollm2-135m-instruct-draft"}
SHIPPED_HEADS = {"smollm2-135m-instruct": ARTIFACTS / "smollm2-135m-instruct-head"}


def _shipped(table: dict, target_name: str, what: str, marker: str, made_by: str) -> pathlib.Path:
    if target_name not in table:
        raise ValueError(f"no {what} ships for target {target_name!r} (known: {sorted(table)}); "
                         f"set draft_model to a directory written by specjax.distill")
    d = table[target_name]
    if not (d / marker).is_file():
        raise FileNotFoundError(f"the shipped {what} {d} is missing (reinstall the package, or produce it with "
                                f"{made_by})")
    return d


def shipped_draft(target_name: str) -> pathlib.Path:
    """The distilled draft shipped for ``target_name`` (ValueError where none ships)."""
    return _shipped(SHIPPED_DRAFTS, target_name, "distilled draft", "draft.json", "experiments/distill/run.py")


def shipped_head(target_name: str) -> pathlib.Path:
    """The draft head shipped for ``target_name`` (ValueError where none ships)."""
    return _shipped(SHIPPED_HEADS, target_name, "draft head", "head.json",
                    "experiments/heads/train.py and experiments/heads/ship.py")
