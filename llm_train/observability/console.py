"""What a run prints on rank 0: a start-up summary, one progress line per logged step, and
little else (observability/library_logs.py keeps DeepSpeed / torch / transformers chatter quiet
unless --verbose).

The progress line is plain text, one line per logged step, so it reads the same in a
terminal, a SLURM log and CI; its bar, ETA and tokens/s come from the metrics row the
trackers receive, so the console and metrics.jsonl never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llm_train.config.gpu_evidence import evidence_lines
from llm_train.config.trackers import trackers_on
from llm_train.planning.search.guards import RunEstimate, estimate_run, memory_rows

if TYPE_CHECKING:
    from llm_train.config.resolution import Resolved

BAR_WIDTH = 20


def duration(seconds: float) -> str:
    """1234 -> '20m34s'; short and fixed-format for progress lines."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def progress_line(step: int, max_steps: int, metrics: dict[str, Any], eta_s: float | None) -> str:
    """`step 120/1000 [##........] 12% | loss 2.3456 | lr 3.00e-04 | grad 0.812 | 41,230 tok/s | mfu 38.2% | eta 12m05s`"""
    done = step / max_steps if max_steps else 1.0
    filled = int(round(done * BAR_WIDTH))
    parts = [f"step {step}/{max_steps} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4.0%}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "lr" in metrics:
        parts.append(f"lr {metrics['lr']:.2e}")
    if metrics.get("grad_norm") is not None:
        parts.append(f"grad {metrics['grad_norm']:.3f}")
    if "reward_accuracy" in metrics:  # a preference objective (DPO, SimPO)
        parts.append(f"acc {metrics['reward_accuracy']:.2f} margin {metrics['reward_margin']:+.3f}")
    if "reward" in metrics:  # GRPO: the weighted reward, and each function's mean when there are several
        parts.append(reward_part(metrics))
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
    if "mfu" in metrics:
        mfu, full = metrics["mfu"], metrics.get("mfu_seq_len", metrics["mfu"])
        # Packed rows: the document-aware figure, and the row-width one most tools print beside it.
        parts.append(f"mfu {mfu:.1%}" + (f" ({full:.1%} at seq_len)" if abs(full - mfu) >= 5e-4 else ""))
    if "gpu_mem_peak_gib" in metrics:
        parts.append(f"mem {metrics['gpu_mem_peak_gib']:.1f} GiB")
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return " | ".join(parts)


def reward_part(metrics: dict[str, Any]) -> str:
    """`reward 0.750` or `reward 1.250 (format 0.500, correct 0.750)`: TRL's `reward` and `rewards/<name>/mean`."""
    each = {
        key[len("rewards/") : -len("/mean")]: value
        for key, value in metrics.items()
        if key.startswith("rewards/") and key.endswith("/mean")
    }
    said = f"reward {metrics['reward']:.3f}"
    if len(each) > 1:
        said += " (" + ", ".join(f"{name} {value:.3f}" for name, value in each.items()) + ")"
    return said


def bench_line(step: int, measured: dict[str, float]) -> str:
    """`step 20: bench llm_train_tiny acc 0.3125 ± 0.0830, acc_norm 0.4062 ± 0.0882 (4.1s, not in tokens/s)`."""
    tasks: dict[str, list[str]] = {}
    for key, value in measured.items():
        parts = key.split("/")  # bench/TASK/METRIC
        if len(parts) != 3 or parts[2].endswith("_stderr"):
            continue
        stderr = measured.get(f"{key}_stderr")
        tasks.setdefault(parts[1], []).append(
            f"{parts[2]} {value:.4f}" + (f" \u00b1 {stderr:.4f}" if stderr is not None else "")
        )
    said = "; ".join(f"{task} {', '.join(values)}" for task, values in tasks.items())
    seconds = measured.get("bench/time_s", float("nan"))
    return f"step {step}: bench {said} ({seconds:.1f}s, not in tokens/s)"


def eval_line(step: int, metrics: dict[str, float]) -> str:
    """`step 50: eval loss 2.3456 (ppl 10.4)`, or with a preference objective its reward accuracy and margin."""
    line = f"step {step}: eval loss {metrics['eval_loss']:.4f}"
    if "eval_reward_accuracy" in metrics:
        return (
            f"{line} (reward accuracy {metrics['eval_reward_accuracy']:.3f}, "
            f"margin {metrics['eval_reward_margin']:+.4f})"
        )
    if "eval_ppl" in metrics:
        return f"{line} (ppl {metrics['eval_ppl']:.1f})"
    return line


def startup_summary(
    run: Resolved,
    say: Callable[[str], None],
    extra: list[tuple[str, str]] | None = None,
    estimated: RunEstimate | None = None,
) -> None:
    """Plan, memory estimate and where every output goes, before any weights are loaded. `estimated`: the
    estimate the checks before start read (reused where the settled run plans the same inputs)."""

    recipe, layout = run.recipe, run.layout
    out = recipe.output_dir
    say(f"llm-train: recipe {recipe.name} -> {out}")
    for key, value in layout.rows():
        say(f"  {key:<12} {value}")
    say(f"  {'attention':<12} {recipe.memory.attention} ({run.attention})")
    for label, line in evidence_lines(recipe, layout):
        say(f"  {label:<12} {line}")
    if layout.device != "cpu":
        known = [estimated] if estimated else []
        gpus_per_node = estimated.inputs.gpus_per_node if estimated else None
        estimate = dict(memory_rows(run, estimate_run(run, gpus_per_node, known)))
    else:
        estimate = {}
    if estimate:
        say(
            f"  {'memory':<12} ~{estimate.get('GPU total (per GPU)', '?')} per GPU, "
            f"~{estimate.get('host RAM total (per node)', '?')} host RAM per node (estimate; `llm-train plan`)"
        )
    # What each tracker the recipe turns on writes (config/trackers.py), the recipe's copy after the first.
    outputs = [spec.output(recipe.tracking) for spec in trackers_on(recipe.tracking)]
    outputs.insert(1, "config/")
    say(f"  {'outputs':<12} {out}/ {{{', '.join(outputs)}}}")
    for key, value in extra or []:
        say(f"  {key:<12} {value}")
    if run.notice:
        say(f"notice: {run.notice}")
