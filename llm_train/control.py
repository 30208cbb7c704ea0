"""When to checkpoint and when to stop: the schedule, stop signals, and agreement across ranks.

SIGTERM and SIGUSR1 (what SLURM sends ahead of preemption with --signal) only set a flag;
the current step finishes, then all ranks agree (the flags ride on the loop's one all-reduce
per step) on stopping
after that same step, a checkpoint is committed, and the run exits with EXIT_PREEMPTED.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a committed checkpoint; resume with --resume auto


class RunControl:
    def __init__(
        self, every_steps: int, every_minutes: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_steps, self.every_s, self.clock = every_steps, every_minutes * 60.0, clock
        self.last_save = clock()
        self.stop_signal: int | None = None

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

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

    def after_step(self, step: int, any_rank: Callable[[bool], bool]) -> tuple[bool, bool]:
        """For loops without a per-step collective of their own (the pipeline engine's)."""
        return self.decide(step, [any_rank(bool(flag)) for flag in self.local_flags()])
