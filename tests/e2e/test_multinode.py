"""Two "machines" on one box (one world over loopback, static rendezvous), launched by the shipped SLURM script.

`launch/slurm.sh` runs under stand-ins for `srun` (one task per "node", SLURM_NODEID set)
and `scontrol` (hostnames, requeue). Each task runs `accelerate launch --config_file
launch/accelerate/multi_node_static.yaml --machine_rank $SLURM_NODEID` against 127.0.0.1,
so the two tasks form one world of 2 that fine-tunes tiny-cpu under ZeRO-3. Mid-run the
job gets SLURM's time-limit warning (SIGUSR1 to the batch script): the workers checkpoint
and stop, the script requeues the job; the "requeued" job resumes with --resume auto.
The per-step losses of the two parts together equal the one 2-process launch of the
shared reference runs (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from tests.e2e.reference import STEPS, run_args
from tests.helpers import ACCELERATE, REPO, assert_resumed, free_port, losses, wait_for_step
from tests.session_env import OFFLINE_ENV

pytestmark = pytest.mark.e2e

FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun: skip the options, start one task per "node" with SLURM_NODEID set,
# forward SIGTERM to the tasks (as srun does), return the worst exit status.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done
    wait "$pid" 2>/dev/null; code=${code:-$?}
    [ "$code" -gt "$status" ] && status=$code
    unset code
done
exit $status
"""

FAKE_SCONTROL = r"""#!/bin/bash
# Stand-in for scontrol: the allocation is this machine; requeue requests are recorded.
case "$1" in
    show) echo 127.0.0.1 ;;
    requeue) echo "requeue $2" >> "$REQUEUE_LOG" ;;
esac
"""


def _tools(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _sbatch(
    bin_dir: Path, args: list[str], restart: int, requeue_log: Path, nodes: int = 2
) -> subprocess.Popen:
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "PATH": f"{bin_dir}:{ACCELERATE.parent}:{os.environ['PATH']}",
        "SLURM_JOB_ID": str(1000 + restart),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": str(nodes),
        "SLURM_GPUS_ON_NODE": "1",  # one process per "node"
        "SLURM_RESTART_COUNT": str(restart),
        "MAIN_PORT": str(free_port()),
        "REQUEUE_LOG": str(requeue_log),
    }
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / "slurm.sh"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_slurm_job_on_two_loopback_machines_checkpoints_requeues_and_resumes(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    bin_dir, run_dir, requeue_log = tmp_path / "bin", tmp_path / "two_machines", tmp_path / "requeue.log"
    _tools(bin_dir)
    args = run_args("zero3", run_dir, pretrained)
    assert args[:2] == ["--recipe", "tiny-cpu"]
    args = ["tiny-cpu", *args[2:]]  # slurm.sh takes the recipe first

    first = _sbatch(bin_dir, args, 0, requeue_log)
    reached = wait_for_step(run_dir, 1, first)
    assert reached, first.communicate()[0][-6000:]
    first.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@... before the time limit
    output = first.communicate(timeout=600)[0]
    assert first.returncode == 0, output[-6000:]
    assert requeue_log.read_text().split() == ["requeue", "1000"], output[-6000:]
    stopped_at = max(losses(run_dir))
    assert stopped_at < STEPS, "the signal arrived after the last step; nothing was interrupted"
    assert (run_dir / "checkpoints" / "latest").is_file()

    second = _sbatch(bin_dir, args, 1, requeue_log)
    output = second.communicate(timeout=600)[0]
    assert second.returncode == 0, output[-6000:]
    assert_resumed(output, run_dir, stopped_at)  # resumed from the stop checkpoint, not restarted
    assert requeue_log.read_text().split() == ["requeue", "1000"]  # the finished job is not requeued

    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and sorted(r["rank"] for r in world["ranks"]) == [0, 1]
    one_launch, two_machines = losses(runs["zero3"]), losses(run_dir)
    assert sorted(two_machines) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert two_machines[step] == pytest.approx(one_launch[step], abs=1e-5), (
            step,
            one_launch,
            two_machines,
        )
    assert (run_dir / "final" / "export_check.json").is_file()
