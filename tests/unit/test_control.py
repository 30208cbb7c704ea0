"""RunControl: checkpoint cadence, stop signals, and the grace budget after a stop signal."""

from __future__ import annotations

import signal
import threading

import pytest

from llm_train.errors import EXIT_PREEMPTED
from llm_train.runtime.checkpointing.control import RunControl


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def test_grace_over_before_the_save_commits_exits_preempted_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    exits = Exits()
    control = RunControl(0, 0.0, grace_s=0.05, exit_now=exits)
    control._on_signal(signal.SIGTERM, None)
    assert control.local_flags()[0] == 1.0  # the loop still sees the stop request
    assert exits.done.wait(5)
    assert exits.codes == [EXIT_PREEMPTED]
    err = capsys.readouterr().err
    assert "checkpoint.grace_s=0.05 ran out" in err and len(err.strip().splitlines()) == 1


def test_a_save_committed_in_time_ends_quietly_when_the_budget_runs_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    exits = Exits()
    control = RunControl(0, 0.0, grace_s=0.05, exit_now=exits)
    control._on_signal(signal.SIGUSR1, None)
    control.saved()  # the stop checkpoint was committed
    assert exits.done.wait(5)
    assert exits.codes == [EXIT_PREEMPTED] and capsys.readouterr().err == ""


def test_no_signal_no_clock_and_a_second_signal_does_not_restart_it() -> None:
    exits = Exits()
    control = RunControl(0, 0.0, grace_s=0.2, exit_now=exits)
    assert not exits.done.wait(0.3) and control._grace is None
    control._on_signal(signal.SIGTERM, None)
    first = control._grace
    control._on_signal(signal.SIGTERM, None)
    assert control._grace is first
    assert exits.done.wait(5) and exits.codes == [EXIT_PREEMPTED]


def test_cadence_by_steps_and_stop_flags_agree_across_ranks() -> None:
    control = RunControl(every_steps=3, every_minutes=0.0)
    assert control.decide(3, [False, False]) == (True, False)
    assert control.decide(4, [False, False]) == (False, False)
    assert control.decide(4, [True, False]) == (True, True)  # another rank was signalled
    assert control.decide(5, [False, True]) == (True, False)  # another rank's clock says it is time
