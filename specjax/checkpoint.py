"""All checkpointing in one place: an Orbax `CheckpointManager` over a work directory.

A checkpoint holds two items: ``state`` (any pytree of arrays, e.g. the distillation
`TrainState`) and ``meta`` (JSON: what produced it, data position, token counts). Saves are
asynchronous (the next steps run while the arrays are written) and the last `keep` are kept.
Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves no step that looks finished. `restore_latest` goes from the newest step
down and uses the first one that restores cleanly; every unreadable one is reported (logged,
and returned in ``skipped``), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict
    skipped: list[tuple[int, str]]       # (step, error) of newer checkpoints that failed


class Checkpointer:
    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=async_save))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict | None = None, *, force: bool = False) -> bool:
        return self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta or {}))), force=force)

    def restore(self, step: int, template) -> tuple[Any, dict]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"] or {})

    def restore_latest(self, template) -> Restored | None:
        """The newest checkpoint that restores, or None when there is none at all.

        Raises if checkpoints exist but none can be read (a run must not silently restart
        from scratch over a directory of broken checkpoints).
        """
        skipped = []
        steps = self.steps()
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, template)
            except Exception as e:  # noqa: BLE001 - any failure to read means: use the previous one
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                logging.warning("checkpoint at step %d in %s is unreadable (%s); trying the previous one",
                                step, self.directory, msg)
                print(f"[checkpoint] step {step} unreadable ({msg}); trying the previous one", flush=True)
                skipped.append((step, msg))
                continue
            for s, _ in skipped:    # a resumed run saves these steps again, and Orbax refuses an existing step
                self.manager.delete(s)
            return Restored(step, state, meta, skipped)
        if steps:
            raise RuntimeError(f"no readable checkpoint in {self.directory}: {skipped}")
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
