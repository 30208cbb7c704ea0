"""Host buffers of CPU and NVMe offload, measured with DeepSpeed's own allocator against the planner's rows.

On CPU, DeepSpeed's torch pinning is a no-op (cpu_accelerator.py), but native pinning really mlocks
(DS_PIN_MEMORY_BACKEND=native: posix_memalign + mlock of the exact size), and so do the async-I/O swap
buffers of NVMe offload. The kernel counts every locked page of a process in /proc/PID/status VmLck:
its peak, per training process, must be exactly the planner's `locked_per_rank` (planning/memory/offload_buffers.py
lists each buffer; whole 4 KiB pages). The pinning choice must not change a single loss, and the optimizer
on the "NVMe" (a temporary directory: DeepSpeed's swapper runs without CUDA through libaio) must train like
CPU offload and resume from a kill -9 bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_train.config.resolution import resolve_run
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.search.candidate import memory_inputs
from tests.devices import CPU
from tests.e2e.reference import STEPS, run_args
from tests.helpers import (
    assert_ok,
    assert_resumed,
    committed_step,
    launch_cmd,
    launch_popen,
    losses,
    wait_for_step,
)
from tests.optional import needs

pytestmark = pytest.mark.e2e

NPROC = 2


class LockedPeaks:
    """Peak VmLck of every process of a launch's tree, polled every few ms while it runs.

    The tree is listed again every TREE_EVERY_S only: listing it walks every process of the machine
    (~1 ms of CPU), which every 5 ms took a fifth of a core from a 2-core CI for the whole launch
    (the NVMe one includes the minutes of the async-I/O op build). The workers exist from the start
    of the launch and lock their buffers after DeepSpeed's set-up, long after they are listed.
    """

    POLL_S, TREE_EVERY_S = 0.005, 0.25

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.peaks = proc, {}
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        pids: list[int] = []
        listed = 0.0
        while self.proc.poll() is None:
            if time.monotonic() - listed >= self.TREE_EVERY_S:
                try:
                    root = psutil.Process(self.proc.pid)
                    pids = [root.pid, *(child.pid for child in root.children(recursive=True))]
                except psutil.NoSuchProcess:
                    break
                listed = time.monotonic()
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/status") as status:
                        for line in status:
                            if line.startswith("VmLck:"):
                                kib = int(line.split()[1])
                                self.peaks[pid] = max(self.peaks.get(pid, 0), kib * 1024)
                except OSError:
                    pass
            time.sleep(self.POLL_S)

    def workers(self) -> list[int]:
        """The training processes' peaks (the launcher and its spawner lock nothing)."""
        self._thread.join()
        return sorted(self.peaks.values())[-NPROC:]


def _launch(args: list[str]) -> tuple[subprocess.CompletedProcess, LockedPeaks]:
    cmd = launch_cmd(args, NPROC)
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peaks = LockedPeaks(proc)
    out, _ = proc.communicate(timeout=1200)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, ""), peaks


def _planned_lock(args: list[str]) -> int:
    """The planner's mlocked bytes per process for the run these train.py arguments make."""
    recipe = args[args.index("--recipe") + 1]
    ds = args[args.index("--ds-config") + 1]
    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    run = resolve_run(recipe, overrides, world_size=NPROC, device=CPU, ds_config_path=ds)
    return estimate_memory(memory_inputs(run, shape_from_config(run.model_fields), NPROC)).locked_per_rank


@pytest.mark.parametrize("choice", ["native", "off"])
def test_each_pinning_choice_trains_alike_and_locks_what_the_planner_says(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path, choice: str
) -> None:
    # zero3_offload: the optimizer (master, m, v, gradients) and the 16-bit parameters on the host.
    args = [*run_args("zero3_offload", tmp_path / "run", pretrained), f"deepspeed.pinning={choice}"]
    result, peaks = _launch(args)
    assert_ok(result)
    assert losses(tmp_path / "run") == losses(runs["zero3_offload"])  # the default's (torch), bit for bit
    written = json.loads((tmp_path / "run" / "config" / "ds_config.json").read_text())["zero_optimization"]
    planned = _planned_lock(args)
    if choice == "native":
        # Every buffer of planning/memory/offload_buffers.py, each whole pages: 3 flat buffers and the sub-groups'
        # gradients, zero.Init's 39 per-tensor blocks (norms included) of this rank's partition.
        assert planned > 0 and peaks.workers() == [planned, planned], (peaks.peaks, planned)
        assert written["offload_optimizer"]["pin_memory"] is True
    else:
        assert planned == 0 and peaks.workers() == [0, 0]
        assert (
            written["offload_optimizer"]["pin_memory"] is False
            and written["offload_param"]["pin_memory"] is False
        )


def _nvme_args(run_dir: Path, pretrained: Path, swap: Path) -> list[str]:
    args = run_args("zero3_offload", run_dir, pretrained)
    args[args.index("--ds-config") + 1] = "zero3_offload_optimizer_nvme"
    return [*args, f"deepspeed.nvme_path={swap}", "deepspeed.pinning=native", "checkpoint.every_steps=2"]


@needs("libaio")
def test_optimizer_on_nvme_trains_like_cpu_offload_and_resumes_exactly(
    runs: dict[str, Path], pretrained: Path, tmp_path: Path
) -> None:
    swap = tmp_path / "nvme"
    swap.mkdir()
    straight = tmp_path / "straight"
    args = _nvme_args(straight, pretrained, swap)
    result, peaks = _launch(args)
    assert_ok(result)
    # The swapper really ran: one swap file per state of every swapped sub-group, per rank.
    assert sorted(p.name for p in (swap / "zero_stage_3" / "optimizer").iterdir()) == ["rank0", "rank1"]
    assert any((swap / "zero_stage_3" / "optimizer" / "rank0").glob("*.tensor.swp"))
    # Same data, same initial weights, the same Adam: the losses of CPU offload (zero3_offload's reference).
    ours, cpu = losses(straight), losses(runs["zero3_offload"])
    assert ours.keys() == cpu.keys() == set(range(1, STEPS + 1))
    assert max(abs(ours[k] - cpu[k]) for k in ours) <= 1e-5  # fp32; measured: equal to the last bit
    # The flat gradient buffer (native pinning), 4 swap buffers of the largest sub-group and the unswapped
    # norms' gradient (mlocked): the planner's rows, page for page.
    planned = _planned_lock(args)
    assert peaks.workers() == [planned, planned], (peaks.peaks, planned)

    # kill -9 in or after step 3 (a checkpoint was committed at step 2), then --resume auto.
    killed = tmp_path / "killed"
    args = [*_nvme_args(killed, pretrained, tmp_path / "nvme2"), "--resume", "auto"]
    (tmp_path / "nvme2").mkdir()
    proc = launch_popen(args)
    assert wait_for_step(killed, 3, proc, timeout=900), proc.communicate()[0][-4000:]
    time.sleep(random.Random(22).uniform(0.0, 0.5))
    assert proc.poll() is None, "the run ended before the kill: nothing was tested"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    last = committed_step(killed)
    assert last is not None and last >= 2, last  # step 3 was logged after the step-2 commit
    result, _ = _launch(args)
    assert_ok(result)
    # A relaunch that silently started from step 0 would reproduce these deterministic losses too.
    assert_resumed(result.stdout, killed, last)
    assert losses(killed) == losses(straight)  # exact float equality
    mine, theirs = (load_file(d / "final" / "model.safetensors") for d in (killed, straight))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
