"""Make every launch command end in the same distributed world.

The product promise is that `accelerate launch llm_train/train.py ...` works with no
accelerate config and no extra flags, and that `python llm_train/train.py ...` works as
one process. Three situations reach the entry point:

1. A launcher already created the world (accelerate's torchrun-based launchers on GPUs or
   with --use_deepspeed, `deepspeed`, `torchrun`, srun + accelerate): RANK and WORLD_SIZE
   are set; nothing to do.
2. `accelerate launch --num_processes N` on a machine without GPUs and without
   --use_deepspeed: accelerate's "simple" launcher runs the script *once* and expects it
   to bring its own workers (it would normally be mpirun). We read the launch arguments
   with accelerate's own parser and start the N local workers ourselves.
3. Plain `python`: a world of one, on a free local port.

Workers are told to use DeepSpeed through ACCELERATE_USE_DEEPSPEED, which is what
`accelerate launch --use_deepspeed` would have set; without it Accelerate does not
initialise DeepSpeed's process group ("Default process group has not been initialized").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

SPAWNED_ENV = "LLM_TRAIN_SPAWNED"


@dataclass(frozen=True)
class LocalWorld:
    """The workers this process must start on this machine."""

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def world_from_env() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accelerate_launch_args() -> list[str] | None:
    """The arguments of the `accelerate launch` process that started us, if it did."""
    try:
        import psutil

        cmdline = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no psutil or no permission: behave as a plain single process
        return None
    for i, part in enumerate(cmdline[:-1]):
        if os.path.basename(part).startswith("accelerate") and cmdline[i + 1] == "launch":
            return cmdline[i + 2 :]
    return None


def world_from_accelerate_parent() -> LocalWorld | None:
    """The world `accelerate launch` asked for when it left starting the workers to us."""
    if os.environ.get(SPAWNED_ENV) or world_from_env() is not None:
        return None
    args = _accelerate_launch_args()
    if args is None:
        return None
    import logging

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parsed, _ = launch_command_parser().parse_known_args(args)
    # It logs its "values were not passed" warning again; accelerate launch already printed it.
    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)
    try:
        parsed, _, _ = _validate_launch_command(parsed)  # applies the accelerate config file, if any
    finally:
        launch_logger.setLevel(level)
    total = int(parsed.num_processes or 1)
    nnodes = int(parsed.num_machines or 1)
    if total <= 1 and nnodes <= 1:
        return None
    return LocalWorld(
        nproc_per_node=max(1, total // nnodes),
        nnodes=nnodes,
        node_rank=int(parsed.machine_rank or 0),
        master_addr=os.environ.get("MASTER_ADDR") or parsed.main_process_ip or "127.0.0.1",
        master_port=int(os.environ.get("MASTER_PORT") or parsed.main_process_port or 29500),
    )


def set_single_process_env() -> None:
    """A world of one for `python llm_train/train.py` (DeepSpeed still wants a process group)."""
    if world_from_env() is not None:
        return
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
        }
    )


def use_deepspeed_in_accelerate() -> None:
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"


PIN_BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"


def use_pin_memory_backend(pinning: str) -> None:
    """DeepSpeed's pinned-buffer allocator for deepspeed.pinning (planning/pinning.py).

    DeepSpeed reads DS_PIN_MEMORY_BACKEND at every pin (deepspeed/utils/pin_memory.py): 'native' mlocks
    the exact size, anything else pins through torch. The recipe decides, so a value left in the
    environment never switches the allocator behind the planner's back (train.py says so once).
    """
    os.environ[PIN_BACKEND_ENV] = "native" if pinning == "native" else "torch"


def worker_env(world: LocalWorld, local_rank: int) -> dict[str, str]:
    """What torchrun tells the worker of `local_rank` on this node (added to the parent's environment)."""
    return {
        SPAWNED_ENV: "1",
        "RANK": str(world.node_rank * world.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(world.nproc_per_node),
        "GROUP_RANK": str(world.node_rank),
        "MASTER_ADDR": world.master_addr,
        "MASTER_PORT": str(world.master_port),
        # Two workers on two cores: one thread each, or they fight over the cores.
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world.nproc_per_node))
        ),
    }


def spawn_workers(world: LocalWorld, argv: list[str]) -> int:
    """Start this node's workers, forward stop signals, return the first failing exit code (or 0)."""
    procs = [
        subprocess.Popen([sys.executable, *argv], env={**os.environ, **worker_env(world, local_rank)})
        for local_rank in range(world.nproc_per_node)
    ]
    return supervise(procs)


class WorkerProcess(Protocol):
    """What supervise needs of a worker: subprocess.Popen's poll, send_signal, terminate and returncode."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...


def supervise(procs: Sequence[WorkerProcess]) -> int:
    """Forward stop signals to the workers until all have ended; the first failing exit code (or 0)."""

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)

    exit_code = 0
    while any(proc.poll() is None for proc in procs):
        failed = [proc.returncode for proc in procs if proc.returncode]  # None: running, 0: done
        if failed and exit_code == 0:
            exit_code = failed[0]
            # One worker failed: the others would wait forever in a collective.
            time.sleep(2.0)
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        time.sleep(0.2)
    if exit_code == 0:
        exit_code = next((proc.returncode for proc in procs if proc.returncode), 0)
    return exit_code


def record_error(message: str) -> None:
    """Leave `message` where torchrun's failure report looks for a worker's error, if it asked.

    torchrun (accelerate's launcher on GPUs and with --use_deepspeed) gives every worker a
    TORCHELASTIC_ERROR_FILE; its report then shows this line as the failure's cause instead of
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html". The report and
    accelerate's traceback around it remain: only `llm-train train` can leave them out.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump({"message": message, "timestamp": int(time.time())}, fp)
    except OSError:
        pass  # the report falls back to its generic line; the error itself is already printed
