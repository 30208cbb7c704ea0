"""DeepSpeed's universal checkpoint, made once beside a checkpoint when a resume changes the layout.

A ZeRO checkpoint is sharded for the world that wrote it: each data-parallel rank saved its
own partition of the fp32 master weights and Adam states. DeepSpeed's `ds_to_universal`
rewrites those shards as one file per parameter and state, which any layout (other
data-parallel size, tensor-parallel degree, ZeRO stage, offload) can load with
`"checkpoint": {"load_universal": true}`.

The conversion is written like a checkpoint: into a temporary directory beside the
checkpoint, then a manifest (sizes and sha256 of every file), then one rename to
`universal/`. A conversion killed half way leaves only the temporary directory, which the
next attempt deletes and redoes; `universal/` is used only when its manifest verifies.
It runs in a child process so a crash in it (or its memory peak) cannot take the rank with it.

A module of its own, not part of runtime/checkpointing/resume.py: converting is a job apart from resuming. It
makes a verified derived copy of a checkpoint, with its own manifest, for three users: a resume
on another layout (resume.py), `llm-train convert` ahead of time, and the export of a checkpoint
(export/from_checkpoint.py reads the merged weights through `universal_state_dict`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_train.errors import UserError
from llm_train.runtime.checkpointing.commit import DS_TAG, build_manifest, verify, write_atomic

UNIVERSAL = "universal"
_MANIFEST = "manifest.json"


def universal_dir(ckpt: Path) -> Path:
    """Where the universal copy of checkpoint `ckpt` lives (DeepSpeed loads `<this>/ds`)."""
    return ckpt / UNIVERSAL


def _convert_command(source: Path, target: Path) -> list[str]:
    workers = max(1, min(4, os.cpu_count() or 1))
    return [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source),
        "--output_folder",
        str(target),
        "--num_extract_workers",
        str(workers),
        "--num_merge_workers",
        str(max(1, workers // 2)),
        # Hugging Face models carry no Megatron-style universal info; an empty one is what they need.
        "--inject_missing_state",
    ]


def ensure_universal(ckpt: Path, say: Callable[[str], None]) -> Path:
    """The verified universal copy of `ckpt`, converting it first if there is none (call on one rank)."""
    target = universal_dir(ckpt)
    if target.is_dir() and verify(target) is None:
        return target
    if target.exists():  # a copy that no longer verifies is never used: convert again
        say(f"warning: {target} does not verify ({verify(target)}); converting again")
        shutil.rmtree(target)
    source = ckpt / "state" / DS_TAG
    if not source.is_dir():
        raise UserError(f"checkpoint {ckpt} has no DeepSpeed state ({source}); it cannot be resumed")
    for stale in ckpt.glob(f".tmp-{UNIVERSAL}-*"):  # left by a conversion that was killed: never reused
        shutil.rmtree(stale, ignore_errors=True)
    # A name of its own: a converter orphaned by a killed rank may still be writing into its directory.
    tmp = ckpt / f".tmp-{UNIVERSAL}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    say(f"converting {ckpt.name} to DeepSpeed's universal format for the new layout (once; kept beside it)")
    started = time.perf_counter()
    result = subprocess.run(
        _convert_command(source, tmp / DS_TAG), capture_output=True, text=True, env=_env_without_world()
    )
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(
            f"converting checkpoint {ckpt} to the universal format failed: {last}; "
            "resume on the layout it was written with (see its manifest.json)"
        )
    (tmp / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer; llm_train names the tag itself
    manifest = build_manifest(
        tmp, {"converted_from": str(source), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    )
    write_atomic(tmp / _MANIFEST, json.dumps(manifest, indent=1))
    os.replace(tmp, target)
    say(f"universal checkpoint written in {time.perf_counter() - started:.1f}s: {target}")
    return target


def universal_state_dict(target: Path) -> dict[str, Any]:
    """The fp32 weights of a (verified) universal checkpoint by parameter name, TP shards merged."""
    import torch

    zero = target / DS_TAG / "zero"
    return {
        param.name: torch.load(param / "fp32.pt", map_location="cpu", weights_only=True)["param"]
        for param in sorted(zero.iterdir())
        if (param / "fp32.pt").is_file()
    }


def _env_without_world() -> dict[str, str]:
    # The converter is a plain script: it must not mistake itself for a rank of the training world.
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env
