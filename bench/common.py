"""What the launching benchmarks share: the repo, an accelerate command on a free port, offline
runs that stop the benchmark on failure, the versions measured, where results are written, and
the verdict of a measured number against its planner estimate and its target.

Imported as `common` (bench/ is the script's folder when a benchmark runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llm_train.runtime.launcher import free_port  # noqa: F401 - each benchmark launch gets its own port
from llm_train.units import GiB  # noqa: F401 - the benchmarks' unit

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).with_name("accelerate")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}


def proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a 'Field:  N kB' line of a /proc file (status VmHWM, smaps_rollup Pss); None if unreadable."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def accelerate_launch(script: str, *args: str, deepspeed: bool = False) -> list[str]:
    """`accelerate launch` of a repo script on 2 processes, on its own port."""
    flags = ["--use_deepspeed"] if deepspeed else []
    return [
        str(ACCELERATE),
        "launch",
        "--num_processes",
        "2",
        *flags,
        "--main_process_port",
        str(free_port()),
        script,
        *args,
    ]


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run offline from the repo root; a failure ends the benchmark with the command's output tail."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    result = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "cpus": str(os.cpu_count())}
    for name in ("torch", "deepspeed", "accelerate", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "missing"
    import torch

    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out["cuda"] = str(torch.version.cuda)
    return out


def write_result(name: str, record: dict[str, Any]) -> Path:
    """bench/results/<name>-<date>.json; prints where it went."""
    out = REPO / "bench" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return out


# --- verdicts: a measured number against the planner's estimate and a target --------------------------

ESTIMATE_TOLERANCE = 0.15  # the planner's stated precision (~15% on memory and speed)


def verdict(
    quantity: str,
    measured: float | None,
    estimate: float | None = None,
    target: float | None = None,
    higher_is_better: bool = True,
    tolerance: float = ESTIMATE_TOLERANCE,
    judged: bool = True,
    why_not_judged: str | None = None,
) -> dict[str, Any]:
    """One measured quantity judged against an estimate (within +-tolerance) and/or a target.

    `passed` is False when the estimate or the target is missed, or when nothing was measured
    although something was expected. judged=False records the comparison without enforcing it
    (why_not_judged says why: e.g. a CPU check of a GPU script, whose numbers mean nothing).
    """
    out: dict[str, Any] = {"quantity": quantity, "measured": measured}
    misses: list[str] = []
    if estimate is None and target is None:
        misses.append(f"{quantity}: no estimate to judge it against")
    if estimate is not None:
        out.update(estimate=estimate, tolerance=tolerance)
        if measured is None:
            misses.append(f"{quantity}: not measured (estimate {estimate:.4g})")
        else:
            ratio = measured / estimate if estimate else math.inf
            out.update(ratio=ratio, within_estimate=abs(ratio - 1) <= tolerance)
            if not out["within_estimate"]:
                misses.append(
                    f"{quantity} {measured:.4g} is {ratio - 1:+.0%} off the planner's {estimate:.4g} "
                    f"(allowed +-{tolerance:.0%})"
                )
    if target is not None:
        out.update(target=target, higher_is_better=higher_is_better)
        if measured is None:
            misses.append(f"{quantity}: not measured (target {target:.4g})")
        else:
            out["target_met"] = measured >= target if higher_is_better else measured <= target
            if not out["target_met"]:
                sign = ">=" if higher_is_better else "<="
                misses.append(f"{quantity} {measured:.4g} misses its target {sign} {target:.4g}")
    out["judged"] = judged
    if not judged:
        out["why_not_judged"] = why_not_judged
    out["misses"] = misses
    out["passed"] = not (judged and misses)
    return out


def judge(record: dict[str, Any], verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """`record` with its verdicts; a judged miss fails the line (passed False, `error` names the misses)."""
    record["verdicts"] = verdicts
    missed = [m for v in verdicts if v["judged"] for m in v["misses"]]
    if missed:
        record["passed"] = False
        record["error"] = "; ".join([*([record["error"]] if record.get("error") else []), *missed])
    return record


def check_arguments(
    description: str, names: list[str], only_help: str, budget_help: str
) -> argparse.ArgumentParser:
    """The options every prepared GPU check takes: --cpu-tiny, --out, --only NAME..., --budget-s."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--cpu-tiny", action="store_true", help="Tiny model on CPU: checks the script, not a GPU."
    )
    parser.add_argument("--out", type=Path, help="Output folder (default: $OUT, else bench/results/).")
    parser.add_argument("--only", nargs="+", choices=names, help=only_help)
    parser.add_argument("--budget-s", type=float, help=budget_help)
    return parser


def require_cuda(script: str, cpu_tiny: bool) -> None:
    """Stop a GPU check on a machine without CUDA, saying how to check the script on CPU instead."""
    if cpu_tiny:
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            f"{script}: no CUDA device; run on a GPU machine, or pass --cpu-tiny to check the script on CPU"
        )
