"""Checkpoints that survive anything: atomic commit, verified load, retention.

This module is the commit protocol only: what a checkpoint holds and how a run resumes from
one is run_state.py's and resume.py's (run_state.Saver hands `Checkpointer.save` a function that writes the files).
Layout under the run directory:

    checkpoints/step-00000100/      one committed checkpoint
        state/                      DeepSpeed's engine.save_checkpoint (model, optimizer, LR schedule)
        trainer/rank00000.json      per-rank trainer state: step, data position, RNG states (run_state.py)
        hf/                         the HF config and tokenizer (so `llm-train export` needs nothing else)
        reference.safetensors       the training engine's logits on a fixed batch (export's reference)
        manifest.json               written last: files, sizes, sha256, step, world size, recipe hash
    checkpoints/latest              the name of the newest committed checkpoint
    checkpoints/.tmp-step-...       a save in progress (removed if the save fails)

The commit protocol: every rank writes into the temporary directory; after all ranks are
done, every rank hashes its share of the files (`share`: about 1/N of the bytes each) and
posts the digests; rank 0 gathers them, writes the manifest, renames the directory into place
and replaces `latest` atomically, then posts the outcome. A crash at any moment leaves
`latest` naming a complete checkpoint (the previous or the new one). Loading re-verifies the
manifest, split the same way, and falls back to the previous good checkpoint with a one-line
warning. DeepSpeed's shards are pickles: they are only ever loaded from a directory whose
manifest verifies.

No rank waits for the hashing or the commit inside a collective: the digests and the outcome
travel through files (runtime/checkpointing/file_sync.py), so a checkpoint of any size never meets the
process-group timeout.
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
from llm_train.runtime.checkpointing.file_sync import FileSync

if TYPE_CHECKING:  # the collectives import torch; verifying a checkpoint does not need it
    from llm_train.runtime.base.collectives import Collectives

MANIFEST = "manifest.json"
# The training engine's logits on the export check's fixed batch at the saved step (run_state.py):
# `llm-train export` verifies against them, independently of how the shards are merged.
CHECKPOINT_REFERENCE = "reference.safetensors"
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


def listing(ckpt_dir: Path) -> dict[str, int]:
    """Every file under ckpt_dir but the manifest, by relative path: its size."""
    return {
        p.relative_to(ckpt_dir).as_posix(): p.stat().st_size
        for p in sorted(ckpt_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files `rank` hashes: largest first, each to the rank with the fewest bytes so far.

    The same on every rank for the same listing, and within one file's size of an even split,
    so a save or a verification takes ~1/world of the one-rank time. (Which rank wrote which
    DeepSpeed file depends on the stage and the parallel layout; an even split bounds the time
    the same way without depending on DeepSpeed's file names.)
    """
    loads = [0] * world
    mine = []
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += sizes[rel]
        if owner == rank:
            mine.append(rel)
    return mine


def hash_files(ckpt_dir: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    return {rel: {"size": (ckpt_dir / rel).stat().st_size, "sha256": _sha256(ckpt_dir / rel)} for rel in rels}


def build_manifest(ckpt_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a directory hashed by this process alone (tools, the universal conversion)."""
    return {**meta, "files": hash_files(ckpt_dir, list(listing(ckpt_dir)))}


def _read_files(ckpt_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest (the save did not finish)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        return None, "manifest unreadable"
    return files, None


def _check(ckpt_dir: Path, files: dict[str, Any], rels: list[str]) -> str | None:
    for rel in rels:
        file, expected = ckpt_dir / rel, files[rel]
        if not file.is_file():
            return f"{rel} missing"
        if file.stat().st_size != expected["size"]:
            return f"{rel} has {file.stat().st_size} bytes, manifest says {expected['size']}"
        if _sha256(file) != expected["sha256"]:
            return f"{rel} checksum differs from the manifest"
    return None


def verify(ckpt_dir: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason (one line); hashes everything here."""
    files, problem = _read_files(ckpt_dir)
    return problem if files is None else _check(ckpt_dir, files, list(files))


def verify_shared(ckpt_dir: Path, sync: FileSync, key: str) -> str | None:
    """`verify` split over the ranks of `sync`: each hashes its share, every rank gets the same answer.

    Call on every rank. The first problem in rank order wins, so all ranks agree on the reason.
    """
    files, problem = _read_files(ckpt_dir)
    if files is not None:
        mine = share({rel: int(f["size"]) for rel, f in files.items()}, sync.rank, sync.world)
        with sync.working():
            problem = _check(ckpt_dir, files, mine)
    sync.post(key, problem)
    return next((p for p in sync.wait(key, range(sync.world), f"verification of {ckpt_dir.name}") if p), None)


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((ckpt_dir / MANIFEST).read_text())


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first (by step)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), reverse=True)


def resumable_candidates(root: Path) -> list[Path]:
    """The checkpoints a resume tries, in order: the one `latest` names, then the others newest first."""
    latest_file = root / LATEST
    candidates = committed(root)
    if latest_file.is_file():
        named = root / latest_file.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    return candidates


def find_resumable(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies: `latest` first, then older ones, each failure one warning.

    One process hashes everything: for tools (`llm-train convert`); a run uses choose_checkpoint.
    """
    for candidate in resumable_candidates(root):
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
    """Saves committed checkpoints of one run; every method is called on every rank.

    patience_s: how long a rank waits for another that shows no sign of life (the
    process-group timeout, deepspeed.timeout_minutes).
    """

    def __init__(
        self, root: Path, rank: int, keep_last_n: int, collectives: Collectives, patience_s: float = 1800.0
    ) -> None:
        self.root, self.rank, self.keep, self.comm = root, rank, max(2, keep_last_n), collectives
        self.patience_s = patience_s

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
        """Write (all ranks) -> hash (all ranks, a share each) -> manifest + rename + latest (rank 0).

        Raises CheckpointIOError on failure, on every rank.
        """
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
        # Every write is done (the collective above): rank 0's listing is what every rank hashes a share of.
        sizes = self.comm.from_rank0(listing(tmp) if self.rank == 0 else None)
        sync = FileSync.open(self.root, f"save-{meta.step}", self.comm, self.rank, self.patience_s)
        with sync.working():
            try:
                digests: dict[str, Any] | str = hash_files(tmp, share(sizes, self.rank, sync.world))
            except OSError as exc:
                digests = f"checkpoint at step {meta.step}: {exc.strerror or exc} while hashing"
            sync.post("digests", digests)
            if self.rank == 0:
                error = self._commit_gathered(tmp, final, meta, sync)
                sync.post("outcome", error)
        if error := sync.wait("outcome", [0], f"commit of {final.name}")[0]:
            raise CheckpointIOError(f"{error}; the previous checkpoint is kept")
        if self.rank == 0:
            self._prune()
        return final

    def _commit_gathered(self, tmp: Path, final: Path, meta: SaveMeta, sync: FileSync) -> str | None:
        """Rank 0: the manifest from every rank's digests, then the commit; the error, if any."""
        gathered = sync.wait("digests", range(sync.world), f"checksums of {final.name}")
        error = next((d for d in gathered if isinstance(d, str)), None)
        if error is None:
            try:
                self._commit(tmp, final, meta, {rel: d for part in gathered for rel, d in part.items()})
            except OSError as exc:
                error = f"checkpoint at step {meta.step}: {exc.strerror or exc} while committing"
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return error

    def _commit(self, tmp: Path, final: Path, meta: SaveMeta, files: dict[str, Any]) -> None:
        manifest = {
            "step": meta.step,
            "world_size": meta.world_size,
            "recipe_hash": meta.recipe_hash,
            "zero_stage": meta.zero_stage,
            "layout": meta.layout,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": dict(sorted(files.items())),
        }
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
