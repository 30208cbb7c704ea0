"""Cases in time boxes, under every prepared GPU check: `Case`, `Budget`, `Context`, `run_cases`, and the options
every check takes (`check_arguments`).

A check is a list of `Case`s (bench/consumer.py, bench/full_ft.py, bench/mfu_matrix.py); `run_cases`
runs them in order inside one `Budget`, each in its own time box, and writes each case's JSON line the
moment it ends (bench/result_files.py `Results`). A case launches real `python llm_train/train.py` processes
through bench/launch.py `launch`, which polls them (bench/watch.py) and stops them when told; its numbers
are judged with bench/verdicts.py against the planner's estimate for the same configuration
(bench/estimates.py, +-15%) and against targets.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.result_files import Results
from bench.verdicts import Judging


class Budget:
    """One deadline for a whole part; each case's time box is capped by what is left."""

    def __init__(self, seconds: float, started: float | None = None) -> None:
        self.seconds = seconds
        self.deadline = (started or time.time()) + seconds

    def left(self) -> float:
        return self.deadline - time.time()

    def timeout(self, box: float) -> float:
        return max(0.0, min(box, self.left()))


@dataclass
class Context:
    """What every case of one run reads: its sizes (GPU or --cpu-tiny), work folder, budget, results."""

    gpu: bool
    work: Path
    budget: Budget
    results: Results
    judging: Judging
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # the lines so far, by name
    state: dict[str, Any] = field(default_factory=dict)  # what a section's cases share (made once)
    box_s: float = 0.0  # the running case's time box (run_cases sets it)

    def timeout(self, share: float = 1.0) -> float:
        """What the running case may still spend on a launch: its box (times `share`), within the budget."""
        return self.budget.timeout(self.box_s * share)


@dataclass(frozen=True)
class Case:
    """One line of a check: what it is assumed to cost on the GPU, its time box, and how it runs.

    `cost_s` is the time the code assumes (bench/gpu_run.py's parts are sized from them, and a test holds
    every part's boxes within its limit); `box_s` is the most the case may take. A required case always
    runs; an optional one runs only while the budget holds its cost, and otherwise is a deferred line
    (passed None: left to the next part or visit, no failure). `cpu_box_s` is the box under --cpu-tiny
    (a 2-core CI machine, shared). `cleanup` names folders of the work directory removed after the
    case, whatever happened (checkpoints, exports, a base model on a 64 GiB disk).
    """

    name: str
    run: Callable[[Context], dict[str, Any]]
    cost_s: float
    box_s: float
    optional: bool = False
    cleanup: tuple[str, ...] = ()
    cpu_box_s: float = 600.0


def run_cases(cases: list[Case], ctx: Context) -> None:
    for case in cases:
        left = ctx.budget.left()
        record: dict[str, Any] = {"measurement": case.name}
        if case.optional and left < case.cost_s:
            record.update(passed=None, deferred=f"needs ~{case.cost_s:.0f}s, {max(0.0, left):.0f}s left")
        elif left <= 0:
            record.update(passed=False, error="not run: the budget is spent")
        else:
            ctx.box_s = case.box_s if ctx.gpu else case.cpu_box_s
            ctx.results.current = case.name
            try:
                record = {"measurement": case.name, **case.run(ctx)}
            except Exception as exc:  # a broken case must not take the others with it
                record.update(passed=False, error=f"{type(exc).__name__}: {exc}"[:1000])
            finally:
                ctx.results.current = None
        ctx.done[case.name] = ctx.results.add(record)
        for name in (case.name, *case.cleanup):
            shutil.rmtree(ctx.work / name, ignore_errors=True)


def check_arguments(description: str) -> argparse.ArgumentParser:
    """The options every check takes: --cpu-tiny, --out, --only NAME..., --budget-s, --expect."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--cpu-tiny", action="store_true", help="Tiny model on CPU: checks the script, not a GPU."
    )
    parser.add_argument("--out", type=Path, help="Output folder (default: $OUT, else bench/results/).")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="Run only these cases, in order.")
    parser.add_argument("--budget-s", type=float, help="Deadline for the whole run (default: the part's).")
    parser.add_argument(
        "--expect",
        nargs="+",
        default=[],
        metavar="NAME.QUANTITY=VALUE",
        help="Replace the planner's estimate of QUANTITY in case NAME and judge it, also under --cpu-tiny "
        "(a test hook: a wrong estimate must fail that line).",
    )
    return parser


def injected(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            parser.error(f"--expect {item}: give NAME.QUANTITY=NUMBER")
    return out
