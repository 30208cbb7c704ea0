"""The measurements of bench/gpu_check.sh, each a real `python llm_train/train.py` run on one device.

    1. zero2     ~1B Llama (Llama-3.2-1B shape, random init), ZeRO-2, bf16, seq 4096: tokens/s and MFU
    2. zero0     the same with ZeRO-0              } ZeRO-3 / ZeRO-0 step-time ratio
    3. zero3     the same with ZeRO-3              }
    4. zero2_ac  zero2 with activation checkpointing: on/off step-time ratio

Step times, tokens/s and MFU are medians over the steps after WARMUP, read from each run's
metrics.jsonl (MFU against the GPU table's dense bf16 peak: H200 989 TFLOP/s). Every
measurement prints one JSON line; all of them, with the date and versions, go to
bench/results/gpu_check-<date>.json and, when $OUT is set, to $OUT/gpu_check.jsonl.

`--cpu-tiny` runs the same four measurements on CPU with the tiny-cpu model at sequence
128 (a nominal --peak-tflops so that MFU is computed): it checks the script end to end
where no GPU is available; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, versions  # bench/ is this script's folder

WARMUP = 5  # steps left out of the medians: allocator warm-up, cuDNN/cuBLAS autotuning

GPU_MODEL = [
    "model.init=random",
    "model.name_or_path=meta-llama/Llama-3.2-1B",  # shape known offline (llm_train/shapes.py)
    "model.config={}",
    "hardware.device=cuda",
    "precision=bf16",
    "data.seq_len=4096",
]
CPU_MODEL = ["precision=fp32", "data.seq_len=128"]

MEASUREMENTS = {
    "zero2": ("zero2", []),
    "zero0": ("zero0", []),
    "zero3": ("zero3", []),
    "zero2_ac": ("zero2", ["memory.activation_checkpointing=true"]),
}


def run_one(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ds_config, extra = MEASUREMENTS[name]
    run_dir = work / name
    model = CPU_MODEL if args.cpu_tiny else GPU_MODEL
    cmd = [
        sys.executable,
        str(REPO / "llm_train" / "train.py"),
        "--recipe",
        "tiny-cpu",  # its bundled tokenizer and corpus; the model is replaced on GPU
        "--ds-config",
        ds_config,
        "--output-dir",
        str(run_dir),
        f"--max-steps={args.steps}",
        *(["--peak-tflops", "1.0"] if args.cpu_tiny else []),
        *model,
        f"optim.micro_batch_size={args.micro_batch}",
        "optim.grad_accum=1",
        "optim.warmup_steps=0",
        "output.log_every=1",
        "eval.every=0",
        "eval.batches=1",
        "output.sample_prompt=null",
        "checkpoint.at_end=false",
        "tracking.mode=disabled",
        *extra,
    ]
    started = time.time()
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    record: dict[str, Any] = {"measurement": name, "ds_config": ds_config, "extra": extra}
    if result.returncode != 0:
        record.update(error=f"exit {result.returncode}", tail=(result.stdout + result.stderr)[-2000:])
        return record
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "loss" in r and r["step"] > WARMUP]

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if key in r]
        return statistics.median(values) if values else None

    record.update(
        steps=len(steady),
        step_time_s=median("step_time_s"),
        tokens_per_s=median("tokens_per_s"),
        tokens_per_s_per_gpu=median("tokens_per_s_per_gpu"),
        mfu=median("mfu"),
        gpu_mem_peak_gib=max(
            (r["gpu_mem_peak_gib"] for r in steady if "gpu_mem_peak_gib" in r), default=None
        ),
        final_loss=steady[-1]["loss"] if steady else None,
        wall_s=time.time() - started,
    )
    return record


def ratio(records: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    ta, tb = records.get(a, {}).get("step_time_s"), records.get(b, {}).get("step_time_s")
    return ta / tb if ta and tb else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-tiny", action="store_true", help="Tiny model on CPU: checks the script, not a GPU."
    )
    parser.add_argument("--steps", type=int, help="Optimizer steps per measurement (default 20 GPU, 8 CPU).")
    parser.add_argument("--micro-batch", type=int, help="Sequences per step (default 4 GPU, 2 CPU).")
    parser.add_argument("--only", nargs="+", choices=list(MEASUREMENTS), help="Run only these measurements.")
    parser.add_argument("--timeout", type=int, default=400, help="Seconds per measurement.")
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.cpu_tiny else 20)
    args.micro_batch = args.micro_batch or (2 if args.cpu_tiny else 4)
    if not args.cpu_tiny:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on a GPU machine, or pass --cpu-tiny to check the script on CPU")

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="llm_train_gpu_check_") as tmp:
        for name in args.only or MEASUREMENTS:
            record = run_one(name, args, Path(tmp))
            records[name] = record
            line = json.dumps(record)
            print(line, flush=True)
            if out_dir:
                with (out_dir / "gpu_check.jsonl").open("a") as handle:
                    handle.write(line + "\n")
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": "gpu_check" + ("_cpu_tiny" if args.cpu_tiny else ""),
        "setup": (
            "tiny-cpu model, seq 128, fp32, CPU (script check only)"
            if args.cpu_tiny
            else f"Llama-3.2-1B shape, random init, bf16, seq 4096, micro-batch {args.micro_batch}, 1 device"
        ),
        "mfu_zero2": records.get("zero2", {}).get("mfu"),
        "tokens_per_s_zero2": records.get("zero2", {}).get("tokens_per_s"),
        "zero3_over_zero0_step_time": ratio(records, "zero3", "zero0"),
        "activation_checkpointing_on_over_off_step_time": ratio(records, "zero2_ac", "zero2"),
        "measurements": records,
        "versions": versions(),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "measurements"}), flush=True)
    name = f"gpu_check{'_cpu_tiny' if args.cpu_tiny else ''}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for folder in (REPO / "bench" / "results", out_dir):
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(json.dumps(summary, indent=2) + "\n")
    if any("error" in r for r in records.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
