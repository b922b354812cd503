"""The Spec-Bench table: `specjax bench` with this directory's config, then the plot from the
JSONL it wrote (`plot`).

    python -m experiments.spec_bench.run --config=experiments/spec_bench/config.py
    python -m experiments.spec_bench.run --config=experiments/spec_bench/config.py:tiny --config.target=T.gguf
"""

from __future__ import annotations

import pathlib
import shlex
import sys

from experiments.lib import toolkit
from experiments.spec_bench import plot
from specjax import bench, build


def main(c):
    build.tune_xla_cpu()
    build.limit_heap_retention()
    build.enable_compilation_cache(c.compilation_cache_dir)
    bench.run(c, command="python -m experiments.spec_bench.run " + shlex.join(sys.argv[1:]))
    for p in plot.plot(pathlib.Path(c.out).expanduser() / "results.jsonl"):
        print(p)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/spec_bench/config.py[:tiny]")
