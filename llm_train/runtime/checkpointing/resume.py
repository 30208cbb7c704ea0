"""How a run resumes: one `Resume`, planned before any worker starts, opened once the world exists,
restored once the engine is built.

    resume = Resume.plan(spec, root, layout)    train.py, before start: the bridge (layouts compared)
    run = resume.refine(run, say)               train.py, in the worker: the kept batch, universal loading
    resume.open(run, batches, say)              the world exists: verify, convert, check the data position
    state = resume.restore(engine, batches, ...)  the engine exists: DeepSpeed's state, data, RNGs

1. `Resume.plan`, before any worker starts (train.py `check_before_start`, in the launching
   process and again in each worker): the checkpoint a resume will most likely use is read
   without verifying it, and its layout is compared with this launch's (`bridge`). What cannot
   be bridged is refused in one line; a kept global batch gives the accumulation the run is
   refined with (config/resolution.py `Resolved.refine`) before the data and the engine exist.
   Without --resume the plan is a fresh start, and each step below does only what a fresh start needs.
2. `open`, once the world exists and before the model is built: every rank verifies its
   share of the checkpoint; a fallback to an older one must need the same bridge; the
   universal copy is made when the layout changed; the data position is checked against the
   stream.
3. `restore`, once the engine is built: DeepSpeed's state (runtime/base/compat.py puts right what its load
   leaves out), the data position, the RNGs; metrics logged after the checkpoint are dropped.

The rules that compare layouts (`bridge`):

- nothing that shards the state changed: DeepSpeed loads its own checkpoint as usual;
- the data-parallel size, tensor-parallel degree, ZeRO stage or offload changed: the
  checkpoint is converted once to DeepSpeed's universal format (universal.py) and
  loaded from there;
- the global batch would change: the gradient accumulation is adjusted to keep it (one
  notice), or, with --allow-batch-change, the new batch is used on purpose;
- what DeepSpeed cannot convert (pipeline stages; ZeRO-0 to or from a ZeRO stage, or in another
  precision; ZeRO-3 to or from ZeRO-1/2) and what is not verified (another sequence-parallel
  degree) is refused in one line that says what changed and what is possible.

The data position needs nothing: it counts sequences consumed by all ranks together
(data/dealer.py), so the new data-parallel ranks are dealt the rest of the epoch exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config.layout import Layout
from llm_train.config.recipe import Recipe
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.runtime.base import collectives
from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.base.compat import load_engine_checkpoint
from llm_train.runtime.checkpointing.commit import (
    DS_TAG,
    LATEST,
    committed,
    read_manifest,
    resumable_candidates,
    verify_shared,
)
from llm_train.runtime.checkpointing.file_sync import FileSync
from llm_train.runtime.checkpointing.run_state import (
    base_identity,
    check_base,
    read_data_state,
    recipe_hash,
    reseed,
    set_rng_state,
    trainer_state_path,
)
from llm_train.runtime.checkpointing.universal import ensure_universal, universal_dir
from llm_train.runtime.model.optim import is_eight_bit

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from llm_train.data.dealer import Batches

Say = Callable[[str], None]


# What the JSONL tracker writes per step: the metrics and GRPO's completions table (observability/tracking.py).
STEP_LOGS = ("metrics.jsonl", "completions.jsonl")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint: the resumed run logs those steps again. A partial last line
    (a kill mid-write) is dropped with them."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and row.get("step", 0) <= last_step:
            keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))


def rewind_step_logs(output_dir: Path, last_step: int) -> None:
    """Every per-step log of the run back to the checkpoint's step (metrics and completions rewind together)."""
    for name in STEP_LOGS:
        truncate_metrics(output_dir / name, last_step)


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
    compared again afterwards (`Resume.open`).
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
        # them (runtime/base/compat.py restore_swapped_state).
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

    A 70B conversion takes about an hour (planning/speed/checkpoint_cost.py): far beyond any
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


@dataclass(frozen=True)
class TrainerState:
    step: int = 0  # the last optimizer step the checkpoint holds (0: a fresh start)
    tracker_run_id: str | None = None


class Resume:
    """A run's resume: planned before start (`plan`), opened in the world (`open`), restored into the engine.

    `spec` None is a fresh start (no --resume): nothing to open, and `restore` only seeds.
    """

    def __init__(
        self,
        spec: str | None,
        root: Path,
        allow_batch_change: bool = False,
        allow_data_revision_change: bool = False,
        saved: dict[str, Any] | None = None,
        layout: ResumeLayout = ResumeLayout(),
    ) -> None:
        self.spec = spec  # --resume: "auto" or a checkpoint directory; None: no --resume
        self.root = root  # the run's checkpoints/
        self.allow_batch_change = allow_batch_change
        self.allow_data_revision_change = allow_data_revision_change
        self.saved = saved  # the layout of the checkpoint peeked at (None: none found)
        self.layout = layout  # the bridge from that layout to this launch's
        self.checkpoint: Path | None = None  # the verified checkpoint, once opened (None: none)
        self._opened: tuple[Resolved, Say] | None = None  # the run and the reporter `open` was given

    @classmethod
    def plan(
        cls,
        spec: str | None,
        root: Path,
        now: Layout,
        allow_batch_change: bool = False,
        allow_data_revision_change: bool = False,
        recipe: Recipe | None = None,
        allow_base_change: bool = False,
    ) -> Resume:
        """Before any worker starts: a --resume path that is not there, a layout change that is refused, or a
        LoRA base that is not the checkpoint's (`recipe` given)."""
        flags = (allow_batch_change, allow_data_revision_change)
        if spec is None:
            return cls(None, root, *flags)
        if spec != "auto" and not Path(spec).is_dir():
            raise UserError(
                f"--resume {spec}: not a directory; give a checkpoint directory (RUN_DIR/checkpoints/step-N) "
                "or --resume auto for the newest complete one"
            )
        peeked = _peek(spec, root)
        if peeked is None:
            return cls(spec, root, *flags)
        saved = saved_layout(peeked[1])
        if recipe is not None:
            try:
                recorded = json.loads(trainer_state_path(peeked[0], 0).read_text()).get("base")
            except (OSError, ValueError):
                recorded = None  # verification will pick another checkpoint, or none
            check_base(recorded, base_identity(recipe), peeked[0].name, allow_base_change)
        return cls(spec, root, *flags, saved, bridge(saved, now, allow_batch_change))

    def refine(self, run: Resolved, say: Say) -> Resolved:
        """The run as this resume trains it: the accumulation that keeps the checkpoint's global batch, and
        DeepSpeed's universal loading when the layout changed (each notice said once)."""
        for notice in self.layout.notices:
            say(f"notice: {notice}")
        if self.layout.grad_accum is None and not self.layout.universal:
            return run
        return run.refine(grad_accum=self.layout.grad_accum, load_universal=self.layout.universal or None)

    def open(self, run: Resolved, batches: Batches, say: Say, world: Collectives = collectives.WORLD) -> None:
        """Choose the verified checkpoint to resume (the same on every rank), converted when the layout changed.

        No checkpoint when there is no complete one. `run` is the run as refined by the plan. Called
        before the model is built: a data position that cannot continue is one line now.
        """
        self._opened = (run, say)
        if self.spec is None:
            return
        rank = collectives.rank()
        patience_s = run.recipe.deepspeed.timeout_minutes * 60
        chosen = choose_checkpoint(self.spec, self.root, rank, world, say, patience_s)
        if chosen is None:
            return
        manifest = read_manifest(chosen)
        check_recipe(chosen, manifest, run.recipe, say)
        saved = saved_layout(manifest)
        if saved != self.saved:
            # A fallback written with another layout than the one planned for: it must need the same bridge.
            check_same_plan(chosen, self.layout, bridge(saved, run.layout, self.allow_batch_change))
        if self.layout.universal:
            convert_for_resume(chosen, self.root, rank, world, patience_s, say)
        for notice in batches.check_state(read_data_state(chosen), self.allow_data_revision_change):
            say(f"notice: {notice}")
        self.checkpoint = chosen

    def restore(self, engine: DeepSpeedEngine, batches: Batches) -> TrainerState:
        """Seed this rank, load the engine and trainer state of the opened checkpoint (if any), drop the
        rows of metrics.jsonl logged after it; every rank returns once all have. After `open`.

        On the layout that wrote the checkpoint every rank restores its own RNG states. On
        another layout a rank may have had no predecessor, so every rank reseeds its RNGs from
        (seed, step, rank); the data order is not an RNG stream (data/dealer.py) and carries
        over exactly, as does everything in the DeepSpeed state (weights, Adam, LR schedule, step).
        """
        import torch

        assert self._opened is not None, "Resume.restore before Resume.open"
        run, say = self._opened
        rank, seed = collectives.rank(), run.recipe.optim.seed
        torch.manual_seed(seed + rank)  # dropout differs per rank, reproducibly
        state = TrainerState()
        if self.checkpoint is not None:
            state = self._load(engine, batches, self.checkpoint, seed, rank)
            say(f"resumed from {self.checkpoint} at step {state.step}")
        elif self.spec is not None:
            say("no complete checkpoint to resume from; starting at step 0")
        if rank == 0:
            rewind_step_logs(run.recipe.output_dir, state.step)
        collectives.WORLD.barrier()
        return state

    def _load(
        self, engine: DeepSpeedEngine, batches: Batches, ckpt: Path, seed: int, rank: int
    ) -> TrainerState:
        layout = self.layout
        if layout.universal and is_eight_bit(engine.optimizer):
            raise UserError(
                f"--resume {ckpt}: an 8-bit optimizer (optim.name) resumes only on the layout that wrote the checkpoint "
                "(DeepSpeed's universal checkpoint carries Adam's fp32 moments only); resume with the same world size "
                "and DeepSpeed config, or set optim.name=adamw"
            )
        # DeepSpeed's shards are pickles: `ckpt` (and its universal copy) verified against a manifest.
        load_dir = universal_dir(ckpt) if layout.universal else ckpt / "state"
        # A LoRA checkpoint holds the adapters only (run_state.Saver): the base already loaded stays.
        frozen_left_out = any(not p.requires_grad for p in engine.module.parameters())
        load_engine_checkpoint(
            engine, str(load_dir), DS_TAG, universal=layout.universal, strict=not frozen_left_out
        )
        # The data position is the global count of sequences consumed, the same in every rank's file.
        state = json.loads(trainer_state_path(ckpt, rank if layout.same_layout else 0).read_text())
        batches.load_state_dict(state["data"], self.allow_data_revision_change)
        if layout.same_layout:
            set_rng_state(state["rng"])
        else:
            reseed(seed, state["step"], rank)
        return TrainerState(state["step"], state.get("tracker_run_id"))
