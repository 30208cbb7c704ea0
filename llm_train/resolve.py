"""Recipe + DeepSpeed JSON + world size -> one fully resolved, validated run description.

This is everything that can be decided without importing torch or touching weights, so
the same function serves the dry run, the parent of a local multi-process launch (which
validates before starting workers) and every worker. What depends on the machine that
trains (the NVMe offload directory: exists, writable, free space) is checked separately, by
`check_nvme_path`, so a dry run or a plan made elsewhere still resolves.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train import dsconfig
from llm_train.errors import UserError
from llm_train.parallel import check_parallel
from llm_train.plan import Device, ParallelPlan, make_plan
from llm_train.recipe import Recipe, load_recipe, recipe_to_yaml

if TYPE_CHECKING:
    from llm_train.memory import MemoryEstimate

GiB = 1024**3


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    ds_path: Path
    ds_config: dict[str, Any]  # no "auto" left
    plan: ParallelPlan
    hidden_size: int
    model_fields: dict[str, Any]  # the HF config fields the shape came from
    notice: str | None

    def recipe_yaml(self) -> str:
        return recipe_to_yaml(self.recipe)

    def ds_json(self) -> str:
        return json.dumps(self.ds_config, indent=2)


def model_fields(recipe: Recipe) -> dict[str, Any]:
    """The model's config fields, known without downloading anything when possible."""
    from llm_train.shapes import KNOWN_CONFIGS

    fields: dict[str, Any] = {}
    name = recipe.model.name_or_path
    if name:
        local = Path(name) / "config.json"
        if local.is_file():
            fields = json.loads(local.read_text())
        elif name in KNOWN_CONFIGS:
            fields = dict(KNOWN_CONFIGS[name])
        elif recipe.model.init == "random" and not recipe.model.config:
            raise UserError(
                f"model.name_or_path={name}: shape unknown offline; give a local directory with config.json"
            )
    fields.update(recipe.model.config)
    return fields


def resolve_run(
    recipe_name: str,
    overrides: list[str],
    world_size: int,
    device: Device | None = None,
    ds_config_path: str | None = None,
    max_steps: int | None = None,
    output_dir: str | None = None,
) -> Resolved:
    extra = list(overrides)
    if max_steps is not None:
        extra.append(f"optim.max_steps={max_steps}")
    if output_dir is not None:
        extra.append(f"output.dir={Path(output_dir).resolve()}")
    if ds_config_path is not None:
        extra.append(
            f"deepspeed.config={Path(ds_config_path).resolve() if Path(ds_config_path).exists() else ds_config_path}"
        )
    recipe = load_recipe(recipe_name, extra)
    device = device or Device.declared(recipe)
    ds_path, raw = dsconfig.load_ds_config(recipe.deepspeed.config)
    plan, notice = make_plan(recipe, raw, world_size, device)
    fields = model_fields(recipe)
    check_parallel(plan, recipe, fields, str(ds_path))  # tp/pp against the model and DeepSpeed
    hidden = int(fields.get("hidden_size") or fields.get("n_embd") or fields.get("d_model") or 0)
    if hidden <= 0:
        # Only bucket sizes need it; a user model with an exotic config still trains.
        hidden = 4096
    values = dsconfig.RecipeValues(
        micro_batch_size=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        global_batch_size=plan.global_batch_size,
        grad_clip=recipe.optim.grad_clip,
        precision=plan.precision,
        hidden_size=hidden,
        lr=recipe.optim.lr,
        betas=recipe.optim.betas,
        eps=recipe.optim.eps,
        weight_decay=recipe.optim.weight_decay,
        warmup_steps=recipe.optim.warmup_steps,
        max_steps=recipe.optim.max_steps or 0,
        nvme_path=recipe.deepspeed.nvme_path,
    )
    resolved = dsconfig.resolve(raw, values, str(ds_path))
    if plan.tp > 1:
        # Under AutoTP DeepSpeed asserts train_batch = micro x accum x *all* ranks (it is given no
        # mpu, so TP replicas count); the recipe's global batch counts distinct sequences.
        resolved["train_batch_size"] = plan.global_batch_size * plan.tp
        # Export gathers the TP shards through this switch (accelerate.get_state_dict refuses without it).
        resolved.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    return Resolved(recipe, ds_path, resolved, plan, hidden, fields, notice)


def steps_for_epochs(epochs: float, micro_batches_per_epoch: int, grad_accum: int) -> int:
    return max(1, math.ceil(epochs * micro_batches_per_epoch / grad_accum))


def memory_estimate(run: Resolved, gpus_per_node: int | None = None) -> MemoryEstimate | None:
    """The planner's estimate for this run (None when the shape is not a known family).

    The one way a run's memory is estimated: the dry-run table and the NVMe space check
    both read it, so they cannot disagree.
    """
    from llm_train.memory import estimate_memory
    from llm_train.planner import memory_inputs
    from llm_train.shapes import shape_from_config

    try:
        shape = shape_from_config(run.model_fields)
    except UserError:
        return None
    return estimate_memory(memory_inputs(run, shape, gpus_per_node))


def memory_rows(run: Resolved) -> list[tuple[str, str]]:
    """The dry run's memory estimate, then the NVMe path check when the run offloads to nvme.

    A dry run may be prepared on another machine than the one that trains, so a path that
    fails the check is shown here (marked "a real run stops here"), not refused.
    """
    estimate = memory_estimate(run)
    rows = estimate.table() if estimate else []
    if dsconfig.nvme_paths(run.ds_config):
        problems = nvme_problems(run)
        paths = ", ".join(sorted(set(dsconfig.nvme_paths(run.ds_config).values())))
        rows.append(
            (
                "NVMe path check",
                f"{paths}: ok (exists, writable, enough free space)"
                if not problems
                else f"{problems[0]} (a real run stops here)",
            )
        )
    return rows


# --- the NVMe offload directory, checked before start -----------------------------------------------

# DeepSpeed keeps its swap files under NVME_PATH/zero_stage_3 and replaces them when a run starts
# (partitioned_param_swapper removes its folder; the optimizer swapper rewrites the same files), so
# space held there by an earlier run counts as free.
DS_SWAP_SUBDIR = "zero_stage_3"


def _nvme_key(run: Resolved, section: str) -> str:
    """The setting the user changes to fix the path: the recipe key, or the JSON key it came from."""
    if run.recipe.deepspeed.nvme_path is not None:
        return dsconfig.NVME_PATH_KEY
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


def nvme_problems(run: Resolved, gpus_per_node: int | None = None) -> list[str]:
    """One line per problem with the run's NVMe offload directories (empty when all is well).

    Each directory must exist, be a directory, take a new file, and have the free space the
    planner computes for the offloaded states on this node (memory.estimate_memory's nvme_bytes).
    """
    by_path: dict[str, str] = {}
    for section, path in dsconfig.nvme_paths(run.ds_config).items():
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
    estimate = memory_estimate(run, gpus_per_node)
    need = estimate.nvme_bytes if estimate else 0
    free = sum(free_by_device.values())
    if need > free:
        key = _nvme_key(run, next(iter(by_path.values())))
        problems.append(
            f"{key}={', '.join(by_path)}: {free / GiB:.1f} GiB free, but the offloaded states need "
            f"~{need / GiB:.1f} GiB on this node (planner estimate, `llm-train plan --recipe {run.recipe.name}`); "
            f"free space there or point {key} at a larger drive"
        )
    return problems


def check_nvme_path(run: Resolved, gpus_per_node: int | None = None) -> None:
    """Refuse to start, in one line, when an NVMe offload directory is missing, read-only or too small.

    Called by the process that validates a real run before workers or weights exist; DeepSpeed
    itself would fail minutes later, after loading the model, with an aio error or a full disk.
    `gpus_per_node` defaults like the host-RAM check: LOCAL_WORLD_SIZE, else the recipe's hardware.
    """
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None
    problems = nvme_problems(run, gpus_per_node)
    if problems:
        raise UserError(problems[0])
