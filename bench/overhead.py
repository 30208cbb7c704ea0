"""llm_train's training loop against a hand-written minimal Accelerate + DeepSpeed loop, side by side.

Same tiny-cpu model, packed corpus, batch and DeepSpeed config (the JSON llm_train
resolves is handed to the baseline), 2 processes on CPU, both logging every step. Each
launch reports the wall time of every loop iteration after WARMUP (forward, backward,
step, loss reduction, logging, metrics: everything the loop does), so start-up is not in
it (bench/startup.py measures that). A round is one launch of each, in alternating order;
its ratio is median iteration time (llm_train) / median iteration time (minimal): medians,
because on a shared machine single iterations stall when another process takes the core.
The result is the median of the rounds' ratios. Target: <= 1.03.

    .venv/bin/python bench/overhead.py [--rounds 5] [--steps 60]

Prints one line per round and the ratio; writes bench/results/overhead-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, accelerate_launch, versions, write_result  # bench/ is this script's folder
from common import run as run_offline

# One intra-op thread per rank for both loops (what llm_train's launcher and Accelerate pick on a
# 2-core machine anyway), so threading never differs between them.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TARGET = 1.03


def run(cmd: list[str]) -> None:
    run_offline(cmd, timeout=1800, env=ONE_THREAD)


def resolved_ds_config() -> dict:
    sys.path.insert(0, str(REPO))
    from llm_train.config.hardware import Device
    from llm_train.config.resolution import resolve_run

    return resolve_run(
        "tiny-cpu", ["checkpoint.at_end=false"], world_size=2, device=Device.detect()
    ).ds_config


def llm_train_iterations(work: Path, i: int, steps: int, warmup: int, log_every: int) -> list[float]:
    run_dir = work / f"llm_train-{i}"
    run(
        accelerate_launch(
            "llm_train/train.py",
            "--recipe",
            "tiny-cpu",
            "--output-dir",
            str(run_dir),
            f"--max-steps={steps}",
            f"output.log_every={log_every}",
            "eval.every=0",
            "output.sample_prompt=null",
            "checkpoint.at_end=false",
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r}
    return [elapsed[s] - elapsed[s - 1] for s in range(warmup + 1, steps + 1)]


def minimal_iterations(
    work: Path, i: int, ds_config: Path, steps: int, warmup: int, log_every: int
) -> list[float]:
    out = work / f"minimal-{i}.json"
    script_args = [f"--steps={steps}", f"--warmup={warmup}", f"--log-every={log_every}", "--out", str(out)]
    run(
        accelerate_launch(
            "bench/minimal_loop.py", "--ds-config", str(ds_config), *script_args, deepspeed=True
        )
    )
    return json.loads(out.read_text())["iteration_s"]


def interleaved(work: Path, ds_config: Path, rounds: int, block: int) -> list[float]:
    """Per-round ratios of the one-engine, alternating-blocks comparison (bench/overhead_interleaved.py)."""
    out = work / "interleaved.json"
    script_args = [f"--rounds={rounds}", f"--block={block}", "--out", str(out)]
    run(
        accelerate_launch(
            "bench/overhead_interleaved.py", "--ds-config", str(ds_config), *script_args, deepspeed=True
        )
    )
    blocks = json.loads(out.read_text())
    return [a / b for a, b in zip(blocks["llm_train"], blocks["minimal"], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument(
        "--interleaved-rounds", type=int, default=8, help="0 skips the one-engine comparison."
    )
    parser.add_argument("--block", type=int, default=8, help="Steps per block in the one-engine comparison.")
    args = parser.parse_args()

    rounds = []
    with tempfile.TemporaryDirectory(prefix="llm_train_overhead_") as tmp:
        work = Path(tmp)
        ds_config = work / "ds_config.json"  # exactly what llm_train hands DeepSpeed for this launch
        ds_config.write_text(json.dumps(resolved_ds_config()))
        for i in range(args.rounds):
            # Alternate which goes first, so neither always runs on the warmer (or busier) machine.
            order = ["llm_train", "minimal"] if i % 2 == 0 else ["minimal", "llm_train"]
            times: dict[str, float] = {}
            for who in order:
                if who == "llm_train":
                    its = llm_train_iterations(work, i, args.steps, args.warmup, args.log_every)
                else:
                    its = minimal_iterations(work, i, ds_config, args.steps, args.warmup, args.log_every)
                times[who] = statistics.median(its)
                times[f"{who}_mean"] = statistics.fmean(its)
            ratio = times["llm_train"] / times["minimal"]
            rounds.append({**times, "ratio": ratio, "load_average": os.getloadavg()[0]})
            print(
                f"round {i + 1}: llm_train {times['llm_train'] * 1000:.1f} ms/step, "
                f"minimal {times['minimal'] * 1000:.1f} ms/step (medians), ratio {ratio:.3f}, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        block_ratios = (
            interleaved(work, ds_config, args.interleaved_rounds, args.block)
            if args.interleaved_rounds
            else []
        )
    if block_ratios:
        print(
            f"one engine, alternating {args.block}-step blocks: ratio {statistics.median(block_ratios):.3f} "
            f"(median of {len(block_ratios)}; blocks {', '.join(f'{r:.3f}' for r in block_ratios)})",
            flush=True,
        )
    ratio = pooled = None
    if rounds:
        ratio = statistics.median(r["ratio"] for r in rounds)
        pooled = statistics.median(r["llm_train"] for r in rounds) / statistics.median(
            r["minimal"] for r in rounds
        )
        print(
            f"separate launches: ratio llm_train / minimal {ratio:.3f} (median of {len(rounds)} rounds; "
            f"ratio of medians {pooled:.3f}; target <= {TARGET})"
        )
    if block_ratios:
        verdict = "meets" if statistics.median(block_ratios) <= TARGET else "misses"
        print(f"one engine: ratio {statistics.median(block_ratios):.3f}, {verdict} the target <= {TARGET}")
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": "overhead",
        "setup": "tiny-cpu, ZeRO-3 (ds_configs/zero3.json resolved), fp32, 2 processes on CPU (gloo), "
        f"micro-batch 8 x seq 128 per rank, steps {args.warmup}..{args.steps}, log every {args.log_every}",
        "rounds": rounds,
        "ratio_median": ratio,
        "ratio_of_medians": pooled,
        "interleaved_block_ratios": block_ratios,
        "interleaved_ratio_median": statistics.median(block_ratios) if block_ratios else None,
        "load_average_end": os.getloadavg(),
        "target": TARGET,
        "versions": versions(),
    }
    write_result("overhead", record)


if __name__ == "__main__":
    main()
