"""Ranks that wait for each other through files on the run's shared filesystem, not inside a collective.

Why: every collective fails once it has waited the process-group timeout (deepspeed.timeout_minutes;
DeepSpeed's own default is 10 minutes). Work whose length grows with the checkpoint must therefore
never run on some ranks while the others sit inside one: at 70B a ZeRO-3 checkpoint holds ~790 GiB
(12 bytes per parameter), sha256 reads 1.3-1.9 GiB/s on one core, and DeepSpeed's universal
conversion of it takes about an hour (planning/speed/checkpoint_cost.py). So the ranks post their results
as small JSON files in a directory beside the checkpoints (the filesystem checkpoints already need
to be shared by every node) and poll for each other's files.

A waiter must still notice a rank that died or hangs, as a collective would. Every rank that
others may wait for keeps a heartbeat file fresh while it works (`working()`); a waiter gives up
with one line when the heartbeat it waits on has not changed for the patience (the process-group
timeout). Time is measured on the waiter's own clock between changes it sees, so clocks of other
nodes do not matter, and a slow rank is never mistaken for a dead one.

One `FileSync` serves one exchange (a save, the choice of a checkpoint, a conversion). Opening it
takes two small collectives that all ranks reach at the same point: rank 0 names a fresh
directory, and once every rank has arrived (so each is done with the exchanges before, having read
what it waited for) removes the earlier ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.errors import UserError

if TYPE_CHECKING:  # an exchange only calls the collective it is handed; verifying needs no torch
    from llm_train.runtime.base.collectives import Collectives

SYNC_DIR = ".sync"
BEAT_S = 2.0  # heartbeat period; patience is at least a few beats (see __init__)
# Polls start fast (a save's exchange takes milliseconds) and back off to one a second: hundreds of
# ranks polling a shared filesystem's metadata server must not flood it during an hour of conversion.
POLL_FIRST_S, POLL_MAX_S = 0.02, 1.0


class RankSilent(UserError):
    """A rank showed no sign of life for the patience: it died or hangs."""


class FileSync:
    """Post and wait for small JSON values between ranks, through one directory."""

    def __init__(self, directory: Path, rank: int, world: int, patience_s: float) -> None:
        self.dir, self.rank, self.world = directory, rank, world
        self.patience_s = max(patience_s, 3 * BEAT_S)

    @classmethod
    def open(cls, root: Path, purpose: str, comm: Collectives, rank: int, patience_s: float) -> FileSync:
        """A fresh exchange under root/.sync/ (one collective, on every rank)."""
        parent = Path(root) / SYNC_DIR
        name = None
        if rank == 0:
            name = f"{purpose}-{uuid.uuid4().hex[:12]}"
            (parent / name).mkdir(parents=True)
        name = comm.from_rank0(name)
        comm.barrier()  # every rank has left its earlier exchanges: their files may go
        if rank == 0:
            for old in parent.iterdir():
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        return cls(parent / name, rank, comm.size, patience_s)

    def _file(self, key: str, rank: int) -> Path:
        return self.dir / f"{key}.rank{rank:05d}.json"

    def _beat_file(self, rank: int) -> Path:
        return self.dir / f"heartbeat.rank{rank:05d}"

    def post(self, key: str, value: Any) -> None:
        """This rank's `value` under `key`, written atomically (readers see all of it or nothing)."""
        path = self._file(key, self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Keep this rank's heartbeat fresh while the body runs (others may be waiting on it)."""
        stop = threading.Event()
        beats = 0

        def beat() -> None:
            nonlocal beats
            while True:
                beats += 1
                with contextlib.suppress(OSError):  # a missed beat is caught by the next one
                    self._beat_file(self.rank).write_text(str(beats))
                if stop.wait(BEAT_S):
                    return

        thread = threading.Thread(target=beat, name="llm_train-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def wait(self, key: str, ranks: Iterable[int], what: str) -> list[Any]:
        """The values `ranks` posted under `key`, in that order; RankSilent if one goes quiet.

        `what` names the work waited for, for the one-line error.
        """
        wanted = list(ranks)
        pending = list(wanted)
        values: dict[int, Any] = {}
        poll = POLL_FIRST_S
        seen: dict[int, tuple[str | None, float]] = {r: (None, time.monotonic()) for r in pending}
        while pending:
            for r in list(pending):
                path = self._file(key, r)
                if path.is_file():
                    values[r] = json.loads(path.read_text())
                    pending.remove(r)
                    continue
                try:
                    beat: str | None = self._beat_file(r).read_text()
                except OSError:
                    beat = None
                last, since = seen[r]
                now = time.monotonic()
                if beat != last:
                    seen[r] = (beat, now)
                elif now - since > self.patience_s:
                    raise RankSilent(
                        f"rank {r} showed no sign of life for {self.patience_s:.0f}s while rank {self.rank} "
                        f"waited for its {what} ({self.dir}); it died or hangs: see its log, and raise "
                        "deepspeed.timeout_minutes if it was only slow"
                    )
            if pending:
                time.sleep(poll)
                poll = min(POLL_MAX_S, poll * 1.5)
        return [values[r] for r in wanted]
