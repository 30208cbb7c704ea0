"""Ranks waiting through files (runtime/checkpointing/file_sync.py), and the hashing split that uses them (checkpointing/commit.py).

Two ranks are two FileSync objects on one directory, each in its own thread: the waiting logic
is the same as across processes (files and a monotonic clock), without a process group.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import llm_train.runtime.checkpointing.file_sync as file_sync
from llm_train.runtime.checkpointing.commit import (
    MANIFEST,
    build_manifest,
    share,
    verify,
    verify_shared,
    write_atomic,
)
from llm_train.runtime.checkpointing.file_sync import FileSync, RankSilent


@pytest.fixture(autouse=True)
def fast_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_sync, "BEAT_S", 0.05)  # patience floor 3 x 0.05 s: tests take tenths of seconds


def _pair(directory: Path, patience_s: float) -> tuple[FileSync, FileSync]:
    directory.mkdir(parents=True, exist_ok=True)
    return FileSync(directory, 0, 2, patience_s), FileSync(directory, 1, 2, patience_s)


def test_a_rank_slower_than_the_patience_but_alive_is_waited_for(tmp_path: Path) -> None:
    zero, one = _pair(tmp_path, patience_s=0.3)

    def slow_rank_one() -> None:
        with one.working():
            time.sleep(1.0)  # three times the patience: only the heartbeat keeps the waiter waiting
            one.post("digests", {"a": 1})

    thread = threading.Thread(target=slow_rank_one)
    started = time.monotonic()
    thread.start()
    zero.post("digests", {"b": 2})
    assert zero.wait("digests", [0, 1], "checksums") == [{"b": 2}, {"a": 1}]
    thread.join()
    assert time.monotonic() - started >= 1.0


def test_a_silent_rank_fails_the_wait_after_the_patience_in_one_line(tmp_path: Path) -> None:
    zero, _ = _pair(tmp_path, patience_s=0.3)
    started = time.monotonic()
    with pytest.raises(RankSilent) as info:
        zero.wait("outcome", [1], "commit of step-00000002")
    waited = time.monotonic() - started
    assert 0.3 <= waited < 3.0, waited
    message = str(info.value)
    assert "\n" not in message and "rank 1 showed no sign of life" in message
    assert "commit of step-00000002" in message and "deepspeed.timeout_minutes" in message


def test_a_rank_whose_heartbeat_stops_fails_the_wait(tmp_path: Path) -> None:
    zero, one = _pair(tmp_path, patience_s=0.3)
    with one.working():
        time.sleep(0.2)  # beats, then stops without posting: it died
    with pytest.raises(RankSilent, match="rank 1 showed no sign of life"):
        zero.wait("outcome", [1], "conversion")


def test_shares_cover_every_file_once_and_split_the_bytes_evenly() -> None:
    sizes = {f"state/ds/shard{i}.pt": (i % 7 + 1) * 1000 for i in range(40)} | {"trainer/r0.json": 10}
    shares = [share(sizes, rank, 4) for rank in range(4)]
    assert sorted(f for part in shares for f in part) == sorted(sizes)
    loads = [sum(sizes[f] for f in part) for part in shares]
    assert max(loads) - min(loads) <= max(sizes.values()), loads  # within one file of even
    assert share(sizes, 2, 4) == shares[2]  # the same on every rank


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "step-00000001"
    for i in range(6):
        (ckpt / "state").mkdir(parents=True, exist_ok=True)
        (ckpt / "state" / f"f{i}.pt").write_bytes(bytes([i]) * (1000 * (i + 1)))
    import json

    write_atomic(ckpt / MANIFEST, json.dumps(build_manifest(ckpt, {"step": 1})))
    return ckpt


def _verify_on_two_ranks(ckpt: Path, sync_dir: Path) -> list[str | None]:
    syncs = _pair(sync_dir, patience_s=5.0)
    answers: list[str | None | Exception] = [RuntimeError("not run")] * 2

    def rank(r: int) -> None:
        try:
            answers[r] = verify_shared(ckpt, syncs[r], "verify0")
        except Exception as exc:  # reported by the assert below, not lost in the thread
            answers[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [a for a in answers if isinstance(a, Exception)], answers
    return answers  # type: ignore[return-value]


def test_split_verification_finds_damage_in_the_other_ranks_share(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    assert _verify_on_two_ranks(ckpt, tmp_path / "sync-ok") == [None, None]
    sizes = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in (ckpt / "state").iterdir()}
    victim = ckpt / share(sizes, 1, 2)[0]  # a file only rank 1 hashes
    victim.write_bytes(b"x" * victim.stat().st_size)  # same size, other content
    answers = _verify_on_two_ranks(ckpt, tmp_path / "sync-damaged")
    assert (
        answers[0]
        == answers[1]
        == f"{victim.relative_to(ckpt).as_posix()} checksum differs from the manifest"
    )
    assert verify(ckpt) == answers[0]  # the split check says what the one-process check says
