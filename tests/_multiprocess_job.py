"""What each process of tests/test_multiprocess.py runs (started by launch/local_cpu.sh): a
data-parallel distillation on the toy target and a batch of speculative generation, both over
a mesh spanning the processes. Process 0 then runs the same generation on its one device, the
reference (compiled with the same options as the 2-process run), and writes both to
ROOT/generation.json."""
import json
import pathlib
import sys

from specjax import distributed

distributed.initialize()       # SPECJAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID from the launcher

import jax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _distill_toy as toy  # noqa: E402
import _multiprocess_common as common  # noqa: E402

from specjax import distill, sharding  # noqa: E402

root = pathlib.Path(sys.argv[1])
assert jax.process_count() == 2 and jax.device_count() == 2 and jax.local_device_count() == 1, jax.devices()
summary = distill.train(common.distill_config(root, "two-process"), root / "two-process", log=lambda s: None)
print("STEPS", summary["steps"], flush=True)
results = common.generate(sharding.make_mesh(data=2, model=1))
if distributed.is_primary():
    reference = common.generate(None)          # no mesh: this process's one device
    (root / "generation.json").write_text(json.dumps({"two_processes": results, "one_device": reference}))
distributed.barrier("specjax-test-done")
print("DONE", jax.process_index(), flush=True)
