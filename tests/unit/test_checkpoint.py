"""The checkpoint commit protocol, in one process: atomicity, verification, retention, faults."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.checkpointing.commit import (
    LATEST,
    Checkpointer,
    CheckpointIOError,
    SaveMeta,
    committed,
    find_resumable,
    verify,
)
from tests.workers import exit_with

FILES = [
    "state/ds/model_states.pt",
    "state/ds/optim_rank0.pt",
    "state/ds/optim_rank1.pt",
    "trainer/rank00000.json",
]


def _writer(step: int):
    def write(tmp: Path) -> None:
        for name in FILES:
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"{name} at step {step}".encode() * 100)

    return write


def _save(ckpt: Checkpointer, step: int) -> Path:
    return ckpt.save(
        SaveMeta(step, 2, "abc", 3, {"world_size": 2, "zero_stage": 3}), _writer(step), estimate_bytes=1000
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> Checkpointer:
    return Checkpointer(tmp_path / "checkpoints", rank=0, keep_last_n=2, collectives=Collectives())


def test_save_commits_with_manifest_and_latest(ckpt: Checkpointer) -> None:
    path = _save(ckpt, 5)
    assert path.name == "step-00000005" and verify(path) is None
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 2 and manifest["recipe_hash"] == "abc"
    assert set(manifest["files"]) == set(FILES)
    assert (ckpt.root / LATEST).read_text() == "step-00000005"
    assert not list(ckpt.root.glob(".tmp-*"))


def test_retention_keeps_n_and_never_the_latest(ckpt: Checkpointer) -> None:
    for step in (1, 2, 3, 4):
        _save(ckpt, step)
    assert [p.name for p in committed(ckpt.root)] == ["step-00000004", "step-00000003"]
    assert Checkpointer(ckpt.root, 0, keep_last_n=1, collectives=Collectives()).keep == 2  # at least 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_checkpoint_is_skipped_for_the_previous_good_one(ckpt: Checkpointer, damage: str) -> None:
    _save(ckpt, 1)
    newest = _save(ckpt, 2)
    shard = newest / FILES[1]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[7] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (newest / "manifest.json").unlink()
    warnings: list[str] = []
    assert find_resumable(ckpt.root, warnings.append) == ckpt.root / "step-00000001"
    assert len(warnings) == 1 and "skipping checkpoint" in warnings[0] and "step-00000002" in warnings[0]


def test_disk_full_while_writing_keeps_the_previous_checkpoint(ckpt: Checkpointer) -> None:
    _save(ckpt, 1)

    def full(tmp: Path) -> None:
        (tmp / "state").mkdir()
        (tmp / "state" / "part").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointIOError) as info:
        ckpt.save(SaveMeta(2, 2, "abc", 3, {"world_size": 2, "zero_stage": 3}), full, estimate_bytes=1000)
    message = str(info.value)
    assert "step 2" in message and "No space left on device" in message and "GiB" in message
    assert info.value.exit_code == 4
    assert not list(ckpt.root.glob(".tmp-*"))
    assert (ckpt.root / LATEST).read_text() == "step-00000001" and verify(ckpt.root / "step-00000001") is None


def test_free_space_checked_before_writing(ckpt: Checkpointer, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    _save(ckpt, 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(100, 90, 10))
    with pytest.raises(
        CheckpointIOError, match=r"checkpoint at step 2 needs about .* GiB but .* has 0.00 GiB free"
    ):
        _save(ckpt, 2)
    assert [p.name for p in committed(ckpt.root)] == ["step-00000001"]


def _save_step_2_crashing_at(crash_at: int, root: Path) -> int:
    """Save step 2 in a forked child that dies at its crash_at-th file operation (os._exit(9), as a
    kill -9 there); the child's exit code: 0 once crash_at is past the save's last file operation.

    Forked rather than a fresh interpreter per crash point (~2 CPU-s of imports each); the child only
    writes files and never returns into pytest.
    """
    import llm_train.runtime.checkpointing.commit as module

    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def body() -> int:
        calls = 0

        def counted(fn):
            def wrapper(*args, **kwargs):
                nonlocal calls
                calls += 1
                if calls == crash_at:
                    os._exit(9)
                return fn(*args, **kwargs)

            return wrapper

        Path.write_bytes = counted(Path.write_bytes)
        Path.write_text = counted(Path.write_text)
        module.os.replace = counted(os.replace)
        module.shutil.rmtree = counted(module.shutil.rmtree)
        _save(Checkpointer(root, 0, 2, Collectives()), 2)
        return 0

    exit_with(body)


def test_crash_at_every_file_operation_of_a_save_leaves_a_complete_latest(tmp_path: Path) -> None:
    crash_at, outcomes = 1, []
    while True:
        root = tmp_path / f"run{crash_at}" / "checkpoints"
        _save(Checkpointer(root, 0, 2, Collectives()), 1)  # step 1 committed
        code = _save_step_2_crashing_at(crash_at, root)
        found = find_resumable(root, lambda _m: None)
        assert found is not None and verify(found) is None, crash_at
        assert (root / LATEST).read_text() in ("step-00000001", "step-00000002")
        outcomes.append(found.name)
        if code == 0:  # crash_at is past the last file operation: the save completed
            assert found.name == "step-00000002"
            break
        assert code == 9
        crash_at += 1
    assert crash_at > len(FILES) + 2  # every shard write, the manifest, the rename and `latest` were hit
    assert "step-00000001" in outcomes and outcomes[-1] == "step-00000002"
