"""Start-up of tiny-cpu: from `accelerate launch` to the end of the first optimizer step, by phase.

Each run records epoch-time marks on rank 0 (llm_train/observability/metrics.py StartupClock ->
RUN_DIR/startup.json); this script notes the time it launched, so the split is:

    launcher        accelerate CLI + llm_train's parent process + spawning the workers
    imports         torch, transformers, accelerate, deepspeed in the worker
    data            tokenizer, tokenise + pack the corpus
    distributed     Accelerator + DeepSpeed process group (gloo)
    model build     the HF model (inside zero.Init under ZeRO-3)
    deepspeed init  accelerator.prepare: the DeepSpeed engine, ZeRO partitioning, optimizer
    resume, trackers  checkpoint lookup, metrics.jsonl / TensorBoard / W&B
    first step      forward + backward + optimizer step 1

    .venv/bin/python -m bench.startup [--repeats 3]

Prints each phase in seconds and as a share of the total (medians over the repeats) and
writes bench/results/startup-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import accelerate_launch, versions, write_result
from bench.harness import run_or_exit as run


def one_launch(run_dir: Path) -> dict[str, float]:
    cmd = accelerate_launch(
        "llm_train/train.py",
        "--recipe",
        "tiny-cpu",
        "--output-dir",
        str(run_dir),
        "--max-steps=1",
        "eval.every=0",
        "eval.batches=1",
        "output.sample_prompt=null",
        "checkpoint.at_end=false",
    )
    launched = time.time()
    run(cmd, timeout=900)
    record = json.loads((run_dir / "startup.json").read_text())
    phases = {"launcher": record["process_start"] - launched, **record["phases_s"]}
    phases["total"] = record["marks"]["first step"] - launched
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="llm_train_startup_") as tmp:
        for i in range(args.repeats):
            phases = one_launch(Path(tmp) / f"run{i}")
            runs.append(phases)
            print(
                f"launch {i + 1}: {phases['total']:.1f}s to the end of the first optimizer step", flush=True
            )
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    total = median["total"]
    print(f"\nstart-up of tiny-cpu, 2 processes on CPU, median of {len(runs)} launches:")
    for phase, seconds in median.items():
        if phase != "total":
            print(f"  {phase:<18} {seconds:6.1f}s  {seconds / total:6.1%}")
    print(f"  {'total':<18} {total:6.1f}s")
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": "startup",
        "setup": "tiny-cpu (ZeRO-3, fp32), accelerate launch --num_processes 2 on CPU, launch -> end of step 1",
        "median_s": median,
        "share_of_total": {k: v / total for k, v in median.items() if k != "total"},
        "launches": runs,
        "load_average": os.getloadavg(),
        "versions": versions(),
    }
    write_result("startup", record)


if __name__ == "__main__":
    main()
