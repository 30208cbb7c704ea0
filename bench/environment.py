"""Where a benchmark finds things and how it runs them: the repository's paths and tiny assets, the offline
environment, command lines (`python -m bench.X`, `accelerate launch`), a CPU result's file, and the library
versions a result records beside its numbers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "llm_train" / "train.py"
ASSETS = REPO / "llm_train" / "assets" / "tiny"
TOKENIZER = ASSETS / "tokenizer"
CORPUS = ASSETS / "corpus.txt"
OFFLINE_ENV = {  # nothing may wait on a network that is not there
    **dict.fromkeys(
        ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "PYTHONUNBUFFERED"), "1"
    ),
    "WANDB_MODE": "disabled",
}


def as_a_training_worker() -> None:
    """The library set-up every training worker makes first (runtime/session.py prepare_libraries).

    For a benchmark that runs DeepSpeed in its own process: with DeepSpeed's default build flags and
    another ninja it would JIT-build the ops again (pin_memory, cpu_adam: minutes on 2 cores), and the
    next training run would rebuild them back (seen in CI: bench.pinning_copy_time's 16 MiB case spent
    its time box building pin_memory). Also skips the unused shm op and quiets library logs.
    """
    from llm_train.runtime.session import prepare_libraries

    prepare_libraries(verbose=False)


def module_cmd(module: str, *args: str) -> list[str]:
    """`python -m bench.X ...`: run from the repository root, bench is a package there."""
    return [sys.executable, "-m", module, *args]


def capped_train(cap_gib: float, host_ram_gib: float | None = None) -> list[str]:
    """train.py under a GPU memory cap (and an emulated host RAM): bench/capped_train.py."""
    host = ["--host-ram-gib", f"{host_ram_gib:g}"] if host_ram_gib else []
    return module_cmd("bench.capped_train", "--gpu-cap-gib", f"{cap_gib:g}", *host)


def accelerate_launch(target: str, *args: str, deepspeed: bool = False) -> list[str]:
    """`accelerate launch` of a script (`llm_train/train.py`) or a module (`bench.overhead`) on 2 CPU
    processes, on its own port (run from the repository root)."""
    from llm_train.runtime.base.launch_env import free_port

    accelerate = Path(sys.executable).with_name("accelerate")
    flags = ["--use_deepspeed"] if deepspeed else []
    port = ["--main_process_port", str(free_port())]
    entry = [target] if target.endswith(".py") else ["-m", target]
    return [str(accelerate), "launch", "--num_processes", "2", *flags, *port, *entry, *args]


def run_or_exit(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run offline from the repository root; a failure ends the benchmark with the command's output tail."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    result = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def write_result(name: str, record: dict[str, Any]) -> Path:
    """bench/results/<name>-<date>.json, for the CPU benchmarks; prints where it went."""
    out = REPO / "bench" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return out


# The libraries a result's numbers depend on, recorded beside them (bench/probe.py records more).
RESULT_LIBRARIES = (
    "torch", "deepspeed", "accelerate", "transformers", "peft", "bitsandbytes", "liger-kernel", "datasets",
    "huggingface-hub", "tokenizers", "safetensors",
)  # fmt: skip
LOCK = REPO / "requirements-lock.txt"


def versions(libraries: tuple[str, ...] = RESULT_LIBRARIES) -> dict[str, str]:
    """Installed versions, read without importing anything (no CUDA context in the harness process)."""
    out = {"python": sys.version.split()[0], "cpus": str(os.cpu_count())}
    for name in libraries:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def not_the_lock(ran: dict[str, str], lock: Path = LOCK) -> dict[str, str]:
    """Each library that ran at another release than requirements-lock.txt's: name -> "ran X, locked Y".

    torch is not in the lock (a GPU machine keeps its CUDA build); a library the lock does not pin is left
    out. On the GPU machine this names what its image imposed where no wheel of the lock's release
    travelled (tools/gpu_wheels/build.sh), so a result says which of its libraries were not the tested set.
    """
    if not lock.is_file():
        return {}
    locked = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", lock.read_text(), re.M))
    locked = {name.lower().replace("_", "-"): version for name, version in locked.items()}
    return {
        name: f"ran {version}, locked {locked[name]}"
        for name, version in ran.items()
        if name in locked and version != locked[name]
    }
