"""What a run prints on rank 0: a start-up summary, one progress line per logged step, and
little else (DeepSpeed / torch / transformers chatter is kept quiet unless --verbose).

The progress line is plain text, one line per logged step, so it reads the same in a
terminal, a SLURM log and CI; its bar, ETA and tokens/s come from the metrics row the
trackers receive, so the console and metrics.jsonl never disagree.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llm_train.config import ds_json
from llm_train.config.gpu_evidence import unverified_line
from llm_train.config.hardware import Device, find_gpu
from llm_train.config.layout import make_layout
from llm_train.config.recipe import load_recipe
from llm_train.errors import UserError
from llm_train.observability.profiling import parse_range
from llm_train.planning.guards import RunEstimate, estimate_run, memory_rows

if TYPE_CHECKING:
    from llm_train.config.resolution import Resolved

BAR_WIDTH = 20


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def quiet(verbose: bool) -> None:
    """Keep library logs and progress bars out of the training output unless --verbose.

    Must run before DeepSpeed is imported: its logger is (re)configured at import, but a
    filter attached to the logger object beforehand survives that and drops the
    "Setting accelerator to CPU" style warnings every rank prints.
    """
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Writing model shards" bars on export
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").addFilter(_BelowError())
    for name in ("accelerate", "torch.distributed", "torch._dynamo", "torch._inductor", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The observability flags of `llm_train/train.py` (metrics peak, profiling)."""
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="Dense bf16 peak TFLOP/s of one device, for MFU (default: from the GPU table; none on CPU).",
    )
    parser.add_argument(
        "--profile",
        metavar="A-B",
        type=_profile_range,
        help="Record a torch.profiler trace of optimizer steps A..B into RUN_DIR/profile/ "
        "(open in TensorBoard or https://ui.perfetto.dev).",
    )
    parser.add_argument(
        "--flops-profiler",
        action="store_true",
        help="Also run DeepSpeed's flops profiler at the first --profile step (or step 2); "
        "summary in RUN_DIR/profile/flops_profiler.txt.",
    )


def _profile_range(spec: str) -> str:
    # Checked while parsing, so a typo fails in a second, not after the model has loaded.

    try:
        parse_range(spec)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
    return spec


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
    if untried := unverified_line(recipe, layout):
        say(f"  {'unverified':<12} {untried}")
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
    outputs = ["metrics.jsonl", "config/"]
    if getattr(recipe.tracking, "tensorboard", False):
        outputs.append("tensorboard/")
    if recipe.tracking.mode != "disabled":
        outputs.append(f"wandb/ ({recipe.tracking.mode}, project {recipe.tracking.project})")
    say(f"  {'outputs':<12} {out}/ {{{', '.join(outputs)}}}")
    for key, value in extra or []:
        say(f"  {key:<12} {value}")
    if run.notice:
        say(f"notice: {run.notice}")


RECIPE_COLUMNS = ("recipe", "model", "ZeRO/TP/PP/SP", "GPUs", "VRAM", "host RAM", "description")


def recipe_row(name: str) -> tuple[str, ...]:
    """One line of `llm-train recipes`: what the recipe trains, how it is split, what it needs."""

    recipe = load_recipe(name)
    hw = recipe.hardware
    _, raw = ds_json.load_ds_config(recipe.deepspeed.config)
    try:
        layout, _ = make_layout(recipe, raw, hw.world_size, Device.declared(recipe))
        stage, tp, pp, sp = layout.zero_stage, layout.tp, layout.pp, layout.sp
        offload = layout.offload_optimizer != "none" or layout.offload_params != "none"
    except UserError:  # a recipe whose declared hardware does not divide; show what the JSON says
        stage, tp, pp, sp, offload = ds_json.zero_stage(raw), 0, 0, 0, False
    degrees = f"{stage}{'+off' if offload else ''}/{tp or '?'}/{pp or '?'}/{sp or '?'}"
    count = f"{hw.nodes} nodes x {hw.processes_per_node}" if hw.nodes > 1 else str(hw.processes_per_node)
    if hw.device == "cpu":
        gpus, vram = f"none (cpu x{hw.world_size})", "-"
    else:
        spec = find_gpu(hw.gpu_name) if hw.gpu_name else None
        gpus = f"{count} x {hw.gpu_name or 'GPU'}"
        mem = hw.gpu_mem_gib or (spec.memory_gib if spec else None)
        vram = f"{mem:.0f} GiB" if mem else "-"
    ram = f"{hw.host_ram_gib:.0f} GiB" if hw.host_ram_gib else "-"
    model = recipe.model.name_or_path or f"random {recipe.model.config.get('model_type', 'model')}"
    return (name, model, degrees, gpus, vram, ram, recipe.description)


def print_recipe_table(names: list[str]) -> None:
    """`llm-train recipes`: an aligned table; the description column is left ragged."""
    rows = [RECIPE_COLUMNS, *(recipe_row(name) for name in names)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(RECIPE_COLUMNS) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])) + "  " + row[-1])
