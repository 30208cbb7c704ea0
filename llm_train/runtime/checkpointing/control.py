"""When to checkpoint and when to stop: the schedule, stop signals, and agreement across ranks.

SIGTERM and SIGUSR1 (what SLURM sends ahead of preemption with --signal) only set a flag;
the current step finishes, then all ranks agree (the flags ride on the loop's one all-reduce
per step) on stopping
after that same step, a checkpoint is committed, and the run exits with EXIT_PREEMPTED.

The signal also starts the grace clock (`checkpoint.grace_s`): the scheduler kills the job
for good some time after its warning signal, so a step or a save that would outlast the
budget is cut short by exiting EXIT_PREEMPTED at once. That is safe at any moment: `latest`
is only replaced once a checkpoint is complete, so it still names the previous one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from llm_train.errors import EXIT_PREEMPTED


class RunControl:
    def __init__(
        self,
        every_steps: int,
        every_minutes: float,
        clock: Callable[[], float] = time.monotonic,
        grace_s: float | None = None,
        exit_now: Callable[[int], None] = os._exit,
    ) -> None:
        self.every_steps, self.every_s, self.clock = every_steps, every_minutes * 60.0, clock
        self.last_save = clock()
        self.stop_signal: int | None = None
        self.grace_s, self.exit_now = grace_s, exit_now
        self.saved_after_stop = False
        self._grace: threading.Timer | None = None

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum
        if self.grace_s and self._grace is None:
            # A thread, not SIGALRM: the main thread may sit inside a collective or a write for
            # the whole budget, where a Python signal handler would never run.
            self._grace = threading.Timer(self.grace_s, self._grace_over)
            self._grace.daemon = True
            self._grace.start()

    def _grace_over(self) -> None:
        if not self.saved_after_stop:
            print(
                f"llm-train: checkpoint.grace_s={self.grace_s:g} ran out after signal {self.stop_signal} "
                "before the checkpoint was committed; exiting now, `latest` names the previous complete "
                "checkpoint (raise checkpoint.grace_s, or the scheduler's warning time, to save more)",
                file=sys.stderr,
                flush=True,
            )
        self.exit_now(EXIT_PREEMPTED)

    def local_flags(self) -> list[float]:
        """[stop requested, checkpoint due by time] as this rank sees them (ranks may differ)."""
        due_by_time = self.every_s > 0 and self.clock() - self.last_save >= self.every_s
        return [float(self.stop_signal is not None), float(due_by_time)]

    def decide(self, step: int, any_rank_flags: list[bool]) -> tuple[bool, bool]:
        """(save_now, stop_now) from the flags reduced over all ranks: identical on every rank."""
        stop, due_by_time = any_rank_flags
        due_by_step = self.every_steps > 0 and step % self.every_steps == 0
        return (stop or due_by_time or due_by_step), stop

    def saved(self) -> None:
        self.last_save = self.clock()
        self.saved_after_stop = self.stop_signal is not None
