"""Where metrics go: metrics.jsonl always, W&B when the recipe asks; one interface for both.

The loop calls `tracker.log(...)` unconditionally; on ranks other than 0, and with W&B
disabled, the calls are cheap no-ops, so call sites never branch on which tracker is on.
W&B is imported only when it is used.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

from llm_train.recipe import TrackingSection

# Never store anything that looks like a credential in a config that leaves the machine.
_SECRET_KEY = re.compile(r"(api[_-]?key|token|secret|password)", re.IGNORECASE)


def redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("<redacted>" if _SECRET_KEY.search(str(k)) else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker:
    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.handle.write(json.dumps({"step": step, **metrics}) + "\n")
        self.handle.flush()  # a crash must not lose the metrics logged so far

    def close(self) -> None:
        self.handle.close()


class WandbTracker:
    def __init__(self, tracking: TrackingSection, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=tracking.project,
            entity=tracking.entity,
            name=tracking.run_name or run_dir.name,
            tags=tracking.tags,
            group=tracking.group,
            mode=tracking.mode,
            dir=str(run_dir),
            config=redact(config),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Fans every call out to the active trackers."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(
    tracking: TrackingSection, run_dir: Path, config: dict[str, Any], is_main: bool
) -> Trackers:
    if not is_main:
        return Trackers([NullTracker()])
    trackers: list[Tracker] = [JsonlTracker(run_dir / "metrics.jsonl")]
    if tracking.mode != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")
        trackers.append(WandbTracker(tracking, run_dir, config))
    return Trackers(trackers)
