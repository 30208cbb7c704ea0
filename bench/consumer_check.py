"""The measurements of bench/consumer_check.sh: the consumer-card recipes on one big GPU under memory caps.

One H200 stands in for the cards the recipes are written for: each run goes through
bench/capped_train.py, which caps the training process's CUDA allocator at the card's memory
(`torch.cuda.set_per_process_memory_fraction`) before anything is allocated. Most important first:

    qlora_12   8b-qlora-rtx4070 (Llama-3.1-8B shape, NF4 base, LoRA r=16) under a 12 GiB cap, to the
               end: training, the merged 16-bit export written shard by shard, its verification
    lora_24    8b-lora-rtx4090 (16-bit base) under a 24 GiB cap, to the end
    qlora_16   8b-qlora-rtx4070 under a 16 GiB cap (a 4060 Ti 16 GB), stopped after its steps: the
               cap must not change what the run needs

The base is a randomly initialised Llama-3.1-8B-shaped model written with save_pretrained (5 GB
shards, as the hub's) by a first process (`--make-base`), so every run loads a real checkpoint the
way a user's does: bitsandbytes quantises as it loads, 16-bit weights go straight to the GPU.
Data: the bundled corpus, packed at the recipe's 2048 tokens; 4 optimizer steps of 4 micro-batches.

Each case writes one JSON line the moment it is known (OUT/consumer_check.jsonl; a kill leaves what
was done), then OUT/consumer_check_summary.json; OUT/consumer_check.log has each launch's tail.
Per case: tokens/s (median after the first step), the GPU peak three ways (NVML's device-wide used
memory above the idle device, CUDA context included: the number compared with the planner, whose
estimate includes that context; the allocator's max allocated and max reserved from metrics.jsonl),
the host peak (the process tree's PSS) during loading + training and during the export, and for the
runs that finish, the export's own line (host peak, verification). Verdicts, each a `checks` entry:
the steps ran under the cap; GPU and host within +-15% of the planner's estimate; the export phase's
host peak within the planner's host total; the export verified. A miss fails the line and makes the
exit code 1; every other line is still written. A case with too little of the deadline left is a
failed "not run" line.

Budget on one H200, 8 minutes in all (--budget-s, default 470 s after the wheels): writing the 16 GB
base ~60 s; each case ~20 s start-up, ~20-40 s load (quantising as it loads), 4 steps of ~1-3 s, and
for the finishing ones ~20 s of export plus ~20 s for the check's CPU reload of 15 GiB. Not yet run
on a GPU: the first run will tell.

`--cpu-tiny` runs the same script on CPU with the tiny-cpu model shape (no cap, fp32, 128 tokens):
it checks the script end to end where no GPU is; its verdicts are reported, not enforced (a 2M
model's memory says nothing about the planner), and its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, GiB, check_arguments, require_cuda, versions  # bench/ is this script's folder
from gpu_check import (
    CAPPED_TRAIN,
    CORPUS,
    Budget,
    GpuMemorySampler,
    Results,
    _on_stop_signal,
    launch,
    median,
    metrics_rows,
    peak,
    round_floats,
)

TOLERANCE = 0.15  # the planner's own claim for its memory estimate
MIN_TIME_S = 30.0
BASE_SHAPE = "meta-llama/Llama-3.1-8B"
TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    cap_gib: float
    card: str  # the GPU the planner is asked about (its memory is the cap)
    finish: bool  # run to the end (export + verification), or stop once the steps are logged


CASES = (
    Case("qlora_12", "8b-qlora-rtx4070", 12.0, "RTX 4070", finish=True),
    Case("lora_24", "8b-lora-rtx4090", 24.0, "RTX 4090", finish=True),
    Case("qlora_16", "8b-qlora-rtx4070", 16.0, "RTX 4060 Ti 16GB", finish=False),
)
STEPS = 4

# Every run: the bundled corpus, a short schedule, nothing written but metrics and (when it finishes)
# final/. The global batch of 4 keeps each step a few seconds on the H200. sdpa, not the recipes' auto
# (sdpa_flex on a GPU): flex attention compiles its kernels at the first batch, tens of seconds per run
# this check's 8 minutes cannot spare; the kernels' speed is bench/mfu_matrix.py's question, and at 2048
# tokens sdpa's s x s mask is 0.01 GiB, which the planner counts for it.
COMMON = [
    "memory.attention=sdpa",
    f"data.train=[{CORPUS}]",
    "data.max_epochs=1000",
    "data.eval_fraction=0.02",
    "optim.global_batch_size=4",
    "optim.warmup_steps=0",
    "output.log_every=1",
    "output.sample_prompt=null",
    "eval.every=0",
    "eval.batches=1",
    "tracking.mode=disabled",
    "checkpoint.at_end=false",
]
CPU_TINY = ["data.seq_len=128", "precision=fp32"]


def make_base(out: Path, gpu: bool) -> None:
    """A random model of the consumer recipes' shape, saved as the hub's checkpoints are (in its own process)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO))
    from llm_train.config.recipe import load_recipe
    from llm_train.planning.shapes import to_hf_config

    fields = dict(to_hf_config(BASE_SHAPE)) if gpu else dict(load_recipe("tiny-cpu").model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(out, max_shard_size="5GB")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / GiB
    print(f"consumer_check: base {BASE_SHAPE if gpu else 'tiny-cpu'} shape written to {out} ({size:.2f} GiB)")


def estimate(case: Case, overrides: list[str], gpu: bool) -> dict[str, Any]:
    """The planner's numbers for this case, asked the way `llm-train plan` is."""
    from llm_train.planning.report import plan_recipe

    report = plan_recipe(
        case.recipe, overrides, gpus=1, gpu=case.card, gpu_mem_gib=case.cap_gib if gpu else None, detect=False
    )
    ev = report.evaluation
    return {
        "config": report.config_line,
        "est_gpu_gib": ev.device_bytes / GiB,
        "est_host_gib": ev.host_bytes / GiB,
        "est_export_host_gib": ev.estimate.host_terms.get("export_peak", 0) / GiB,
        "est_step_time_s": ev.time.total,
        "est_tokens_per_s": ev.time.tokens_per_s,
        "planner_verdict": report.word,
    }


def within(measured: float | None, planned: float) -> dict[str, Any]:
    """A verdict against the planner: measured / planned within 1 +- TOLERANCE."""
    if measured is None:
        return {"passed": False, "why": "not measured"}
    ratio = measured / planned if planned else float("inf")
    return {"passed": abs(ratio - 1) <= TOLERANCE, "measured": measured, "planned": planned, "ratio": ratio}


def verdicts(record: dict[str, Any], enforce: bool) -> dict[str, Any]:
    """Every check of one case; `passed` is their conjunction when enforced (on a GPU)."""
    checks: dict[str, dict[str, Any]] = {
        "steps_ran": {"passed": record.get("steps") == STEPS and not record.get("error")},
        "gpu_vs_planner": within(record.get("gpu_device_used_peak_gib"), record["est_gpu_gib"]),
        "host_vs_planner": within(record.get("host_pss_peak_gib"), record["est_host_gib"]),
    }
    if record.get("finish"):
        export_peak = record.get("export_host_pss_peak_gib")
        checks["export_host_within_planner"] = {
            "passed": export_peak is not None and export_peak <= record["est_host_gib"] * (1 + TOLERANCE),
            "measured": export_peak,
            "planned": record["est_host_gib"],
        }
        checks["export_verified"] = {"passed": bool(record.get("export_verified"))}
    record["checks"] = checks
    record["verdicts_enforced"] = enforce
    failed = [name for name, check in checks.items() if not check["passed"]]
    record["failed_checks"] = failed
    record["passed"] = not failed if enforce else checks["steps_ran"]["passed"]
    return record


def run_case(
    case: Case, base: Path, gpu: bool, work: Path, budget: Budget, results: Results
) -> dict[str, Any]:
    record: dict[str, Any] = {"measurement": case.name, "recipe": case.recipe, "gpu_cap_gib": case.cap_gib}
    record["finish"] = case.finish
    overrides = [f"model.name_or_path={base}", *COMMON, *([] if gpu else CPU_TINY)]
    record.update(estimate(case, overrides, gpu))
    run_dir = work / case.name
    cmd = [
        sys.executable,
        str(CAPPED_TRAIN),
        "--gpu-cap-gib",
        str(case.cap_gib),
        "--recipe",
        case.recipe,
        "--output-dir",
        str(run_dir),
        f"--max-steps={STEPS}",
        *overrides,
    ]
    sampler = GpuMemorySampler() if gpu else None
    idle = sampler.used_gib() if sampler else None
    steps_done = lambda: len(metrics_rows(run_dir)) >= STEPS  # noqa: E731
    run = launch(
        cmd,
        budget.timeout(200.0 if gpu else 240.0),
        work / f"{case.name}.log",
        kill_when=None if case.finish else steps_done,
        gpu=sampler,
        second_phase_when=steps_done if case.finish else None,
    )
    results.log_launch(case.name, run)
    rows = metrics_rows(run_dir)[:STEPS]
    export_line = next((line for line in run.output.splitlines() if line.startswith("export: merged")), "")
    export_peak = re.search(r"host peak ([\d.]+) GiB", export_line)
    record.update(
        steps=len(rows),
        tokens_per_s=median(rows[1:] or rows, "tokens_per_s"),
        step_time_s=median(rows[1:] or rows, "step_time_s"),
        first_losses=[r["loss"] for r in rows],
        gpu_mem_peak_gib=peak(rows, "gpu_mem_peak_gib"),  # the allocator's max allocated
        gpu_mem_reserved_peak_gib=peak(rows, "gpu_mem_reserved_gib"),
        gpu_device_used_peak_gib=(
            run.gpu_used_peak_gib - idle if run.gpu_used_peak_gib is not None and idle is not None else None
        ),
        host_pss_peak_gib=run.host_pss_peak_gib,
        export_host_pss_peak_gib=run.second_phase_host_pss_peak_gib,
        export_reported_host_peak_gib=float(export_peak.group(1)) if export_peak else None,
        export_verified="verified: loads with no missing" in run.output,
        wall_s=run.wall_s,
        rc=run.rc,
        cap_note=next((line for line in run.output.splitlines() if line.startswith("capped_train:")), None),
    )
    ended_ok = run.rc == 0 if case.finish else len(rows) >= STEPS
    if run.timed_out or not ended_ok:
        record.update(error=f"{'timed out' if run.timed_out else f'exit {run.rc}'} after {len(rows)} steps")
        record["tail"] = run.tail
    return verdicts(record, enforce=gpu)


def main() -> None:
    parser = check_arguments(
        __doc__.splitlines()[0],
        [c.name for c in CASES],
        "Run only these cases.",
        "Deadline for the whole check (default 470 GPU, 1200 CPU).",
    )
    parser.add_argument("--make-base", type=Path, help=argparse.SUPPRESS)  # the first process's job
    args = parser.parse_args()
    gpu = not args.cpu_tiny
    if args.make_base is not None:
        make_base(args.make_base, gpu)
        return
    require_cuda("consumer_check", args.cpu_tiny)
    sys.path.insert(0, str(REPO))
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    started = time.time()
    budget = Budget(args.budget_s or (470.0 if gpu else 1200.0))
    suffix = "" if gpu else "_cpu_tiny"
    results = Results.for_check("consumer_check", args.out, args.cpu_tiny)
    cases = [c for c in CASES if not args.only or c.name in args.only]
    with tempfile.TemporaryDirectory(prefix="llm_train_consumer_check_") as tmp:
        work = Path(tmp)
        base = work / "base"
        made = subprocess.run(
            [sys.executable, __file__, "--make-base", str(base), *(["--cpu-tiny"] if not gpu else [])],
            capture_output=True,
            text=True,
            timeout=budget.timeout(240.0),
        )
        if made.returncode != 0:
            results.add(
                {"measurement": "make_base", "passed": False, "tail": (made.stdout + made.stderr)[-3000:]}
            )
            cases = []
        for case in cases:
            if budget.left() < MIN_TIME_S:
                results.add(
                    {
                        "measurement": case.name,
                        "passed": False,
                        "error": f"not run: {budget.left():.0f}s left",
                    }
                )
                continue
            try:
                record = run_case(case, base, gpu, work, budget, results)
            except Exception as exc:  # a broken case must not take the others with it
                record = {"measurement": case.name, "passed": False, "error": repr(exc)}
            results.add(record)
    failed = [r["measurement"] for r in results.records if not r.get("passed")]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": f"consumer_check{suffix}",
        "passed": not failed,
        "failed": failed,
        "wall_s": round(time.time() - started, 1),
        "cases": {
            r["measurement"]: {
                k: r.get(k)
                for k in (
                    "gpu_cap_gib",
                    "est_gpu_gib",
                    "gpu_device_used_peak_gib",
                    "gpu_mem_peak_gib",
                    "est_host_gib",
                    "host_pss_peak_gib",
                    "export_host_pss_peak_gib",
                    "est_tokens_per_s",
                    "tokens_per_s",
                    "failed_checks",
                )
            }
            for r in results.records
        },
        "versions": versions(),
    }
    results.summary.write_text(json.dumps(round_floats(summary), indent=2) + "\n")
    print(f"consumer_check: wrote {results.jsonl}, {results.summary.name}, {results.log.name}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
