"""Every GPU number in two parts of one 10-minute command each: what bench/gpu_run.sh runs on the lent GPU
(an 80 GB H100 by default, or an H200).

    bash bench/gpu_run.sh A        # first visit: the probe, the consumer cards, then speed with the time left
    bash bench/gpu_run.sh B --after bench/results/gpu_run_A-h200-DATE.jsonl   # next visit

The device machine allows 15 minutes in all per session, start-up included, and 10 per command; so each
part ends inside PART_LIMIT_S (9.5 minutes from the shell's start, the wheels' install included), its
cases in order of value, each in its own time box (bench/cases.py `Case`), each line written the
moment its case ends:

A  probe (GPU, MemTotal, disk, libaio, versions, the cap works, a bitsandbytes round trip), then the
   consumer cards (bench/consumer.py: a random 8B base, 8B QLoRA under 12 GiB and 8B LoRA under 24 GiB
   with their exports, the long-context QLoRA recipe under 24 GiB), then, while the time holds, GRPO on one
   24 GiB card (generation's and training's tokens/s apart, the generate call against the planner's rough
   model), then the speed matrix (bench/mfu_matrix.py) in order of value with the time left;
B  probe, then the full fine-tunes (bench/full_ft.py: DeepSpeed's ops built first, 7B with its optimizer on
   the CPU under 24 GiB, the NVMe pair or "skipped: no libaio", the copy times of each pinning choice),
   then, while the time holds, the staged QLoRA load (bench/consumer.py `staged_load_case`: an 8B base
   quantised on the GPU weight by weight, its GPU and host peaks, time and weights/s), then the image-text
   LoRA case (bench/vlm.py: a random LLaVA-1.5-7B-shaped checkpoint on the bundled drawings under a 24 GiB
   cap, tokens/s with the image tokens, the peaks and the image tokens against the planner), then the speed
   cases A could not fit (`--after A.jsonl`: A's measured lines are read, not run again, and the later
   cases compare with them).

The required cases' boxes add up within the part's limit (tests/unit/test_bench_harness.py holds them to
it from the costs the code assumes); the speed cases are optional: one runs only while the time left
holds its assumed cost, else it is a deferred line (passed null), which the next part or visit runs.
Exit 1 when any line failed. `--cpu-tiny` runs each part's logic on CPU with tiny models (CI): the
planner's estimates and the targets are recorded there, not judged.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import consumer, full_ft, mfu_matrix, vlm
from bench.cases import Budget, Case, Context, check_arguments, injected, run_cases
from bench.environment import module_cmd
from bench.launch import launch
from bench.result_files import Results
from bench.verdicts import Judging

PART_LIMIT_S = 570.0  # 9.5 minutes: the device tool stops a command at 10
INSTALL_RESERVE_S = 30.0  # from the shell's start to the first case: the wheels' install, the interpreter
CPU_TINY_BUDGET_S = 2400.0  # a shared 2-core CI machine: a deadline that only a hang reaches


def probe(ctx: Context) -> dict[str, Any]:
    run = launch(
        module_cmd("bench.probe", *([] if ctx.gpu else ["--cpu-tiny"])), ctx.timeout(), ctx.work / "probe.log"
    )
    ctx.results.log_launch("probe", run)
    last = (run.output.strip().splitlines() or [""])[-1]
    try:
        record: dict[str, Any] = json.loads(last)
    except json.JSONDecodeError:
        failed = run.ended
        return {"passed": False, "error": f"{failed} before the probe's line", "tail": run.tail}
    failed = [name for name, ok in record.get("checks", {}).items() if not ok]
    if failed:
        record["error"] = "probe checks failed: " + ", ".join(failed)
    return record


PROBE = Case("probe", probe, cost_s=30, box_s=60, cpu_box_s=300)


@dataclass(frozen=True)
class Part:
    cases: list[Case]  # in order of value: the required ones, and optional ones that come before speed
    speed: list[str]  # the speed matrix's cases, in order of value
    cpu_tiny_speed: list[str]  # ... the ones --cpu-tiny runs (one smoke of each harness feature)


PARTS = {
    "A": Part(
        [PROBE, *consumer.cases()],
        mfu_matrix.ORDER,
        ["baseline", "hf_trainer", "llm_train_vs_hf_trainer", "doc_isolation"],
    ),
    "B": Part(
        [PROBE, *full_ft.cases(), consumer.staged_load_case(), *vlm.cases()],
        mfu_matrix.ORDER,
        ["liger_compile"],
    ),
}


def earlier_lines(path: Path | None) -> dict[str, dict[str, Any]]:
    """The measured lines of an earlier part (--after): not run again, compared with."""
    if path is None:
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["measurement"]: r for r in lines if r.get("passed") is not None}


def part_cases(part: Part, gpu: bool, after: dict[str, dict[str, Any]], only: list[str] | None) -> list[Case]:
    speed = [c for c in mfu_matrix.cases(part.speed if gpu else part.cpu_tiny_speed) if c.name not in after]
    chosen = [*part.cases, *speed]
    return [c for c in chosen if only is None or c.name in only]


def main() -> None:
    parser = check_arguments(__doc__.splitlines()[0])
    parser.add_argument(
        "part", choices=sorted(PARTS), help="Which part: A on the first visit, B on the next."
    )
    parser.add_argument(
        "--after", type=Path, help="An earlier part's JSONL: its measured speed lines are not run again."
    )
    args = parser.parse_args()
    gpu = not args.cpu_tiny
    if gpu:
        import shutil

        if shutil.which("nvidia-smi") is None:
            sys.exit("gpu_run: no GPU here (no nvidia-smi); run on the GPU machine, or pass --cpu-tiny")
    name = f"gpu_run_{args.part}"
    results = Results(name, args.out, "" if gpu else "_cpu_tiny")
    results.stop_on_signals()
    started = float(os.environ.get("GPU_RUN_STARTED") or time.time())  # the shell's start (bench/gpu_run.sh)
    budget = Budget(args.budget_s or (PART_LIMIT_S if gpu else CPU_TINY_BUDGET_S), started)
    after = earlier_lines(args.after)
    results.context = {
        "part": args.part,
        "mode": "gpu" if gpu else "cpu-tiny (checks the script; its numbers say nothing about a GPU)",
        "budget_s": budget.seconds,
        "after": str(args.after) if args.after else None,
    }
    with tempfile.TemporaryDirectory(prefix=f"llm_train_{name}_") as tmp:
        ctx = Context(gpu, Path(tmp), budget, results, Judging(gpu, injected(parser, args.expect)))
        ctx.done.update(after)
        run_cases(part_cases(PARTS[args.part], gpu, after, args.only), ctx)
    summary = results.write_summary()
    print(json.dumps({k: summary[k] for k in ("part", "passed", "failed", "wall_s")}), flush=True)
    sys.exit(1 if results.failed else 0)


if __name__ == "__main__":
    main()
