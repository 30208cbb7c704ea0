"""What changed between a checkpoint's layout and this launch's, and how the resume bridges it.

Every checkpoint's manifest records the layout that wrote it (world size, tensor and
pipeline degrees, ZeRO stage, offload, precision, batch). On resume the two are compared:

- nothing that shards the state changed: DeepSpeed loads its own checkpoint as usual;
- the data-parallel size, tensor-parallel degree, ZeRO stage or offload changed: the
  checkpoint is converted once to DeepSpeed's universal format (runtime/universal.py) and
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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_train.config.layout import Layout
from llm_train.errors import UserError
from llm_train.runtime.checkpoint import LATEST, committed, read_manifest

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
    """How this launch resumes a checkpoint written with another (or the same) layout."""

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


def peek_manifest(spec: str, root: Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint a resume will most likely use, read without verifying it.

    The batch and the DeepSpeed config must be settled before the engine exists, which is
    before the checkpoint is verified (that needs the process group); the verified choice is
    compared again afterwards (`check_same_plan`).
    """
    if spec == "auto":
        latest = root / LATEST
        newest = committed(root)[:1]
        candidate = root / latest.read_text().strip() if latest.is_file() else (newest[0] if newest else None)
    else:
        candidate = Path(spec)
    if candidate is None:
        return None
    try:
        return read_manifest(candidate)
    except (OSError, ValueError):
        return None  # no or a damaged manifest: verification will pick another checkpoint, or none


def plan_resume(saved: dict[str, Any], now: Layout, allow_batch_change: bool) -> ResumeLayout:
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


def check_resume_early(spec: str, root: Path, now: Layout, allow_batch_change: bool) -> None:
    """Before any worker starts: a --resume path that is not there, or a layout change that is refused."""
    if spec != "auto" and not Path(spec).is_dir():
        raise UserError(
            f"--resume {spec}: not a directory; give a checkpoint directory (RUN_DIR/checkpoints/step-N) "
            "or --resume auto for the newest complete one"
        )
    manifest = peek_manifest(spec, root)
    if manifest is not None:
        plan_resume(saved_layout(manifest), now, allow_batch_change)


def check_same_plan(chosen: Path, planned: ResumeLayout, verified: ResumeLayout) -> None:
    """The checkpoint that verified must need the bridge planned before start-up, and nothing more.

    `verified` compares it with the launch as adjusted by `planned` (its batch already kept).
    """
    if verified.universal != planned.universal or verified.grad_accum is not None:
        raise UserError(
            f"the newest checkpoint failed verification and the fallback {chosen} was written with another "
            f"layout; relaunch with --resume {chosen}"
        )
