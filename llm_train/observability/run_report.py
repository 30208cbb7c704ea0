"""`llm-train report RUN_DIR [RUN_DIR ...]`: PNG plots and a markdown summary of runs.

Reads only metrics.jsonl (and startup.json when present), so it works on a run that is
still training, on a copy of a run directory, and on a machine without torch or GPUs.
Several runs go on the same axes, one colour per run, to compare them.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOTS = ("loss", "lr", "throughput", "memory")


@dataclass
class RunMetrics:
    label: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)  # rows with a training loss
    evals: list[dict[str, Any]] = field(default_factory=list)  # rows with an eval loss
    startup: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        rows = self.train if rows is None else rows
        points = [(r["step"], float(r[key])) for r in rows if _finite(r.get(key))]
        return [p[0] for p in points], [p[1] for p in points]

    def steady(self, key: str) -> list[float]:
        """Values of `key` without the first logged row (it carries warm-up and compilation)."""
        values = self.series(key)[1]
        return values[1:] if len(values) > 1 else values


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_run(path: Path, label: str | None = None) -> RunMetrics:
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl here; pass a run directory (the --output-dir of a run)")
    run = RunMetrics(label or path.name, path)
    lines = [line for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    for index, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break  # a run killed mid-write leaves a partial last line; everything before it is good
            raise UserError(f"{metrics}: line {index + 1} is not valid JSON") from None
        if "loss" in row:
            run.train.append(row)
        if "eval_loss" in row:
            run.evals.append(row)
    startup = path / "startup.json"
    if startup.is_file():
        run.startup = json.loads(startup.read_text())
    return run


def _labels(paths: list[Path]) -> list[str]:
    # Run directories are often all called "run" or "final" in different parents: label by the
    # shortest path suffix that tells them apart.
    for depth in range(1, 6):
        labels = ["/".join(p.resolve().parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed (servers, CI)
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "llm-train report needs matplotlib: pip install matplotlib (or 'llm_train[report]')"
        ) from None
    return plt


def plot_runs(runs: list[RunMetrics], out: Path) -> list[Path]:
    """One PNG per plot in PLOTS (memory and MFU only when some run logged them); returns the files."""
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    def save(fig: Figure, ax: Axes, name: str, ylabel: str) -> None:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        ax.plot(*run.series("loss"), color=color, label=f"{run.label} train")
        steps, values = run.series("eval_loss", run.evals)
        if steps:
            ax.plot(steps, values, color=color, linestyle="--", marker="o", label=f"{run.label} eval")
    ax.set_title("loss")
    save(fig, ax, "loss", "loss")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, run in enumerate(runs):
        ax.plot(*run.series("lr"), color=colors[i % len(colors)], label=run.label)
    ax.set_title("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    save(fig, ax, "lr", "learning rate")

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        ax.plot(*run.series("tokens_per_s"), color=colors[i % len(colors)], label=run.label)
    ax.set_title("throughput (global)")
    save(fig, ax, "throughput", "tokens / s")

    if any(run.series("mfu")[0] for run in runs):
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for i, run in enumerate(runs):
            steps, values = run.series("mfu")
            ax.plot(steps, [100 * v for v in values], color=colors[i % len(colors)], label=run.label)
        ax.set_title("model FLOPs utilisation")
        save(fig, ax, "mfu", "MFU (%)")

    memory_keys = [
        ("gpu_mem_peak_gib", "GPU peak", "-"),
        ("gpu_mem_reserved_gib", "GPU reserved", "--"),
        ("host_rss_gib", "host RSS", ":"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        for key, name, style in memory_keys:
            steps, values = run.series(key)
            if steps:
                ax.plot(
                    steps, values, color=colors[i % len(colors)], linestyle=style, label=f"{run.label} {name}"
                )
    ax.set_title("memory (rank 0)")
    save(fig, ax, "memory", "GiB")
    if any(run.series("reward")[0] for run in runs):
        _plot_rl(runs, plt, colors, save)
    return written


# GRPO's plots beside the reward (TRL's metric names, runtime/rl/): (file, title, keys, y label).
RL_PLOTS = [
    (
        "completion_length",
        "completion length",
        ["completions/mean_length", "completions/max_length"],
        "tokens",
    ),
    ("kl", "KL to the reference", ["kl"], "k3 KL"),
    (
        "clip_ratio",
        "clip ratio",
        ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"],
        "fraction",
    ),
    ("entropy", "policy entropy", ["entropy"], "nats"),
]


def _plot_rl(runs: list[RunMetrics], plt: Any, colors: list[str], save: Callable[..., None]) -> None:
    """GRPO runs: the reward (the weighted sum, and each function's mean dashed), then RL_PLOTS' metrics
    that some run logged (kl only with grpo.beta > 0)."""
    styles = ["--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        ax.plot(*run.series("reward"), color=color, label=f"{run.label} reward")
        names = sorted(
            {k for row in run.train for k in row if k.startswith("rewards/") and k.endswith("/mean")}
        )
        for j, key in enumerate(names):
            name = key[len("rewards/") : -len("/mean")]
            ax.plot(*run.series(key), color=color, linestyle=styles[j % 3], label=f"{run.label} {name}")
    ax.set_title("reward (mean over the step's completions)")
    save(fig, ax, "reward", "reward")
    for name, title, keys, ylabel in RL_PLOTS:
        if not any(run.series(key)[0] for run in runs for key in keys):
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for i, run in enumerate(runs):
            for j, key in enumerate(keys):
                steps, values = run.series(key)
                if steps:
                    label = run.label if len(keys) == 1 else f"{run.label} {key.rpartition('/')[2]}"
                    ax.plot(
                        steps,
                        values,
                        color=colors[i % len(colors)],
                        linestyle=["-", *styles][j % 4],
                        label=label,
                    )
        ax.set_title(title)
        save(fig, ax, name, ylabel)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def train_seconds(elapsed: list[float]) -> float | None:
    """The training time of a run from its rows' elapsed_s, every launch of it counted.

    elapsed_s counts from each launch's own start (observability/metrics.py), so a resumed run's rows start
    again near 0: the time is the sum of each launch's last value (a resume truncates the rows after its
    checkpoint, so what a killed launch spent past that checkpoint is not in the file to count).
    """
    if not elapsed:
        return None
    ends = [before for before, after in zip(elapsed, elapsed[1:], strict=False) if after < before]
    return sum(ends) + elapsed[-1]


def summary_rows(run: RunMetrics) -> dict[str, str]:
    """The markdown summary's columns for one run."""
    last = run.train[-1] if run.train else {}
    best_eval = min(run.evals, key=lambda r: r["eval_loss"]) if run.evals else None
    final_eval = run.evals[-1] if run.evals else None
    peak_gpu = run.series("gpu_mem_peak_gib")[1]
    rss = run.series("host_rss_gib")[1]
    elapsed = train_seconds(run.series("elapsed_s")[1])
    return {
        "run": run.label,
        "steps": str(last.get("step", 0)),
        "final loss": _fmt(last.get("loss"), ".4f"),
        "best eval loss": f"{best_eval['eval_loss']:.4f} @ {best_eval['step']}" if best_eval else "-",
        "final eval ppl": _fmt(final_eval.get("eval_ppl") if final_eval else None, ".2f"),
        "tokens/s": _fmt(_median(run.steady("tokens_per_s")), ",.0f"),
        "tokens/s/GPU": _fmt(_median(run.steady("tokens_per_s_per_gpu")), ",.0f"),
        "MFU": _fmt(_median(run.steady("mfu")), ".1%"),
        "step time (s)": _fmt(_median(run.steady("step_time_s")), ".3f"),
        "peak GPU mem (GiB)": _fmt(max(peak_gpu) if peak_gpu else None, ".2f"),
        "peak host RSS (GiB)": _fmt(max(rss) if rss else None, ".2f"),
        "train time": _fmt(elapsed, ".0f") + ("s" if elapsed is not None else ""),
        "start-up (s)": _fmt(run.startup.get("total_s"), ".1f"),
    }


def write_summary(runs: list[RunMetrics], images: list[Path], out: Path) -> Path:
    rows = [summary_rows(run) for run in runs]
    header = list(rows[0])
    lines = [
        "# Training report",
        "",
        "Throughput, MFU and step time are medians over the logged steps after the first (warm-up);",
        "memory is rank 0's. Source: each run's metrics.jsonl.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(row[k] for k in header) + " |" for row in rows]
    startups = [run for run in runs if run.startup.get("phases_s")]
    if startups:
        lines += ["", "## Start-up (process start to the end of the first optimizer step, rank 0)", ""]
        for run in startups:
            phases = ", ".join(f"{k} {v:.1f}s" for k, v in run.startup["phases_s"].items())
            lines.append(f"- {run.label}: {run.startup['total_s']:.1f}s = {phases}")
    lines += ["", "## Plots", ""]
    lines += [f"![{image.stem}]({image.name})" for image in images]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_report(run_dirs: list[Path], out: Path | None = None) -> tuple[Path, list[Path]]:
    """Load the runs, write the PNGs and report.md; returns (report.md, PNGs)."""
    if not run_dirs:
        raise UserError("llm-train report: give at least one run directory")
    for path in run_dirs:
        if not path.is_dir():
            raise UserError(f"{path}: not a directory; pass run directories (the --output-dir of runs)")
    runs = [load_run(p, label) for p, label in zip(run_dirs, _labels(run_dirs), strict=True)]
    empty = [r.label for r in runs if not r.train]
    if empty:
        raise UserError(f"{', '.join(empty)}: metrics.jsonl has no training steps yet")
    out = out or (run_dirs[0] / "report" if len(run_dirs) == 1 else Path("report"))
    out.mkdir(parents=True, exist_ok=True)
    images = plot_runs(runs, out)
    return write_summary(runs, images, out), images
