"""Checks before a real run starts, from the planner's own estimate: host RAM, the NVMe directory, the
memlock limit.

Also the dry run's memory rows. A run's start estimates once per process (`estimate_run`): the one
RunEstimate is handed to every check and to the start-up summary, so they read the same numbers, and the
estimate is not made again for each of them (each argument `estimated` takes it; None: made here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llm_train.config import ds_json
from llm_train.config.hardware import HOST_RESERVE_BYTES, host_ram_bytes
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.planning.memory.estimate import MemoryEstimate, estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.pinning import MemlockLimit, choose_auto, memlock_problem
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.search.candidate import CPU_PROCESS_HOST_BYTES, memory_inputs, needs
from llm_train.units import GiB


@dataclass(frozen=True)
class RunEstimate:
    """The planner's estimate of one run on this node: its inputs and the bytes they give."""

    inputs: MemoryInputs
    estimate: MemoryEstimate


def estimate_run(
    run: Resolved, gpus_per_node: int | None = None, known: Sequence[RunEstimate] = ()
) -> RunEstimate | None:
    """The run's estimate (None when the model's shape is not a known family).

    gpus_per_node: processes on this node; default LOCAL_WORLD_SIZE (a worker), else the recipe's hardware.
    known: estimates this process made already (deepspeed.pinning=auto's candidates, the checks'); the one of
    the same inputs is returned as it is (a run refined for its step count keeps its memory), so a run's
    start estimates once per process.
    """
    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return None
    inp = memory_inputs(run, shape, gpus_per_node or _local_processes())
    same = next((k for k in known if k.inputs == inp), None)
    return same or RunEstimate(inp, estimate_memory(inp))


def _local_processes() -> int | None:
    """LOCAL_WORLD_SIZE in a worker (its launcher sets it), else None: the recipe's processes per node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None


# --- host-RAM guard (called by train.py before anything loads) --------------------------------------------


SKIP_RAM_CHECK_FLAG = "--skip-ram-check"


def check_host_ram(run: Resolved, available: int | None = None, estimated: RunEstimate | None = None) -> None:
    """Refuse to start when the planner says this node's host RAM cannot hold the run.

    Better one line now than the OS killing a rank mid-load (offload paths keep optimizer
    states and often the weights in pinned host memory). Skipped, with no estimate, for
    model types the estimator does not know; train.py's --skip-ram-check bypasses it when
    you know better than the estimate (an explicit flag, not an environment switch).
    """
    estimated = estimated or estimate_run(run)
    if estimated is None:
        return
    inp, est = estimated.inputs, estimated.estimate
    kind = "cpu" if run.layout.device == "cpu" else "cuda"
    device, host = needs(est, inp, kind)
    total = host_ram_bytes() if available is None else available
    if host > total:
        parts = {k.replace("_", " "): v for k, v in est.host_terms.items() if k != "process_overhead"}
        # Loading and training do not overlap: the total takes the larger phase, not the sum.
        parts["model load peak (transient)"] = parts.pop("model load peak", 0)
        # The export's gathered 16-bit model (memory.export_peak_bytes: after Adam's moments are freed).
        parts["final export (transient)"] = parts.pop("export peak", 0)
        ranks = inp.ranks_per_node
        if kind == "cpu":
            parts["processes"] = ranks * CPU_PROCESS_HOST_BYTES
            parts["tensors in the processes"] = ranks * device
        else:
            parts["processes"] = est.host_terms["process_overhead"]
        terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if v >= 0.05 * GiB)
        raise UserError(
            f"host RAM: {run.recipe.name} needs ~{host / GiB:.1f} GiB per node (planner: {terms} GiB; "
            f"{inp.ranks_per_node} process(es)), this machine has {total / GiB:.1f} GiB; "
            f"run `llm-train plan --recipe {run.recipe.name}` for options (NVMe offload, LoRA, more nodes), "
            f"or pass {SKIP_RAM_CHECK_FLAG} if you know the estimate is wrong"
        )


def memory_estimate(run: Resolved, gpus_per_node: int | None = None) -> MemoryEstimate | None:
    """The planner's estimate for this run (None when the shape is not a known family).

    The one way a run's memory is estimated: the dry-run table and the NVMe space check
    both read it, so they cannot disagree.
    """
    estimated = estimate_run(run, gpus_per_node)
    return estimated.estimate if estimated else None


def memory_rows(run: Resolved, estimated: RunEstimate | None = None) -> list[tuple[str, str]]:
    """The dry run's (and the start-up summary's) memory estimate, then the NVMe path check when the run
    offloads to nvme.

    A dry run may be prepared on another machine than the one that trains, so a path that
    fails the check is shown here (marked "a real run stops here"), not refused.
    """
    estimated = estimated or estimate_run(run)
    rows = estimated.estimate.table() if estimated else []
    if ds_json.nvme_paths(run.ds_config):
        problems = nvme_problems(run, estimated=estimated)
        paths = ", ".join(sorted(set(ds_json.nvme_paths(run.ds_config).values())))
        rows.append(
            (
                "NVMe path check",
                f"{paths}: ok (exists, writable, enough free space)"
                if not problems
                else f"{problems[0]} (a real run stops here)",
            )
        )
    return rows


# --- pinned host memory: the allocator deepspeed.pinning=auto gets, the memlock limit ---------------------


def auto_pinning(
    run: Resolved,
    limit: MemlockLimit | None = None,
    host_limit_bytes: int | None = None,
    made: list[RunEstimate] | None = None,
) -> tuple[str, str]:
    """What deepspeed.pinning=auto becomes on this machine, and the notice that says why (host_limit_bytes:
    usable host RAM; default this machine's less the OS reserve). made: collects the estimates of the pinnings
    weighed (the chosen one is the run's own: estimate_run takes it as known)."""
    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return (
            "off",
            "deepspeed.pinning=auto: off (the model's shape is unknown, so its locked bytes are too)",
        )
    if host_limit_bytes is None:
        host_limit_bytes = max(0, host_ram_bytes() - HOST_RESERVE_BYTES)
    seen: list[tuple[MemoryInputs, MemoryEstimate]] = []
    choice = choose_auto(
        memory_inputs(run, shape, _local_processes()), run.layout.device, limit, host_limit_bytes, seen
    )
    if made is not None:
        made += [RunEstimate(inputs, estimate) for inputs, estimate in seen]
    return choice


def check_memlock(
    run: Resolved,
    gpus_per_node: int | None = None,
    limit: MemlockLimit | None = None,
    estimated: RunEstimate | None = None,
) -> None:
    """Refuse to start, in one line, when a process would mlock more than its memlock limit allows.

    Native pinning and DeepSpeed's async-I/O buffers are mlocked; past the limit DeepSpeed's allocator
    fails inside the engine's set-up, after the model has loaded (planning/memory/pinning.py).
    """
    estimated = estimated or estimate_run(run, gpus_per_node)
    if estimated is None:
        return
    source = f"NVMe swapping ({run.ds_path.name})"
    problem = memlock_problem(estimated.inputs, source, limit, estimated.estimate.locked_per_rank)
    if problem:
        raise UserError(problem)


# --- the NVMe offload directory, checked before start -----------------------------------------------

# DeepSpeed keeps its swap files under NVME_PATH/zero_stage_3 and replaces them when a run starts
# (partitioned_param_swapper removes its folder; the optimizer swapper rewrites the same files), so
# space held there by an earlier run counts as free.
DS_SWAP_SUBDIR = "zero_stage_3"


def _nvme_key(run: Resolved, section: str) -> str:
    """The setting the user changes to fix the path: the recipe key, or the JSON key it came from."""
    if run.recipe.deepspeed.nvme_path is not None:
        return ds_json.NVME_PATH_KEY
    return f"zero_optimization.{section}.nvme_path in {run.ds_path}"


def _write_error(directory: Path) -> str | None:
    """Why a file cannot be created and removed in `directory` (None when it can).

    A real file rather than os.access(): DeepSpeed will create files here, and access() can say
    yes where that fails (root on a root-squashed NFS mount, a full inode table, a quota).
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".llm_train_write_probe_", dir=directory)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _reclaimable(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory / DS_SWAP_SUBDIR):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def nvme_problems(
    run: Resolved, gpus_per_node: int | None = None, estimated: RunEstimate | None = None
) -> list[str]:
    """One line per problem with the run's NVMe offload directories (empty when all is well).

    Each directory must exist, be a directory, take a new file, and have the free space the
    planner computes for the offloaded states on this node (memory.estimate_memory's nvme_bytes).
    """
    by_path: dict[str, str] = {}
    for section, path in ds_json.nvme_paths(run.ds_config).items():
        by_path.setdefault(path, section)
    problems: list[str] = []
    free_by_device: dict[int, int] = {}
    for path, section in by_path.items():
        key = _nvme_key(run, section)
        directory = Path(path).expanduser()
        if not directory.exists():
            problems.append(
                f"{key}={path}: does not exist; create it on a local NVMe drive (mkdir -p {path}) or point "
                f"{key} at an existing directory"
            )
        elif not directory.is_dir():
            problems.append(
                f"{key}={path}: is not a directory; point {key} at a directory on a local NVMe drive"
            )
        elif (error := _write_error(directory)) is not None:
            problems.append(
                f"{key}={path}: cannot create files there ({error}); give this user write access "
                f"(chown/chmod) or point {key} at a writable directory"
            )
        else:
            device = os.stat(directory).st_dev
            free = shutil.disk_usage(directory).free + _reclaimable(directory)
            # Two paths on one filesystem share its free space: count it once.
            free_by_device[device] = max(free_by_device.get(device, 0), free)
    if problems or not free_by_device:
        return problems
    estimated = estimated or estimate_run(run, gpus_per_node)
    need = estimated.estimate.nvme_bytes if estimated else 0
    free = sum(free_by_device.values())
    if need > free:
        key = _nvme_key(run, next(iter(by_path.values())))
        problems.append(
            f"{key}={', '.join(by_path)}: {free / GiB:.1f} GiB free, but the offloaded states need "
            f"~{need / GiB:.1f} GiB on this node (planner estimate, `llm-train plan --recipe {run.recipe.name}`); "
            f"free space there or point {key} at a larger drive"
        )
    return problems


def check_nvme_path(
    run: Resolved, gpus_per_node: int | None = None, estimated: RunEstimate | None = None
) -> None:
    """Refuse to start, in one line, when an NVMe offload directory is missing, read-only or too small.

    Called by the process that validates a real run before workers or weights exist; DeepSpeed
    itself would fail minutes later, after loading the model, with an aio error or a full disk.
    `gpus_per_node` defaults like the host-RAM check: LOCAL_WORLD_SIZE, else the recipe's hardware.
    """
    problems = nvme_problems(run, gpus_per_node, estimated)
    if problems:
        raise UserError(problems[0])
