"""What a checkpoint of a training run holds, and how a run resumes from one.

DeepSpeed's engine checkpoint carries the model, optimizer and LR schedule; next to it
each rank writes a small JSON file (no pickle) with the step, its data position and its
RNG states, and rank 0 writes the HF config and tokenizer so an export needs nothing else.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from llm_train.config.layout import Layout
from llm_train.config.recipe import Recipe, recipe_to_yaml
from llm_train.errors import UserError
from llm_train.runtime.checkpoint import (
    CHECKPOINT_REFERENCE,
    DS_TAG,
    Checkpointer,
    SaveMeta,
    committed,
    dir_size,
    reseed,
    resumable_candidates,
    rng_state,
    set_rng_state,
    trainer_state_path,
    verify_shared,
)
from llm_train.runtime.collectives import Collectives
from llm_train.runtime.export import write_reference_file
from llm_train.runtime.file_sync import FileSync
from llm_train.runtime.resume_layout import ResumeLayout
from llm_train.runtime.universal import ensure_universal, universal_dir


def recipe_hash(recipe: Recipe) -> str:
    """What was trained, how: output location, checkpoint cadence and tracking do not count."""
    what = recipe.model_dump(mode="json", exclude={"output", "checkpoint", "tracking"})
    what["optim"].pop("grad_accum")  # the batch is compared on its own, through the layout (resume_layout.py)
    what["deepspeed"].pop("timeout_minutes")  # how long ranks wait for each other: not what is trained
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_bytes_estimate(engine: Any, root: Path) -> int:
    """The size of the previous checkpoint, or 16 bytes per parameter (fp32 weights + Adam m, v + slack)."""
    previous = committed(root)
    if previous:
        converted = universal_dir(previous[0])  # a resume's universal copy is not part of the next save
        return dir_size(previous[0]) - (dir_size(converted) if converted.is_dir() else 0)
    # Frozen weights (a LoRA base) are not saved (save_run_state).
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    return 16 * numel


def save_run_state(
    checkpointer: Checkpointer,
    engine: Any,
    step: int,
    stream: Any,
    tokenizer: Any,
    rank: int,
    layout: Layout,
    recipe: Recipe,
    extra: dict[str, Any],
    reference: tuple[Any, Any] | None = None,
) -> Path:
    """Commit a checkpoint; `reference`: (input ids, logits) of the live model on the export check's batch."""

    def write(tmp: Path) -> None:
        # LoRA: the frozen base is the one the run loads from model.name_or_path (seeded or
        # pretrained, identical at every start), so only the adapters and their optimizer are saved:
        # no 16-bit copy of the whole model through host RAM at every checkpoint (15 GiB for an 8B).
        engine.save_checkpoint(
            str(tmp / "state"),
            tag=DS_TAG,
            save_latest=False,
            exclude_frozen_parameters=recipe.lora is not None,
        )
        state_file = trainer_state_path(tmp, rank)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "data": stream.state_dict(), "rng": rng_state(), **extra}
        state_file.write_text(json.dumps(state))
        if rank == 0:
            engine.module.config.save_pretrained(tmp / "hf")
            tokenizer.save_pretrained(tmp / "hf")
            (tmp / "hf" / "recipe.yaml").write_text(recipe_to_yaml(recipe))
            if reference is not None:
                write_reference_file(tmp / CHECKPOINT_REFERENCE, *reference)

    meta = SaveMeta(
        step, layout.world_size, recipe_hash(recipe), engine.zero_optimization_stage(), layout.as_dict()
    )
    return checkpointer.save(meta, write, checkpoint_bytes_estimate(engine, checkpointer.root))


def make_saver(
    checkpointer: Checkpointer,
    control: Any,
    engine: Any,
    stream: Any,
    tokenizer: Any,
    rank: int,
    layout: Layout,
    recipe: Recipe,
    tracker: Any,
    say: Any,
    reference: Any = None,
) -> Any:
    """The `save(step)` the training loops call: commit a checkpoint, reset the time cadence, report.

    `reference()`, called on every rank before each save, gives the live model's logits on the
    export check's batch (a forward of 16 tokens: the collective a ZeRO-3 forward is).
    """

    def save(step: int) -> None:
        started = time.perf_counter()
        extra = {"tracker_run_id": tracker.run_id}  # W&B continues the same run after a resume
        logits = reference() if reference is not None else None
        path = save_run_state(
            checkpointer, engine, step, stream, tokenizer, rank, layout, recipe, extra, logits
        )
        control.saved()
        say(f"checkpoint {path.name} committed in {time.perf_counter() - started:.1f}s")

    return save


def choose_checkpoint(
    spec: str, root: Path, rank: int, comm: Collectives, warn: Any, patience_s: float = 1800.0
) -> Path | None:
    """The verified checkpoint to resume, the same on every rank (or the same error on every rank).

    Rank 0 names the candidates (`latest` first, then older ones; for a path, that one); every
    rank verifies its share of each candidate's files (checkpoint.verify_shared), so no rank
    hashes the whole checkpoint while the others wait, and none waits inside a collective.
    """
    named = [str(c) for c in resumable_candidates(root)] if spec == "auto" else [spec]
    candidates = comm.from_rank0(named if rank == 0 else None)
    if not candidates:
        return None
    sync = FileSync.open(root, "resume", comm, rank, patience_s)
    for i, candidate in enumerate(map(Path, candidates)):
        reason = verify_shared(candidate, sync, f"verify{i}") if candidate.is_dir() else "not a directory"
        if reason is None:
            return candidate
        if spec != "auto":
            raise UserError(
                f"--resume {spec}: {reason}; pass --resume auto to pick the newest complete checkpoint"
            )
        if rank == 0:
            warn(f"warning: skipping checkpoint {candidate}: {reason}")
    return None


def convert_for_resume(
    chosen: Path, root: Path, rank: int, comm: Collectives, patience_s: float, say: Any
) -> None:
    """Rank 0 converts `chosen` to the universal format (once); the other ranks wait for it through a file.

    A 70B conversion takes about an hour (planning/checkpoint_cost.py): far beyond any
    process-group timeout, so the others must not wait inside a collective (runtime/file_sync.py).
    A copy already there is verified by all ranks, a share each.
    """
    sync = FileSync.open(root, "convert", comm, rank, patience_s)
    existing = universal_dir(chosen)  # made by an earlier resume or `llm-train convert`
    if existing.is_dir() and verify_shared(existing, sync, "verify") is None:
        return  # verified in shares by every rank: nothing to convert
    if rank == 0:
        error = None
        with sync.working():
            try:
                ensure_universal(chosen, say)
            except (UserError, OSError) as exc:
                error = str(exc)
        sync.post("outcome", error)
    if error := sync.wait("outcome", [0], f"universal conversion of {chosen.name}")[0]:
        raise UserError(error)


def check_recipe(ckpt: Path, manifest: dict[str, Any], recipe: Recipe, warn: Any) -> None:
    if manifest["recipe_hash"] != recipe_hash(recipe):
        warn(
            f"notice: the recipe differs from the one checkpoint {ckpt.name} was written with; resuming anyway"
        )


def read_data_state(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's data position: the global count of sequences consumed, the same in every rank's file."""
    return json.loads(trainer_state_path(ckpt, 0).read_text())["data"]


def restore_run_state(
    engine: Any,
    ckpt: Path,
    stream: Any,
    rank: int,
    plan: ResumeLayout,
    seed: int,
    allow_data_revision_change: bool = False,
) -> dict[str, Any]:
    """Load the engine state and the trainer state; returns the trainer state (step, data, tracker id).

    On the layout that wrote the checkpoint every rank restores its own RNG states. On
    another layout a rank may have had no predecessor, so every rank reseeds its RNGs from
    (seed, step, rank); the data order is not an RNG stream (data/stream.py) and carries
    over exactly, as does everything in the DeepSpeed state (weights, Adam, LR schedule, step).
    """
    # DeepSpeed's shards are pickles: `ckpt` (and its universal copy) verified against a manifest.
    load_dir = universal_dir(ckpt) if plan.universal else ckpt / "state"
    # A LoRA checkpoint holds the adapters only (save_run_state): the base already loaded stays.
    frozen_left_out = any(not p.requires_grad for p in engine.module.parameters())
    engine.load_checkpoint(
        str(load_dir),
        tag=DS_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not frozen_left_out,
    )
    # The data position is the global count of sequences consumed, the same in every rank's file.
    state = json.loads(trainer_state_path(ckpt, rank if plan.same_layout else 0).read_text())
    stream.load_state_dict(state["data"], allow_data_revision_change)
    if plan.same_layout:
        set_rng_state(state["rng"])
    else:
        reseed(seed, state["step"], rank)
    return state


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint: the resumed run logs those steps again."""
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    path.write_text("".join(line + "\n" for line in keep))
