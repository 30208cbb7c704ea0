"""When to checkpoint and when to stop: the schedule, stop signals, and agreement across ranks.

SIGTERM and SIGUSR1 (what SLURM sends ahead of preemption with --signal) only set a flag;
the current step finishes, then all ranks agree (one MAX all-reduce per step) on stopping
after that same step, a checkpoint is committed, and the run exits with EXIT_PREEMPTED.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a committed checkpoint; resume with --resume auto


class RunControl:
    def __init__(
        self,
        every_steps: int,
        every_minutes: float,
        any_rank: Callable[[bool], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps, self.every_s = every_steps, every_minutes * 60.0
        self.any_rank, self.clock = any_rank, clock
        self.last_save = clock()
        self.stop_signal: int | None = None

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def after_step(self, step: int) -> tuple[bool, bool]:
        """(save_now, stop_now), identical on every rank."""
        # Ranks read the clock and receive signals at different moments: agree on one answer.
        due_by_time = self.every_s > 0 and self.clock() - self.last_save >= self.every_s
        stop = self.any_rank(self.stop_signal is not None)
        due_by_time = self.any_rank(due_by_time) if self.every_s > 0 else False
        due_by_step = self.every_steps > 0 and step % self.every_steps == 0
        return (stop or due_by_time or due_by_step), stop

    def saved(self) -> None:
        self.last_save = self.clock()
