"""A run's state across a restart: what a checkpoint holds beside DeepSpeed's, and how a run resumes.

DeepSpeed's engine checkpoint carries the model, optimizer and LR schedule; next to it each
rank writes a small JSON file (no pickle) with the step, its data position, its RNG states and
the tracker's run id, and rank 0 writes the HF config and tokenizer so an export needs nothing
else. How a checkpoint directory is committed, verified and listed is runtime/checkpointing/commit.py's
job; this module decides what goes in and what comes back out.

A resume happens in three steps, each once:

1. `plan_resume`, before any worker starts (train.py `check_before_start`, in the launching
   process and again in each worker): the checkpoint a resume will most likely use is read
   without verifying it, and its layout is compared with this launch's (`bridge`). What cannot
   be bridged is refused in one line; a kept global batch gives the accumulation the run is
   refined with (config/resolution.py `Resolved.refine`) before the data and the engine exist.
2. `open_resume`, once the world exists and before the model is built: every rank verifies its
   share of the checkpoint; a fallback to an older one must need the same bridge; the
   universal copy is made when the layout changed; the data position is checked against the
   stream.
3. `restore_run_state`, once the engine is built: DeepSpeed's state, the data position, the RNGs.

The rules that compare layouts (`bridge`):

- nothing that shards the state changed: DeepSpeed loads its own checkpoint as usual;
- the data-parallel size, tensor-parallel degree, ZeRO stage or offload changed: the
  checkpoint is converted once to DeepSpeed's universal format (runtime/checkpointing/universal.py) and
  loaded from there;
- the global batch would change: the gradient accumulation is adjusted to keep it (one
  notice), or, with --allow-batch-change, the new batch is used on purpose;
- what DeepSpeed cannot convert (pipeline stages; ZeRO-0 to or from a ZeRO stage, or in another
  precision; ZeRO-3 to or from ZeRO-1/2) and what is not verified (another sequence-parallel
  degree) is refused in one line that says what changed and what is possible.

The data position needs nothing: it counts sequences consumed by all ranks together
(data/stream.py), so the new data-parallel ranks are dealt the rest of the epoch exactly once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config.layout import Layout
from llm_train.config.recipe import Recipe, recipe_to_yaml
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.runtime import collectives
from llm_train.runtime.checkpointing.commit import (
    CHECKPOINT_REFERENCE,
    DS_TAG,
    LATEST,
    Checkpointer,
    SaveMeta,
    committed,
    dir_size,
    read_manifest,
    resumable_candidates,
    verify_shared,
)
from llm_train.runtime.checkpointing.file_sync import FileSync
from llm_train.runtime.checkpointing.master_digest import DIGEST_KEY, live_master_digest
from llm_train.runtime.checkpointing.universal import ensure_universal, universal_dir
from llm_train.runtime.collectives import Collectives
from llm_train.runtime.compat import load_engine_checkpoint
from llm_train.runtime.control import RunControl
from llm_train.runtime.export import write_reference_file

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.stream import BatchStream
    from llm_train.data.streaming import StreamingBatches
    from llm_train.observability.tracking import Trackers

    Stream = BatchStream | StreamingBatches

Say = Callable[[str], None]

# ------------------------------------------------------------ per-rank trainer state


def trainer_state_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "trainer" / f"rank{rank:05d}.json"


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states as JSON (loaded without pickle)."""
    import random

    import numpy as np
    import torch

    # The legacy tuple form (numpy types get_state() as that tuple or a dict, by its `legacy` flag).
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    state: dict[str, Any] = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        # This rank's device only: get_rng_state_all() would create a CUDA context on every GPU
        # of the node from every rank (hundreds of MiB each, on GPUs other ranks are filling).
        state["cuda_device"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8))


def reseed(seed: int, step: int, rank: int) -> None:
    """Python, NumPy and torch RNGs from (seed, step, rank): a resumed rank with no saved state of its own."""
    import random

    import numpy as np
    import torch

    mixed = int(np.random.SeedSequence([seed & 0xFFFF_FFFF, step, rank]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)  # seeds the CUDA generators too


def recipe_hash(recipe: Recipe) -> str:
    """What was trained, how: output location, checkpoint cadence and tracking do not count."""
    what = recipe.model_dump(mode="json", exclude={"output", "checkpoint", "tracking"})
    what["optim"].pop("grad_accum")  # the batch is compared on its own, through the layout (`bridge`)
    what["deepspeed"].pop("timeout_minutes")  # how long ranks wait for each other: not what is trained
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------ saving


def checkpoint_bytes_estimate(engine: DeepSpeedEngine, root: Path) -> int:
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
    engine: DeepSpeedEngine,
    step: int,
    stream: Stream,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    layout: Layout,
    recipe: Recipe,
    extra: dict[str, Any],
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        # The fp32 masters as this rank holds them, for the export's stale-shard check (master_digest.py).
        digest = live_master_digest(engine.optimizer, layout.offload_optimizer == "nvme")
        state = {"step": step, "data": stream.state_dict(), "rng": rng_state(), DIGEST_KEY: digest, **extra}
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
    control: RunControl,
    engine: DeepSpeedEngine,
    stream: Stream,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    layout: Layout,
    recipe: Recipe,
    tracker: Trackers,
    say: Say,
    reference: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Callable[[int], None]:
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


# ------------------------------------------------------------ the plan: layouts compared, once, before start

# Fields whose change re-partitions the saved optimizer state: the universal format handles them.
# Precision is among them: the universal loader rebuilds the 16-bit weights from the fp32 master copy.
_SHARDING = ("world_size", "tp", "zero_stage", "offload_optimizer", "offload_params", "precision")
_NAMES = {
    "world_size": "world size",
    "dp": "data-parallel size",
    "tp": "tensor-parallel degree",
    "sp": "sequence-parallel degree",
    "pp": "pipeline stages",
    "zero_stage": "ZeRO stage",
    "offload_optimizer": "optimizer offload",
    "offload_params": "parameter offload",
    "precision": "precision",
}


@dataclass(frozen=True)
class ResumeLayout:
    """How this launch resumes a checkpoint written with another (or the same) layout: the bridge."""

    changes: tuple[str, ...] = ()  # e.g. "data-parallel size 2 -> 1"
    universal: bool = False  # load through DeepSpeed's universal checkpoint
    grad_accum: int | None = None  # the accumulation that keeps the checkpoint's global batch
    notices: tuple[str, ...] = ()

    @property
    def same_layout(self) -> bool:
        return not self.changes


def saved_layout(manifest: dict[str, Any]) -> dict[str, Any]:
    """The layout a checkpoint was written with (older manifests recorded only world and stage)."""
    return manifest.get("layout") or {
        "world_size": manifest["world_size"],
        "zero_stage": manifest["zero_stage"],
    }


def _peek(spec: str, root: Path) -> tuple[Path, dict[str, Any]] | None:
    if spec == "auto":
        latest = root / LATEST
        newest = committed(root)[:1]
        candidate = root / latest.read_text().strip() if latest.is_file() else (newest[0] if newest else None)
    else:
        candidate = Path(spec)
    if candidate is None:
        return None
    try:
        return candidate, read_manifest(candidate)
    except (OSError, ValueError):
        return None  # no or a damaged manifest: verification will pick another checkpoint, or none


def peek_manifest(spec: str, root: Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint a resume will most likely use, read without verifying it.

    The batch and the DeepSpeed config must be settled before the engine exists, which is
    before the checkpoint is verified (that needs the process group); the verified choice is
    compared again afterwards (`open_resume`).
    """
    peeked = _peek(spec, root)
    return None if peeked is None else peeked[1]


def bridge(saved: dict[str, Any], now: Layout, allow_batch_change: bool) -> ResumeLayout:
    """Compare the saved layout with this launch's; raise UserError for a change that cannot be bridged."""
    current = now.as_dict()
    saved = {"sp": 1, **saved}  # checkpoints written before sequence parallelism existed
    changes = [
        f"{_NAMES[key]} {saved[key]} -> {current[key]}"
        for key in (
            "world_size",
            "dp",
            "tp",
            "pp",
            "sp",
            "zero_stage",
            "offload_optimizer",
            "offload_params",
            "precision",
        )
        if key in saved and saved[key] != current[key]
    ]
    if not changes:
        return ResumeLayout()
    what = ", ".join(changes)
    if saved.get("pp", 1) > 1 or now.pp > 1:
        raise UserError(
            f"cannot resume a pipeline-parallel run on another layout ({what}): DeepSpeed's universal "
            "checkpoint does not re-stage pipelines; resume with the checkpoint's layout "
            "(its manifest.json), or export it (`llm-train export`) and fine-tune from the export"
        )
    if saved["sp"] != now.sp:
        # Not verified: the sequence-parallel groups re-shape the data-parallel ones (dp = world / (tp x sp))
        # and with them ZeRO's partitioning and the batch; no test resumes across a change of sp.
        raise UserError(
            f"cannot resume with another sequence-parallel degree ({what}): resuming across a change of "
            f"deepspeed.sequence_parallel is not supported; resume with deepspeed.sequence_parallel="
            f"{saved['sp']}, or export the checkpoint (`llm-train export`) and fine-tune from it"
        )
    stages = (saved["zero_stage"], now.zero_stage)
    resharded = any(key in saved and saved[key] != current[key] for key in _SHARDING)
    if resharded and 0 in stages and stages != (0, 0):
        raise UserError(
            f"cannot resume a ZeRO-{stages[0]} checkpoint under ZeRO-{stages[1]} ({what}): DeepSpeed's universal "
            "checkpoint covers ZeRO-1/2/3 only; resume with deepspeed.config at ZeRO-"
            f"{stages[0]}, or export the checkpoint and fine-tune from it"
        )
    if stages[0] != stages[1] and 3 in stages:
        # Measured with DeepSpeed 0.19.8: a ZeRO-3 engine looks for ZeRO-3's per-rank model files in the
        # universal folder and a ZeRO-1/2 engine for the single one, so both directions fail in its loader.
        raise UserError(
            f"cannot resume a ZeRO-{stages[0]} checkpoint under ZeRO-{stages[1]} ({what}): DeepSpeed's "
            "universal loader does not cross between ZeRO-3 and ZeRO-1/2; keep the stage (1 <-> 2 works, and "
            "the world size, TP degree and offload may change), or export the checkpoint and fine-tune from it"
        )
    if "nvme" in (saved.get("offload_optimizer"), now.offload_optimizer):
        # DeepSpeed 0.19.8 keeps a swapped sub-group's master, m and v in per-rank swap files (copied into
        # the checkpoint's offloaded_tensors/rankR): its optimizer state holds empty placeholders for them
        # (stage3.py _rigid_state_dict), so neither the universal conversion nor another offload can read
        # them (runtime/compat.py restore_swapped_state).
        raise UserError(
            f"cannot resume a checkpoint across NVMe optimizer offload or on another layout ({what}): the "
            "swapped optimizer state is kept per rank for the layout that wrote it; resume with the "
            "checkpoint's layout and deepspeed.config, or export it and fine-tune from the export"
        )
    if stages == (0, 0) and "precision" in saved and saved["precision"] != now.precision:
        # ZeRO-0 loads its own files as they are (no universal conversion): under bf16 DeepSpeed saves its
        # BF16_Optimizer's state, under fp32 the client optimizer's; crossing them is not supported.
        raise UserError(
            f"cannot change the precision of a ZeRO-0 checkpoint ({what}): ZeRO-0 reloads its own optimizer "
            f"state as saved; resume with precision={saved['precision']}, or use a ZeRO-1/2/3 deepspeed.config "
            "for runs that must resume in another precision"
        )
    if resharded and stages == (0, 0) and saved.get("tp", 1) != now.tp:
        raise UserError(
            f"cannot change the tensor-parallel degree of a ZeRO-0 checkpoint ({what}); use a ZeRO-1/2/3 "
            "deepspeed.config for runs that must resume on another layout"
        )
    # ZeRO-0 saves every rank's whole optimizer state: a new data-parallel size loads it as it is.
    universal = resharded and stages != (0, 0)
    notices = [
        f"resuming on a new layout: {what}"
        + ("; loading DeepSpeed's universal checkpoint" if universal else "")
    ]
    grad_accum = None
    saved_batch = saved.get("global_batch_size")
    if saved_batch is not None and saved_batch != now.global_batch_size:
        per_step = now.micro_batch_size * now.dp
        if allow_batch_change:
            notices.append(
                f"global batch {saved_batch} -> {now.global_batch_size} (--allow-batch-change): the data "
                "position carries over, every sample is still seen once per epoch"
            )
        elif saved_batch % per_step == 0:
            grad_accum = saved_batch // per_step
            notices.append(
                f"keeping the checkpoint's global batch {saved_batch}: gradient accumulation "
                f"{now.grad_accum} -> {grad_accum} (micro {now.micro_batch_size} x dp {now.dp})"
            )
        else:
            raise UserError(
                f"the checkpoint's global batch {saved_batch} cannot be kept with micro-batch "
                f"{now.micro_batch_size} x data-parallel size {now.dp}: set optim.micro_batch_size so that it "
                f"times {now.dp} divides {saved_batch}, or pass --allow-batch-change to train on with "
                f"{now.global_batch_size}"
            )
    return ResumeLayout(tuple(changes), universal, grad_accum, tuple(notices))


@dataclass(frozen=True)
class ResumePlan:
    """What a --resume launch expects to resume, and how it bridges that checkpoint's layout."""

    spec: str  # --resume: "auto" or a checkpoint directory
    root: Path  # the run's checkpoints/
    allow_batch_change: bool = False
    allow_data_revision_change: bool = False
    saved: dict[str, Any] | None = None  # the layout of the checkpoint peeked at (None: none found)
    layout: ResumeLayout = ResumeLayout()

    def refine(self, run: Resolved) -> Resolved:
        """The run with the accumulation that keeps the checkpoint's global batch (unchanged if none)."""
        if self.layout.grad_accum is None:
            return run
        return run.refine(grad_accum=self.layout.grad_accum)


def plan_resume(
    spec: str,
    root: Path,
    now: Layout,
    allow_batch_change: bool = False,
    allow_data_revision_change: bool = False,
) -> ResumePlan:
    """Before any worker starts: a --resume path that is not there, or a layout change that is refused."""
    if spec != "auto" and not Path(spec).is_dir():
        raise UserError(
            f"--resume {spec}: not a directory; give a checkpoint directory (RUN_DIR/checkpoints/step-N) "
            "or --resume auto for the newest complete one"
        )
    plan = ResumePlan(spec, root, allow_batch_change, allow_data_revision_change)
    peeked = _peek(spec, root)
    if peeked is None:
        return plan
    saved = saved_layout(peeked[1])
    return ResumePlan(
        spec,
        root,
        allow_batch_change,
        allow_data_revision_change,
        saved,
        bridge(saved, now, allow_batch_change),
    )


def check_same_plan(chosen: Path, planned: ResumeLayout, verified: ResumeLayout) -> None:
    """The checkpoint that verified must need the bridge planned before start-up, and nothing more.

    `verified` compares it with the launch as adjusted by `planned` (its batch already kept).
    """
    if verified.universal != planned.universal or verified.grad_accum is not None:
        raise UserError(
            f"the newest checkpoint failed verification and the fallback {chosen} was written with another "
            f"layout; relaunch with --resume {chosen}"
        )


# ------------------------------------------------------------ choosing and converting, once the world exists


def choose_checkpoint(
    spec: str, root: Path, rank: int, comm: Collectives, warn: Say, patience_s: float = 1800.0
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
    chosen: Path, root: Path, rank: int, comm: Collectives, patience_s: float, say: Say
) -> None:
    """Rank 0 converts `chosen` to the universal format (once); the other ranks wait for it through a file.

    A 70B conversion takes about an hour (planning/checkpoint_cost.py): far beyond any
    process-group timeout, so the others must not wait inside a collective (runtime/checkpointing/file_sync.py).
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


def check_recipe(ckpt: Path, manifest: dict[str, Any], recipe: Recipe, warn: Say) -> None:
    if manifest["recipe_hash"] != recipe_hash(recipe):
        warn(
            f"notice: the recipe differs from the one checkpoint {ckpt.name} was written with; resuming anyway"
        )


def read_data_state(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's data position: the global count of sequences consumed, the same in every rank's file."""
    return json.loads(trainer_state_path(ckpt, 0).read_text())["data"]


@dataclass(frozen=True)
class Resume:
    """The verified checkpoint a run resumes from, and how it loads it."""

    checkpoint: Path
    layout: ResumeLayout
    allow_data_revision_change: bool = False


def open_resume(plan: ResumePlan, run: Resolved, stream: Stream, rank: int, say: Say) -> Resume | None:
    """The verified checkpoint to resume (the same on every rank), converted when the layout changed.

    None when there is no complete checkpoint. `run` is the run as refined by the plan. Called
    before the model is built: a data position that cannot continue is one line now.
    """
    comm = collectives.WORLD
    patience_s = run.recipe.deepspeed.timeout_minutes * 60
    chosen = choose_checkpoint(plan.spec, plan.root, rank, comm, say, patience_s)
    if chosen is None:
        return None
    manifest = read_manifest(chosen)
    check_recipe(chosen, manifest, run.recipe, say)
    saved = saved_layout(manifest)
    if saved != plan.saved:
        # A fallback written with another layout than the one planned for: it must need the same bridge.
        check_same_plan(chosen, plan.layout, bridge(saved, run.layout, plan.allow_batch_change))
    if plan.layout.universal:
        convert_for_resume(chosen, plan.root, rank, comm, patience_s, say)
    for notice in stream.check_state(read_data_state(chosen), plan.allow_data_revision_change):
        say(f"notice: {notice}")
    return Resume(chosen, plan.layout, plan.allow_data_revision_change)


# ------------------------------------------------------------ restoring, once the engine exists


@dataclass(frozen=True)
class TrainerState:
    step: int = 0  # the last optimizer step the checkpoint holds (0: a fresh start)
    tracker_run_id: str | None = None


def restore_run_state(
    resume: Resume | None, engine: DeepSpeedEngine, stream: Stream, rank: int, seed: int
) -> TrainerState:
    """Seed this rank, then load the engine state and the trainer state of `resume` (if any).

    On the layout that wrote the checkpoint every rank restores its own RNG states. On
    another layout a rank may have had no predecessor, so every rank reseeds its RNGs from
    (seed, step, rank); the data order is not an RNG stream (data/stream.py) and carries
    over exactly, as does everything in the DeepSpeed state (weights, Adam, LR schedule, step).
    """
    import torch

    torch.manual_seed(seed + rank)  # dropout differs per rank, reproducibly
    if resume is None:
        return TrainerState()
    ckpt, layout = resume.checkpoint, resume.layout
    # DeepSpeed's shards are pickles: `ckpt` (and its universal copy) verified against a manifest.
    load_dir = universal_dir(ckpt) if layout.universal else ckpt / "state"
    # A LoRA checkpoint holds the adapters only (save_run_state): the base already loaded stays.
    frozen_left_out = any(not p.requires_grad for p in engine.module.parameters())
    load_engine_checkpoint(
        engine, str(load_dir), DS_TAG, universal=layout.universal, strict=not frozen_left_out
    )
    # The data position is the global count of sequences consumed, the same in every rank's file.
    state = json.loads(trainer_state_path(ckpt, rank if layout.same_layout else 0).read_text())
    stream.load_state_dict(state["data"], resume.allow_data_revision_change)
    if layout.same_layout:
        set_rng_state(state["rng"])
    else:
        reseed(seed, state["step"], rank)
    return TrainerState(state["step"], state.get("tracker_run_id"))
