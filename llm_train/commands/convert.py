"""`llm-train convert RUN_DIR_OR_CHECKPOINT`: the universal copy a resume on a new layout needs, made ahead.

A resume on another world size, TP degree, ZeRO stage (1 <-> 2) or offload loads DeepSpeed's
universal format (runtime/checkpointing/universal.py). The run would convert on its rank 0 at start-up, while
every other GPU of the job waits; at 70B that is about an hour. Converting here first, on any
machine that sees the checkpoint (no GPU, no process group), leaves a verified `universal/` that
the resume then only verifies, split over its ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llm_train.errors import UserError
from llm_train.runtime.checkpointing.commit import dir_size, find_resumable, read_manifest, verify
from llm_train.runtime.checkpointing.resume import saved_layout
from llm_train.runtime.checkpointing.universal import ensure_universal


def checkpoint_of(path: Path, command: str) -> Path:
    """The checkpoint `path` names: itself, or a run directory's newest complete one."""
    if (path / "checkpoints").is_dir():
        found = find_resumable(path / "checkpoints", lambda m: print(m, file=sys.stderr))
        if found is None:
            raise UserError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
        return found
    if not path.is_dir():
        raise UserError(
            f"{command}: {path} is not a checkpoint directory (expected checkpoints/step-N or a run dir)"
        )
    return path


def cmd_convert(args: argparse.Namespace) -> int:
    ckpt = checkpoint_of(Path(args.checkpoint), "convert")
    if reason := verify(ckpt):
        raise UserError(f"convert: checkpoint {ckpt}: {reason}; not converting it")
    layout = saved_layout(read_manifest(ckpt))
    if layout.get("pp", 1) > 1:
        raise UserError(
            f"convert: {ckpt} was written by a pipeline-parallel run; DeepSpeed's universal format does not "
            "re-stage pipelines, so it resumes only on its own layout (export it to change the layout)"
        )
    if layout["zero_stage"] == 0:
        raise UserError(
            f"convert: {ckpt} is a ZeRO-0 checkpoint: it holds the whole optimizer state and resumes on any "
            "data-parallel size as it is; nothing to convert"
        )
    started = time.perf_counter()
    target = ensure_universal(ckpt, print)
    print(
        f"{target}: verified universal copy, {dir_size(target) / 2**30:.2f} GiB, ready in "
        f"{time.perf_counter() - started:.1f}s; resume with --resume {ckpt} (or --resume auto)"
    )
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="Convert a checkpoint to DeepSpeed's universal format ahead of a resume on a new layout.",
    )
    parser.add_argument(
        "checkpoint",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="checkpoints/step-N of a run, or a run directory (its newest complete checkpoint).",
    )
    parser.set_defaults(func=cmd_convert)
