"""Checkpoints that survive anything: atomic commit, verified load, retention.

Layout under the run directory:

    checkpoints/step-00000100/      one committed checkpoint
        state/                      DeepSpeed's engine.save_checkpoint (model, optimizer, LR schedule)
        trainer/rank00000.json      per-rank trainer state: step, data position, RNG states
        hf/                         the HF config and tokenizer (so `llm-train export` needs nothing else)
        manifest.json               written last: files, sizes, sha256, step, world size, recipe hash
    checkpoints/latest              the name of the newest committed checkpoint
    checkpoints/.tmp-step-...       a save in progress (removed if the save fails)

The commit protocol: every rank writes into the temporary directory; after all ranks are
done, rank 0 hashes the files and writes the manifest, then renames the directory into
place and replaces `latest` atomically. A crash at any moment leaves `latest` naming a
complete checkpoint (the previous or the new one). Loading re-verifies the manifest and
falls back to the previous good checkpoint with a one-line warning. DeepSpeed's shards are
pickles: they are only ever loaded from a directory whose manifest verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.errors import EXIT_CHECKPOINT_IO, UserError

if TYPE_CHECKING:  # the collectives import torch; verifying a checkpoint does not need it
    from llm_train.runtime.collectives import Collectives

MANIFEST = "manifest.json"
DS_TAG = "ds"  # the tag DeepSpeed saves each checkpoint's engine state under (state/ds/)
LATEST = "latest"
PREFIX = "step-"


class CheckpointIOError(UserError):
    """A save could not be completed; the previous checkpoint is intact."""

    exit_code = EXIT_CHECKPOINT_IO


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename: readers see the old or the new content, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_manifest(ckpt_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    files = {}
    for file in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = file.relative_to(ckpt_dir).as_posix()
        files[rel] = {"size": file.stat().st_size, "sha256": _sha256(file)}
    return {**meta, "files": files}


def verify(ckpt_dir: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason (one line)."""
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest unreadable"
    for rel, expected in files.items():
        file = ckpt_dir / rel
        if not file.is_file():
            return f"{rel} missing"
        if file.stat().st_size != expected["size"]:
            return f"{rel} has {file.stat().st_size} bytes, manifest says {expected['size']}"
        if _sha256(file) != expected["sha256"]:
            return f"{rel} checksum differs from the manifest"
    return None


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((ckpt_dir / MANIFEST).read_text())


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first (by step)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), reverse=True)


def find_resumable(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies: `latest` first, then older ones, each failure one warning."""
    latest_file = root / LATEST
    candidates = committed(root)
    if latest_file.is_file():
        named = root / latest_file.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        reason = verify(candidate)
        if reason is None:
            return candidate
        warn(f"warning: skipping checkpoint {candidate}: {reason}")
    return None


@dataclass(frozen=True)
class SaveMeta:
    step: int
    world_size: int
    recipe_hash: str
    zero_stage: int
    layout: dict[str, Any]  # Layout.as_dict(): what a resume on another layout compares against


class Checkpointer:
    """Saves committed checkpoints of one run; every method is called on every rank."""

    def __init__(self, root: Path, rank: int, keep_last_n: int, collectives: Collectives) -> None:
        self.root, self.rank, self.keep, self.comm = root, rank, max(2, keep_last_n), collectives

    def _space_problem(self, step: int, estimate_bytes: int) -> str | None:
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        need = int(estimate_bytes * 1.1)
        if free < need:
            return (
                f"checkpoint at step {step} needs about {need / 2**30:.2f} GiB but {self.root} has "
                f"{free / 2**30:.2f} GiB free; free space or lower checkpoint.keep_last_n"
            )
        return None

    def save(
        self,
        meta: SaveMeta,
        write: Callable[[Path], None],
        estimate_bytes: int,
    ) -> Path:
        """Write (all ranks) -> manifest + rename + latest (rank 0). Raises CheckpointIOError on failure."""
        final = self.root / step_name(meta.step)
        tmp = self.root / f".tmp-{step_name(meta.step)}"
        problem = self.comm.from_rank0(
            self._space_problem(meta.step, estimate_bytes) if self.rank == 0 else None
        )
        if problem:
            raise CheckpointIOError(problem)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale one from a crash
            tmp.mkdir(parents=True)
        self.comm.barrier()
        error = None
        try:
            write(tmp)
        except OSError as exc:
            error = (
                f"checkpoint at step {meta.step}: {exc.strerror or exc} while writing ({type(exc).__name__})"
            )
        if self.comm.any(error is not None):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self.comm.barrier()
            raise CheckpointIOError(
                (error or f"checkpoint at step {meta.step}: another rank failed to write")
                + f"; the previous checkpoint is kept; free {shutil.disk_usage(self.root).free / 2**30:.2f} GiB"
            )
        if self.rank == 0:
            try:
                self._commit(tmp, final, meta)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                error = f"checkpoint at step {meta.step}: {exc.strerror or exc} while committing"
        if self.comm.from_rank0(error):
            raise CheckpointIOError(f"{error}; the previous checkpoint is kept")
        self.comm.barrier()
        if self.rank == 0:
            self._prune()
        return final

    def _commit(self, tmp: Path, final: Path, meta: SaveMeta) -> None:
        manifest = build_manifest(
            tmp,
            {
                "step": meta.step,
                "world_size": meta.world_size,
                "recipe_hash": meta.recipe_hash,
                "zero_stage": meta.zero_stage,
                "layout": meta.layout,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        if final.exists():  # the same step saved again (e.g. preempted right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        write_atomic(self.root / LATEST, final.name)

    def _prune(self) -> None:
        latest_file = self.root / LATEST
        latest = latest_file.read_text().strip() if latest_file.is_file() else None
        for old in committed(self.root)[self.keep :]:
            if old.name != latest:
                shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------ per-rank trainer state


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states as JSON (loaded without pickle)."""
    import random

    import numpy as np
    import torch

    np_state = np.random.get_state()
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


def trainer_state_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "trainer" / f"rank{rank:05d}.json"
