"""Pinned host buffers: which allocator a run gets (`deepspeed.pinning`), and what it may lock.

DeepSpeed pins its offload buffers through torch's pinned allocator, which rounds each one up to
a power of two (planning/memory/offload_buffers.py, its docstring on pinned allocation): on 7b-rtx4090 that is 6.4 GiB of a 128 GiB
machine. `deepspeed.pinning=native` makes DeepSpeed mlock the exact size instead
(DS_PIN_MEMORY_BACKEND=native); `off` leaves the buffers pageable. DeepSpeed's async-I/O swap
buffers (NVMe offload) are mlocked whatever the choice.

mlock counts against the process's memlock limit (RLIMIT_MEMLOCK, `ulimit -l`, 8 MiB by default
on most distributions) unless the process holds CAP_IPC_LOCK (root usually does). When the limit
is too small DeepSpeed's allocator fails deep inside the engine's set-up (page_alloc.cpp prints
"mlock failed" and returns a null buffer), minutes after the model loaded. So the planner's locked
bytes are compared with the limit before start (planning/search/guards.check_memlock), and
`deepspeed.pinning=auto` takes native pinning when the limit allows it, else torch's allocator when its
rounded total fits the host RAM (the CUDA driver pins those blocks; RLIMIT_MEMLOCK does not bound them),
else `off`.

Which is better where both fit was measured, not assumed: bench/pinning_copy_time.py times the
host side of each choice on CPU (allocation and copies into each kind of buffer), and the GPU
check (bench/gpu_run.sh B, bench/pinning_copy_time.py on the GPU) times host<->GPU copies from each (on a GPU only DMA tells them
apart: a pageable copy is staged through a driver buffer and does not overlap).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from llm_train.planning.memory.estimate import MemoryEstimate, estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.units import GiB

CAP_IPC_LOCK = 14  # linux/capability.h: lock memory beyond RLIMIT_MEMLOCK
MiB = 2**20
MEMLOCK_FIX = (
    "raise the memlock limit of the shell that launches the run (`ulimit -l unlimited`; for a user, "
    "'USER - memlock unlimited' in /etc/security/limits.conf; Docker: --ulimit memlock=-1; systemd: "
    "LimitMEMLOCK=infinity)"
)


@dataclass(frozen=True)
class MemlockLimit:
    """How much this process may mlock: None = no limit (unlimited, or CAP_IPC_LOCK)."""

    limit_bytes: int | None
    why: str

    def allows(self, nbytes: int) -> bool:
        return self.limit_bytes is None or nbytes <= self.limit_bytes

    def describe(self) -> str:
        if self.limit_bytes is None:
            return self.why
        return f"{_size(self.limit_bytes)} (ulimit -l {self.limit_bytes // 1024})"


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.0f} MiB"


def has_cap_ipc_lock(status_path: str = "/proc/self/status") -> bool:
    """Whether this process's effective capabilities include CAP_IPC_LOCK (Linux; False elsewhere)."""
    try:
        with open(status_path) as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def memlock_limit() -> MemlockLimit:
    """This process's memlock allowance; children (the launcher's workers) inherit it."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return MemlockLimit(None, "unlimited (ulimit -l unlimited)")
    if has_cap_ipc_lock():
        return MemlockLimit(None, "no limit: the process holds CAP_IPC_LOCK")
    return MemlockLimit(int(soft), "RLIMIT_MEMLOCK")


def memlock_problem(
    inp: MemoryInputs, source: str, limit: MemlockLimit | None = None, locked: int | None = None
) -> str | None:
    """One line when a process of this run would mlock more than its limit allows (None when it fits).
    locked: the bytes a process locks, when the caller has the estimate of `inp` already."""
    if locked is None:
        locked = estimate_memory(inp).locked_per_rank
    limit = limit or memlock_limit()
    if locked == 0 or limit.allows(locked):
        return None
    what = "deepspeed.pinning=native" if inp.pinning == "native" or inp.param_pinning == "native" else source
    fix = MEMLOCK_FIX
    if inp.pinning == "native" or inp.param_pinning == "native":
        fix += ", or set deepspeed.pinning=off (exact-size pageable buffers, slower host copies)"
    else:
        fix += ", or lower offload_optimizer.buffer_count / sub_group_size in the DS JSON"
    return (
        f"host memory lock: {what} locks ~{_size(locked)} per process (planner), but the memlock limit "
        f"is {limit.describe()}; {fix}"
    )


def _pinned_with(inp: MemoryInputs, backend: str) -> MemoryInputs:
    """`inp` with the offload_optimizer and offload_param buffers it pins pinned by `backend`; the ones it
    leaves pageable stay so."""
    return inp.vary(
        pinning=backend if inp.pinning != "off" else "off",
        param_pinning=backend if inp.param_pinning != "off" else "off",
    )


def choose_auto(
    inp: MemoryInputs,
    device_kind: str,
    limit: MemlockLimit | None = None,
    host_limit_bytes: int | None = None,
    seen: list[tuple[MemoryInputs, MemoryEstimate]] | None = None,
) -> tuple[str, str]:
    """`deepspeed.pinning=auto` on this machine: ('native' | 'torch' | 'off', the notice that says why).
    seen: collects (inputs, estimate) of each pinning estimated, for the caller to reuse.

    Native pinning sizes every buffer exactly and keeps the fast pinned copies; it needs the
    memlock limit to allow what it locks. Where it does not, torch's pinned allocator keeps the fast
    copies without mlock (the CUDA driver pins its blocks, not bound by RLIMIT_MEMLOCK) when its
    power-of-two rounded total still fits the host (`host_limit_bytes`, usable RAM); else 'off'. On a CPU
    run there are no device copies to speed up, and nothing is gained by locking pages: 'off'.
    """
    if device_kind == "cpu":
        return "off", "deepspeed.pinning=auto: off on CPU (no device copies to speed up)"
    limit = limit or memlock_limit()
    seen = [] if seen is None else seen
    native = _pinned_with(inp, "native")
    seen.append((native, estimate_memory(native)))
    locked = seen[-1][1].locked_per_rank
    if limit.allows(locked):
        return "native", (
            f"deepspeed.pinning=auto: native (exact-size pinned buffers, ~{_size(locked)} locked per process; "
            f"memlock limit {limit.describe()})"
        )
    if host_limit_bytes is not None:
        torch = _pinned_with(inp, "torch")
        estimate = estimate_memory(torch)
        seen.append((torch, estimate))
        if estimate.host_bytes <= host_limit_bytes and limit.allows(estimate.locked_per_rank):
            return "torch", (
                f"deepspeed.pinning=auto: torch (pinned by torch's allocator, rounded up to powers of two: "
                f"{estimate.host_bytes / GiB:.1f} GiB of host RAM fit {host_limit_bytes / GiB:.1f} usable); native "
                f"pinning would lock ~{_size(locked)} per process and the memlock limit is {limit.describe()}"
            )
    return "off", (
        f"deepspeed.pinning=auto: off, unpinned buffers (exact size, slower host copies): native pinning would "
        f"lock ~{_size(locked)} per process and the memlock limit is {limit.describe()}; to pin, {MEMLOCK_FIX}"
    )
