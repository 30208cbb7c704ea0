"""Where metrics go: metrics.jsonl always, TensorBoard and W&B when the recipe asks; one interface.

Each tracker is one row of `OPENERS` below (how it is opened), keyed by the names of config/trackers.py `TRACKERS`
(when a recipe turns it on, the keys it reads, what it writes); docs/development.md, "Adding a tracker".

The loop calls `tracker.log(...)` unconditionally; on ranks other than 0 the call is a
no-op, so call sites never branch on which tracker is on. W&B and TensorBoard are
imported only when they are used (a disabled W&B never costs its import time, and a
machine without it still trains).

Secrets: the run config sent to W&B/TensorBoard is redacted by key name (api_key, token,
secret, password, ...) and by value (the values of credential environment variables such
as WANDB_API_KEY or HF_TOKEN are replaced wherever they appear), and W&B records a
redacted command line, since overrides like `model.config.hub_token=...` would otherwise
reach its metadata.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from llm_train.config.credentials import is_secret_key
from llm_train.config.recipe_sections import TrackingSection
from llm_train.config.trackers import trackers_on
from llm_train.errors import UserError

REDACTED = "<redacted>"
BENCH = "bench/"  # benchmark results' keys: bench/TASK/METRIC


def secret_values() -> list[str]:
    """Values of credential-like environment variables (WANDB_API_KEY, HF_TOKEN, ...) worth scrubbing."""
    return sorted(
        {v for k, v in os.environ.items() if is_secret_key(k) and len(v) >= 8},
        key=len,
        reverse=True,  # longest first, so a secret containing another is replaced whole
    )


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of `value` with credential-like keys and credential environment values replaced."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_key(str(k)) else redact(v, secrets)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        return _scrub(value, secrets)
    return value


def redact_argv(argv: list[str], secrets: list[str] | None = None) -> list[str]:
    """Command-line words with `key=value` overrides of secret keys and secret values redacted."""
    secrets = secret_values() if secrets is None else secrets
    out = []
    for word in argv:
        key, eq, _ = word.partition("=")
        if eq and is_secret_key(key.split(".")[-1].lstrip("-")):
            word = f"{key}={REDACTED}"
        out.append(_scrub(word, secrets))
    return out


@contextlib.contextmanager
def _argv_redacted() -> Iterator[None]:
    # W&B copies sys.argv into the run's metadata when it starts; show it only a redacted copy.
    saved = sys.argv
    sys.argv = redact_argv(sys.argv)
    try:
        yield
    finally:
        sys.argv = saved


class Tracker(Protocol):
    run_id: str | None  # the W&B run's id; None for every other tracker

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    run_id: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker:
    """metrics.jsonl: one JSON object per call, flushed at once (a crash loses nothing logged).

    A table (GRPO's sampled completions) goes to its own KEY.jsonl beside it, one row per line with its step.
    """

    run_id: str | None = None

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.handle = path.open("a", encoding="utf-8")
        self.tables: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.handle.write(json.dumps({"step": step, **metrics}) + "\n")
        self.handle.flush()

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        if key not in self.tables:
            self.tables[key] = self.path.with_name(f"{key}.jsonl").open("a", encoding="utf-8")
        handle = self.tables[key]
        handle.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        handle.flush()

    def close(self) -> None:
        self.handle.close()
        for handle in self.tables.values():
            handle.close()


PERF_KEYS = (
    "tokens_per_s",
    "slot_tokens_per_s",
    "tokens_per_s_per_gpu",
    "samples_per_s",
    "step_time_s",
    "mfu",
    "mfu_seq_len",
    "attention_span",
    "startup_s",
)


def tensorboard_tag(key: str) -> str:
    """Group the flat metric names into TensorBoard sections (train/, eval/, perf/, memory/).

    A name that has its sections already (bench/TASK/METRIC: runtime/benchmark.py) keeps them.
    """
    if "/" in key:
        return key
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith(("gpu_mem", "host_rss")):
        return f"memory/{key}"
    if key in PERF_KEYS:
        return f"perf/{key}"
    return f"train/{key}"


def _cell(value: Any) -> str:
    """A markdown table cell: pipes and newlines would break the row."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


class TensorBoardTracker:
    run_id: str | None = None

    def __init__(self, log_dir: Path, config: dict[str, Any] | None, start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(
                "tracking.tensorboard=true needs the tensorboard package: pip install tensorboard "
                f"(or set tracking.tensorboard=false) [{exc}]"
            ) from None
        # On resume, events logged after the checkpoint by the interrupted run are dropped.
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(redact(config), indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tensorboard_tag(key), value, step)
        self.writer.flush()

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        if rows:  # TensorBoard has no tables: a markdown one in its text tab
            head = list(rows[0])
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(_cell(row.get(k)) for k in head) + " |" for row in rows]
            self.writer.add_text(key, "\n".join(lines), step)
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    _bench_axis = False  # bench/* plotted against bench/step: defined once, at its first log

    def __init__(
        self,
        tracking: TrackingSection,
        run_dir: Path,
        config: dict[str, Any] | None,
        run_id: str | None = None,
    ) -> None:
        import wandb

        with _argv_redacted():
            self.run = wandb.init(
                project=tracking.project,
                entity=tracking.entity,
                name=tracking.run_name or run_dir.name,
                tags=tracking.tags,
                group=tracking.group,
                mode=tracking.mode,
                dir=str(run_dir),
                config=redact(config) if config is not None else None,
                # Resume continues the same W&B run: the checkpoint stores `run_id` and passes it back.
                id=run_id,
                resume="allow" if run_id else None,
            )
        self.run_id: str | None = self.run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if metrics and all(key.startswith(BENCH) for key in metrics):
            # Benchmark results (runtime/benchmark.py) may come after the run has logged later steps
            # (`llm-train eval` of an older checkpoint), and W&B drops a step below its last: they
            # carry their own x-axis, the step of the weights they measure.
            if not self._bench_axis:
                self.run.define_metric(f"{BENCH}*", step_metric=f"{BENCH}step")
                self._bench_axis = True
            self.run.log({**metrics, f"{BENCH}step": step})
            return
        self.run.log(metrics, step=step)

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        if rows:
            head: list[str | int] = list(rows[0])
            self.run.log(
                {key: wandb.Table(columns=head, data=[[r.get(str(k)) for k in head] for r in rows])},
                step=step,
            )

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before W&B's service has written the run file; teardown waits for it,
        # so an offline run directory is complete when training reports success.
        wandb.teardown()


class Trackers:
    """Fans every call out to the active trackers."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @property
    def run_id(self) -> str | None:
        """The W&B run id (None without W&B): store it in checkpoints, pass it back on resume."""
        return next((t.run_id for t in self.trackers if t.run_id), None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of one table (each a dict of the same keys) at `step`: KEY.jsonl, a W&B table, TensorBoard text."""
        for tracker in self.trackers:
            tracker.log_table(key, rows, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


# (tracking section, run directory, run config or None, W&B run id to resume, step resumed from) -> the tracker.
Open = Callable[[TrackingSection, Path, dict[str, Any] | None, str | None, int], Tracker]


def _wandb(
    tracking: TrackingSection,
    run_dir: Path,
    config: dict[str, Any] | None,
    run_id: str | None,
    start_step: int,
) -> Tracker:
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbTracker(tracking, run_dir, config, run_id)


# Every tracker, by its name in config/trackers.py `TRACKERS` (tests/unit/test_tracker_registry.py: the same names).
OPENERS: dict[str, Open] = {
    "jsonl": lambda tracking, run_dir, config, run_id, start_step: JsonlTracker(run_dir / "metrics.jsonl"),
    "tensorboard": lambda tracking, run_dir, config, run_id, start_step: TensorBoardTracker(
        run_dir / "tensorboard", config, start_step
    ),
    "wandb": _wandb,
}


def open_trackers(
    tracking: TrackingSection,
    run_dir: Path,
    config: dict[str, Any] | None,
    is_main: bool,
    run_id: str | None = None,
    start_step: int = 0,
) -> Trackers:
    """The trackers of this rank: nothing off rank 0; else metrics.jsonl plus what the recipe enables.

    `run_id` and `start_step` come from a checkpoint when resuming: W&B continues that run and
    TensorBoard drops the interrupted run's events after `start_step`. `config` None records none:
    results added to a finished run (`llm-train eval`) leave the configuration training recorded.
    """
    if not is_main:
        return Trackers([NullTracker()])
    return Trackers(
        [OPENERS[spec.name](tracking, run_dir, config, run_id, start_step) for spec in trackers_on(tracking)]
    )
