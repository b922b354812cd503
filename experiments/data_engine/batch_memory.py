"""Peak resident memory of one data-engine batch, with the run keeping or consuming its prefill.

    python -m experiments.data_engine.batch_memory ROWS PROMPT_TOKENS keep|consume

The default target and configs/data.py's generator; ROWS random prompts of PROMPT_TOKENS tokens,
prefilled, then 8 greedy decode rounds at the capacity of 512 new tokens (the answers stages'
shape). Prints the process's peak resident set after loading, after the prefill and after the
run (`Engine.run(consume_prefill=...)`). One mode per process: the peak is per process.
"""

import dataclasses
import resource
import sys
import time

from experiments.lib import toolkit
from specjax import build


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(rows: int, prompt_tokens: int, mode: str) -> str:
    if mode not in ("keep", "consume"):
        raise SystemExit(f"mode must be keep or consume, got {mode!r}")
    build.tune_xla_cpu()
    build.limit_heap_retention()
    import jax
    import numpy as np
    from configs import data as data_config
    from specjax import decoding, sampling
    c = data_config.get_config()
    g = build.generate_settings(c.generate)
    build.check_config(g)
    gen = build.load_generator(g)
    engine = dataclasses.replace(gen.engine, config=dataclasses.replace(
        gen.engine.config, max_new_tokens=512, max_rounds=8, prefill_chunk=c.prefill_chunk))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, prompt_tokens).tolist() for _ in range(rows)]
    batch = decoding.make_batch(prompts, engine.config, jax.random.key(0), pad_multiple=c.pad_multiple)
    loaded, t0 = _peak_gb(), time.perf_counter()
    pre = engine.prefill(gen.params, batch)
    jax.block_until_ready(pre.target_cache)
    prefilled = _peak_gb()
    jax.device_get(engine.run(gen.params, sampling.SamplingConfig.greedy_config(), batch, prefill=pre,
                              consume_prefill=mode == "consume"))
    cache_gib = rows * decoding.cache_bytes_per_row(engine, batch.capacity) / 2**30
    return (f"rows={rows} prompt={prompt_tokens} capacity={batch.capacity} cache={cache_gib:.2f} GiB {mode}: peak "
            f"resident {loaded:.2f} GB after loading, {prefilled:.2f} after the prefill, {_peak_gb():.2f} after "
            f"the run ({time.perf_counter() - t0:.0f} s; {toolkit.machine()['cpu_model']})")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
