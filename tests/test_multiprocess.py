"""Two real processes (issue 15): `launch/local_cpu.sh 2` starts them with `jax.distributed` on
127.0.0.1 (CPU collectives: gloo), one CPU device each; together they run a data-parallel
distillation (`distill.train`, the global batch split over the two processes, Orbax
checkpoints saved by both together) and a batch of speculative generation whose rows live half
in each process (greedy and T = 1 top-p 0.9), which process 0 then runs again on its one device
alone. The distillation is FSDP over the two processes (each holds half of the draft's weights
and Adam moments), evaluates every 6 steps and exports at the end (both gather the parameters
across the processes). The generation must equal the one-device run's exactly (tokens, lengths
and accepted counts; per-request keys; see test_sharded_engine for why equality holds), the
training this single process's run of it within atol 2e-5 (trained parameters; float sums in
another order; see test_sharded_train). Only process 0 writes the metrics (each step once). The
launcher stops both processes when one fails, and the test kills the process group on a
timeout. The two processes compile with XLA's backend code generation turned down
(`_bench_run.FAST_COMPILE_XLA_FLAGS`: the same optimized HLO up to a few fusion decisions,
compiled in a fraction of the time, rounded a little differently), so the generation is compared
with a one-device run compiled the same way, and the training within its tolerance."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import jax
import numpy as np

import _distill_toy as toy
import _multiprocess_common as common
from _bench_run import FAST_COMPILE_XLA_FLAGS
from test_sharded_train import _params, _step_dirs

from specjax import distill

REPO = pathlib.Path(__file__).resolve().parents[1]
ATOL = 2e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_and_generate_like_one(tmp_path):
    root = tmp_path
    toy.write_target(root / "target")
    toy.write_data(root / "data.jsonl")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = FAST_COMPILE_XLA_FLAGS
    cmd = ["bash", str(REPO / "launch" / "local_cpu.sh"), "2", "--port", str(_free_port()), "--logs",
           str(root / "logs"), "--", sys.executable, str(REPO / "tests" / "_multiprocess_job.py"), str(root)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()             # the launcher's trap stops both process groups
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"the 2-process job did not finish in 240 s:\n{out[-3000:]}")
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "logs").glob("*.log")))
    assert proc.returncode == 0, out[-2000:] + logs
    for i in (0, 1):
        assert f"DONE {i}" in (root / "logs" / f"process-{i}.log").read_text(), logs

    # The same work in this process, on its one device.
    assert jax.device_count() == 1
    one = distill.train(common.distill_config(root, "one-process"), root / "one-process", log=lambda s: None)
    generation = json.loads((root / "generation.json").read_text())
    ref, got = generation["one_device"], generation["two_processes"]
    for name in ref:
        for what, a, b in zip(("tokens", "lengths", "accepted"), got[name], ref[name]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {what}")
    last_two, last_one = _step_dirs(root / "two-process")[-1], _step_dirs(root / "one-process")[-1]
    assert int(last_two.name) == int(last_one.name) == one["steps"] >= 10
    # the evaluations (run in both processes on gathered parameters, written by process 0) and the
    # export (parameters gathered from both processes) agree with the one-process run
    two = json.loads((root / "two-process" / "final.json").read_text())
    assert two["eval"]["step"] == one["eval"]["step"] == one["steps"]
    for k in ("alpha_t1", "greedy_agreement"):
        assert abs(two["eval"][k] - one["eval"][k]) < 1e-4, (k, two["eval"], one["eval"])
    evals = [json.loads(l) for l in (root / "two-process" / "metrics.jsonl").read_text().splitlines()
             if json.loads(l).get("kind") == "eval"]
    assert [e["step"] for e in evals] == [6, 12, one["steps"]][: len(evals)] and len(evals) >= 2
    a_files = sorted(p.name for p in (root / "two-process-export").iterdir())
    assert a_files == sorted(p.name for p in (root / "one-process-export").iterdir()) and a_files
    a, b = _params(last_two), _params(last_one)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=ATOL, rtol=0, err_msg=k)
    steps = [json.loads(l)["step"] for l in (root / "two-process" / "metrics.jsonl").read_text().splitlines()
             if json.loads(l).get("kind") == "train"]
    assert steps == list(range(1, one["steps"] + 1))
