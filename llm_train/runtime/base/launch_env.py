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

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llm_train.config.accelerate_launch import ENV as ACCELERATE_ENV
from llm_train.config.accelerate_launch import FIELDS, AccelerateLaunch

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


def read_accelerate_launch(args: list[str]) -> tuple[Any, AccelerateLaunch]:
    """Accelerate's own reading of an `accelerate launch` command line: its flags and config file.

    Returns accelerate's parsed namespace (every value merged, as its launcher sees them) and the
    what-fields llm_train reconciles with the recipe (config/accelerate_launch.py), each with its
    origin. Raises accelerate's ValueError for a config or flags accelerate itself would refuse.
    """
    import logging

    import yaml
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parsed, _ = launch_command_parser().parse_known_args(args)
    flags = set(getattr(parsed, "nondefault", ()))  # accelerate records the options given on the line
    # Which file accelerate reads: --config_file, else its default one unless --cpu (launch.py, 1.15).
    path = parsed.config_file or (
        default_config_file if os.path.isfile(default_config_file) and not parsed.cpu else None
    )
    raw = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}) if path else {}
    # It logs its "values were not passed" warning again; accelerate launch already printed it.
    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)
    try:
        parsed, defaults, _ = _validate_launch_command(parsed)  # applies the config file, if any
    finally:
        launch_logger.setLevel(level)
    # The wizard writes `mixed_precision: null` beside a deepspeed_config_file: not a setting.
    in_file = {k for k, v in (raw.get("deepspeed_config") or {}).items() if v is not None}
    in_file |= {"mixed_precision"} if raw.get("mixed_precision") is not None else set()
    # The wizard writes torch.compile's settings as `dynamo_config: {dynamo_backend: INDUCTOR, ...}`.
    in_file |= {"dynamo_backend"} if (raw.get("dynamo_config") or {}).get("dynamo_backend") else set()
    values, origins = {}, {}
    for name in FIELDS:
        value = getattr(parsed, name, None)
        if value is None or not (name in flags or name in in_file):
            continue
        values[name] = str(value)
        origins[name] = f"accelerate launch --{name}" if name in flags else f"accelerate config {path}"
    return parsed, AccelerateLaunch(
        kind=_launch_kind(parsed, defaults),
        values=values,
        origins=origins,
        mpirun=getattr(parsed, "mpirun_hostfile", None) is not None,
    )


def _launch_kind(parsed: Any, defaults: Any) -> str:
    """The launcher `accelerate launch` picks (its launch_command's order, 1.15), as a DistributedType name."""
    if defaults is not None and str(defaults.compute_environment).endswith("AMAZON_SAGEMAKER"):
        return "SAGEMAKER"
    for flag, kind in (
        ("use_deepspeed", "DEEPSPEED"),
        ("use_fsdp", "FSDP"),
        ("use_megatron_lm", "MEGATRON_LM"),
        ("multi_gpu", "MULTI_GPU"),
        ("tpu", "XLA"),
    ):
        if getattr(parsed, flag, False) and not parsed.cpu:
            return kind
    # The simple launcher: one process, or (on CPU) the workers llm_train starts itself.
    return "MULTI_CPU" if int(parsed.num_processes or 1) > 1 or int(parsed.num_machines or 1) > 1 else "NO"


@functools.cache
def _from_accelerate_parent() -> tuple[Any, AccelerateLaunch] | None:
    args = _accelerate_launch_args()
    return None if args is None else read_accelerate_launch(args)


def accelerate_launch() -> AccelerateLaunch | None:
    """What the `accelerate launch` that started this run says about it (None: not started by one).

    Workers that llm_train started itself read it from the first process (ENV), whose parent was
    the launcher; under torchrun each worker's parent is the `accelerate launch` process itself.
    """
    if text := os.environ.get(ACCELERATE_ENV):
        return AccelerateLaunch.from_json(text)
    found = _from_accelerate_parent()
    return None if found is None else found[1]


def world_from_accelerate_parent() -> LocalWorld | None:
    """The world `accelerate launch` asked for when it left starting the workers to us."""
    if os.environ.get(SPAWNED_ENV) or world_from_env() is not None:
        return None
    found = _from_accelerate_parent()
    if found is None:
        return None
    parsed = found[0]
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


# What accelerate's launchers leave in the environment for the Accelerator to read (accelerate 1.15
# utils/launch.py). Each was reconciled with the recipe before the run was resolved
# (config/accelerate_launch.py), and the recipe's values reach Accelerate explicitly; these copies
# must not act behind them: ACCELERATE_USE_CPU (a MULTI_CPU config) makes Accelerate skip DeepSpeed's
# process group, so DeepSpeed counts a world of 1 and refuses the batch ("16 != 8 * 1 * 1");
# ACCELERATE_CONFIG_DS_FIELDS beside our DS JSON fails Accelerate's "will be ignored" check.
_ACCELERATE_WHAT_ENV = (
    "ACCELERATE_USE_CPU",
    "ACCELERATE_CONFIG_DS_FIELDS",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_GRADIENT_CLIPPING",
    "ACCELERATE_MIXED_PRECISION",
)
# zero stage, offload, config file, zero3 init, ...; torch.compile's backend, mode and graph switches.
_ACCELERATE_WHAT_PREFIX = ("ACCELERATE_DEEPSPEED_", "ACCELERATE_DYNAMO_")


def use_deepspeed_in_accelerate() -> None:
    """Accelerate drives DeepSpeed with the recipe's settings, and with nothing its launcher left behind."""
    for key in [k for k in os.environ if k in _ACCELERATE_WHAT_ENV or k.startswith(_ACCELERATE_WHAT_PREFIX)]:
        del os.environ[key]
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"


PIN_BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"


def use_pin_memory_backend(pinning: str) -> None:
    """DeepSpeed's pinned-buffer allocator for deepspeed.pinning (planning/memory/pinning.py).

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
