"""A check's result files (the device tool brings back at most 8), written as it goes: NAME.jsonl (one
line per case, the moment it ends), NAME.log (each launch's command and output tail), NAME_summary.json; in
--out DIR or $OUT with those names, else dated in bench/results/. On SIGTERM / SIGINT `Results.stop` kills
the running launch, writes the case in progress as a failed line with its log tail, then the summary.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench.environment import REPO, not_the_lock, versions
from bench.launch import RUNNING, Launch, kill_group, log_tail
from bench.watch import round_floats

# The numbers a summary repeats per line, where a line has them.
SUMMARY_KEYS = (
    "skipped", "deferred", "error", "est_gpu_gib", "gpu_device_used_peak_gib", "gpu_mem_peak_gib", "est_host_gib",
    "host_pss_peak_gib", "est_step_time_s", "step_time_s", "tokens_per_s", "mfu", "ratio",
)  # fmt: skip


class Results:
    """NAME.jsonl (a line per case, written the moment it ends), NAME.log, NAME_summary.json."""

    def __init__(self, name: str, out: Path | None, dated_suffix: str = "") -> None:
        """In `out` (or $OUT: the device tool brings back its files, so fixed names), else dated in
        bench/results (which keeps every run)."""
        out = out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        if out is not None:
            stem = out / name
        else:
            stem = REPO / "bench" / "results" / f"{name}{dated_suffix}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.name = name
        self.jsonl, self.log = Path(f"{stem}.jsonl"), Path(f"{stem}.log")
        self.summary = Path(f"{stem}_summary.json")
        self.records: list[dict[str, Any]] = []
        self.current: str | None = None  # the case in progress
        self.started = time.time()
        self.context: dict[str, Any] = {}  # what the summary says besides the lines (setup, budget)
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        self.log.write_text("")

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        record = round_floats(record)
        self.records.append(record)
        with self.jsonl.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "tail"}), flush=True)
        return record

    def log_launch(self, title: str, run: Launch) -> None:
        self.log_text(f"{title}: rc {run.rc}, {run.wall_s:.1f}s, {run.action or 'ran to its end'}", run)

    def log_text(self, title: str, run: Launch | None = None, text: str | None = None) -> None:
        lines = (text if text is not None else run.output if run else "").splitlines()[-80:]
        with self.log.open("a") as handle:
            handle.write(f"===== {title}\n")
            if run is not None:
                handle.write(" ".join(run.cmd) + "\n")
            handle.write("\n".join(lines) + "\n\n")

    @property
    def failed(self) -> list[str]:
        return [r["measurement"] for r in self.records if r.get("passed") is False]

    def write_summary(self) -> dict[str, Any]:
        summary = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "check": self.name,
            **self.context,
            "passed": not self.failed,
            "failed": self.failed,
            "wall_s": round(time.time() - self.started, 1),
            "lines": {
                r["measurement"]: {
                    "passed": r.get("passed"),
                    **{k: r[k] for k in SUMMARY_KEYS if r.get(k) is not None},
                }
                for r in self.records
            },
            "versions": (ran := versions()),
            "not_the_lock": not_the_lock(ran),
        }
        self.summary.write_text(json.dumps(round_floats(summary), indent=2) + "\n")
        print(f"{self.name}: wrote {self.jsonl}, {self.summary.name}, {self.log.name}", flush=True)
        return summary

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        """Stopped from outside: the running launch goes, its case becomes a failed line with the launch's
        log tail, the summary is written, and this process exits 128 + signum."""
        tails = []
        for running in list(RUNNING):
            kill_group(running.proc)
            tails.append(log_tail(running.log))
        name = signal.Signals(signum).name
        if self.current is not None:
            tail = "\n".join(tails)
            self.log_text(f"{self.current}: stopped by {name}", text=tail)
            self.add(
                {
                    "measurement": self.current,
                    "passed": False,
                    "error": f"stopped by {name} after {time.time() - self.started:.0f}s of the check",
                    "tail": tail,
                }
            )
        self.write_summary()
        sys.exit(128 + signum)

    def stop_on_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
