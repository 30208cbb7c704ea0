"""One launch of real `python llm_train/train.py` processes (bench/cases.py runs them): started offline in its
own process group, polled by the samplers of bench/watch.py, stopped when told, its log tail kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.environment import OFFLINE_ENV, REPO
from bench.watch import GpuMemorySampler, HostMemorySampler

TAIL_CHARS = 3000


@dataclass
class Launch:
    """One process: how it ended, what the harness did to it, and what it held at most."""

    cmd: list[str]
    log: Path
    rc: int | None = None
    wall_s: float = 0.0
    output: str = ""
    timed_out: bool = False
    action: str | None = None  # what the harness did to it: "SIGTERM ..." / "SIGKILL ..."
    host_pss_peak_gib: float | None = None  # the process tree's PSS (HostMemorySampler)
    host_used_delta_peak_gib: float | None = None  # the machine's used memory above its value at launch
    gpu_used_peak_gib: float | None = None  # NVML, the whole device
    gpu_used_idle_gib: float | None = None  # NVML before the launch
    # With `second_phase_when`: the tree's PSS peak from the moment it first held (e.g. the export).
    second_phase_host_pss_peak_gib: float | None = None
    first_phase_host_pss_peak_gib: float | None = None  # ... and before it

    @property
    def tail(self) -> str:
        return self.output[-TAIL_CHARS:]

    @property
    def gpu_used_delta_gib(self) -> float | None:
        if self.gpu_used_peak_gib is None or self.gpu_used_idle_gib is None:
            return None
        return self.gpu_used_peak_gib - self.gpu_used_idle_gib

    @property
    def ended(self) -> str:
        """How the launch ended, for a case's error: 'timed out' or 'exit N'."""
        return "timed out" if self.timed_out else f"exit {self.rc}"

    def failure(self, done: int, wanted: int) -> str:
        """'timed out after 1 of 4 steps', 'exit 1 after 0 of 4 steps', naming an outside SIGKILL."""
        what = self.ended
        if self.rc == -signal.SIGKILL and not self.timed_out and self.action is None:
            # Not the harness's kill; with host memory near its end the kernel's OOM killer is the usual sender.
            what += " (SIGKILL not sent by the harness; see host_used_delta_peak_gib)"
        return f"{what} after {done} of {wanted} steps"


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    log: Path


RUNNING: list[_Running] = []  # the launch in progress, for Results.stop


def launch(
    cmd: list[str],
    timeout: float,
    log: Path,
    *,
    sigterm_when: Callable[[], bool] | None = None,
    kill_when: Callable[[], bool] | None = None,
    second_phase_when: Callable[[], bool] | None = None,
    gpu: bool = False,
    on_poll: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
) -> Launch:
    """Run `cmd` from the repository root in its own process group, polling it: SIGTERM once
    `sigterm_when()`, SIGKILL (the group) once `kill_when()` or at `timeout`. Host memory (and with `gpu`,
    the device's) is sampled at every poll; from the first poll at which `second_phase_when()` holds, the
    host peak is also kept apart for that phase. `on_poll(pid)` runs at every poll (more samplers)."""
    result = Launch(cmd, log)
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    started = time.time()
    host = HostMemorySampler()
    second: HostMemorySampler | None = None
    sampler = GpuMemorySampler() if gpu else None
    result.gpu_used_idle_gib = sampler.used_gib() if sampler else None
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        # Its own process group (a kill takes its helpers too) but not its own session: the device tool
        # ends every process of the command's session when the command ends or times out.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        RUNNING.append(_Running(proc, log))
        try:
            while proc.poll() is None:
                host.sample(proc.pid)
                if second is None and second_phase_when is not None and second_phase_when():
                    result.first_phase_host_pss_peak_gib = host.pss_peak_gib
                    second = HostMemorySampler()
                if second is not None:
                    second.sample(proc.pid)
                if on_poll is not None:
                    on_poll(proc.pid)
                used = sampler.used_gib() if sampler else None
                if used is not None:
                    result.gpu_used_peak_gib = max(result.gpu_used_peak_gib or 0.0, used)
                if sigterm_when is not None and result.action is None and sigterm_when():
                    proc.send_signal(signal.SIGTERM)  # the trainer itself, as SLURM or a user would
                    result.action = f"SIGTERM at {time.time() - started:.1f}s"
                if kill_when is not None and kill_when():
                    result.action = f"SIGKILL after the steps were logged, at {time.time() - started:.1f}s"
                    kill_group(proc)
                    break
                if time.time() - started > timeout:
                    result.timed_out = True
                    kill_group(proc)
                    break
                time.sleep(0.05 if sigterm_when is not None else 0.25)
            result.rc = proc.wait()
        finally:
            RUNNING[:] = [r for r in RUNNING if r.proc is not proc]
    result.wall_s = time.time() - started
    result.host_pss_peak_gib, result.host_used_delta_peak_gib = host.pss_peak_gib, host.used_delta_peak_gib
    if second is not None:
        result.second_phase_host_pss_peak_gib = second.pss_peak_gib
    else:
        result.first_phase_host_pss_peak_gib = host.pss_peak_gib
    result.output = log.read_text(errors="replace")
    return result


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own just now
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def log_tail(path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
