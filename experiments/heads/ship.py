"""Ship a trained head with the package: the head the main command loads for
``--config.drafter=head`` when no ``draft_model`` is given (issue 14).

    python -m experiments.heads.ship [--kind=eagle3]

Copies ``experiments/heads/<kind>/`` (written by `experiments.heads.train`) to
``specjax/artifacts/<target>-head/`` after checking that it loads beside the default target
(format, sha256 of its tensors, the target's dimensions) and fits the 24 MB budget.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

from absl import app, flags

from experiments.heads import config as heads_config
from specjax import build, drafters, models

KIND = flags.DEFINE_string("kind", "eagle3", "the head kind to ship (experiments/heads/<kind>)")
MAX_BYTES = 24_000_000


def ship(source: pathlib.Path, target_name: str = models.DEFAULT_MODEL) -> pathlib.Path:
    """Check `source` (a head directory) against the target and copy it to the package's artifacts."""
    size = sum(f.stat().st_size for f in source.iterdir() if f.is_file())
    if size > MAX_BYTES:
        raise ValueError(f"{source} holds {size} bytes, over the {MAX_BYTES}-byte budget of a shipped head")
    target, params = models.load(target_name)
    drafters.load_head(source, target, params)          # raises, naming the file, on any mismatch
    dest = build.SHIPPED_HEADS[target_name]
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("head.json", "head.safetensors"):
        shutil.copy2(source / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def main(argv):
    del argv
    dest = ship(pathlib.Path(heads_config.head_dir(KIND.value)))
    print(f"shipped {heads_config.head_dir(KIND.value)} -> {dest}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    app.run(main)
