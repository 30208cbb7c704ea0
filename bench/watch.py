"""What a launch is watched for: host memory as PSS, the device's memory through NVML, locked pages and block
I/O of the process tree, and the run's own metrics rows.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from llm_train.units import GiB


def proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a 'Field:  N kB' line of a /proc file (status VmLck, smaps_rollup Pss); None if unreadable."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def proc_tree(pid: int) -> list[Any]:
    """psutil processes of `pid` and all its descendants ([] once it is gone)."""
    try:
        import psutil

        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except Exception:  # gone, or no psutil: nothing to sample
        return []


def used_bytes() -> int | None:
    """The machine's memory in use: MemTotal - MemAvailable (/proc/meminfo), as the OOM killer sees it."""
    fields = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None


class GpuMemorySampler:
    """Device-wide used memory through NVML (no CUDA context in this process); None without NVML or GPU.

    The caps of bench/capped_train.py bound torch's allocator, not the CUDA context, kernel images or
    NCCL's buffers (0.5-1.5 GiB): only this device-wide number can be held against a real card's memory.
    """

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no NVML library or no GPU: device-wide numbers are simply not reported
            self.handle = None

    def name(self) -> str | None:
        """The device's name as the GPU table knows it ('NVIDIA H200')."""
        if self.handle is None:
            return None
        name = self._pynvml.nvmlDeviceGetName(self.handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def used_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return float(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used) / GiB
        except Exception:
            return None


class HostMemorySampler:
    """Peak host memory of one process tree, measured two ways that do not over-count.

    The sum of RSS over a tree counts a page once per process that maps it: forked children share their
    parent's pages copy-on-write, and on the first H200 run the tree's RSS summed to 160.9 GiB on a
    125.9 GiB machine. Instead the tree's PSS (a page shared by n processes counts 1/n in each; pinned
    buffers are shared mappings and are in it), read at most every PSS_EVERY_S (the kernel walks every
    page table of a ~120 GiB process for it), and the machine's used memory above its value at the start.
    """

    PSS_EVERY_S = 1.0

    def __init__(self) -> None:
        self.baseline = used_bytes()
        self.pss_peak: int | None = None
        self.used_peak: int | None = None
        self._last_pss = 0.0

    def sample(self, pid: int) -> None:
        used = used_bytes()
        if used is not None:
            self.used_peak = max(self.used_peak or 0, used)
        now = time.monotonic()
        if now - self._last_pss < self.PSS_EVERY_S:
            return
        self._last_pss = now
        sizes = [proc_kib_field(f"/proc/{proc.pid}/smaps_rollup", "Pss") for proc in proc_tree(pid)]
        known = [size for size in sizes if size is not None]
        if known:
            self.pss_peak = max(self.pss_peak or 0, sum(known))

    @property
    def pss_peak_gib(self) -> float | None:
        return None if self.pss_peak is None else self.pss_peak / GiB

    @property
    def used_delta_peak_gib(self) -> float | None:
        if self.used_peak is None or self.baseline is None:
            return None
        return (self.used_peak - self.baseline) / GiB


class TreeSampler:
    """Per-process peak VmLck (native pinning, async-I/O buffers) and the tree's block I/O at each logged step."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.locked: dict[int, int] = {}
        self.io: dict[int, tuple[int, int]] = {}  # last counters of every process seen (exited ones too)
        self.at_step: list[tuple[float, int, int, int]] = []  # (time, rows, read, write) as rows appear
        self._rows = 0

    def sample(self, pid: int) -> None:
        for proc in proc_tree(pid):
            locked = proc_kib_field(f"/proc/{proc.pid}/status", "VmLck")
            if locked is not None:
                self.locked[proc.pid] = max(self.locked.get(proc.pid, 0), locked)
            self.io[proc.pid] = _io_bytes(proc.pid)
        rows = len(metrics_rows(self.run_dir))
        if rows > self._rows:
            self._rows = rows
            read = sum(r for r, _ in self.io.values())
            write = sum(w for _, w in self.io.values())
            self.at_step.append((time.time(), rows, read, write))

    @property
    def locked_peak(self) -> int:
        """The largest per-process peak (the training process; its launcher locks nothing)."""
        return max(self.locked.values(), default=0)

    def per_step(self) -> tuple[float, float, float] | None:
        """(bytes read, bytes written, seconds) per step from the first logged step on: the first step (no
        Adam moments on the drive yet, and the set-up's writes) is left out. Divided by the steps logged in
        between, not the samples: one sample can see two short steps at once."""
        if len(self.at_step) < 2:
            return None
        (t0, rows0, r0, w0), (t1, rows1, r1, w1) = self.at_step[0], self.at_step[-1]
        steps = rows1 - rows0
        return (r1 - r0) / steps, (w1 - w0) / steps, (t1 - t0) / steps


def _io_bytes(pid: int) -> tuple[int, int]:
    """(read_bytes, write_bytes) that reached the block layer (O_DIRECT included), /proc/PID/io."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Complete step rows of RUN_DIR/metrics.jsonl (a line still being written is skipped)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if "loss" in row and "step" in row:
                rows.append(row)
    return rows


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def peak(rows: list[dict[str, Any]], key: str) -> float | None:
    return max((r[key] for r in rows if r.get(key) is not None), default=None)


def round_floats(value: Any) -> Any:
    """Six significant digits (an injected estimate of 1e-6 stays 1e-6)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value
