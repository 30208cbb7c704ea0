"""Measured vs planned memory for the single consumer-GPU path (`7b-rtx4090`).

Trains a randomly initialised Llama-2-7B-shaped model with the `7b-rtx4090` settings
(ZeRO-3, optimizer offload to CPU, 16-bit weights on the GPU, DeepSpeed CPU Adam, activation
checkpointing, bf16) on one GPU whose memory is capped at 24 GiB with
`torch.cuda.set_per_process_memory_fraction`, so an 80-141 GB card behaves like an RTX
4090 as far as the allocator is concerned. Records, beside the planner's estimate:
peak GPU memory (allocated, reserved, and used on the device including the CUDA
context), peak host RSS, and step time. One JSON line per run, appended to
`<out>/gpu_memory_7b.jsonl` and printed.

    python bench/gpu_memory_7b.py                  # on a GPU (>= 24 GiB, ~110 GiB host RAM)
    python bench/gpu_memory_7b.py --tiny           # CPU smoke test: same code path, tiny model
    python bench/gpu_memory_7b.py --out $OUT --steps 10 --micro-batch 4

Target (issue 6): the GPU estimate within +-10% of the measured peak (device used) and
never under it by more than 5%. This script reports; it does not pass or fail.

On the H200 machine (no deepspeed/pydantic in its image, no registry): install the carried
wheels the way bench/gpu_check.sh does (WHEELS=folder), then
`HF_HUB_OFFLINE=1 python bench/gpu_memory_7b.py --out $OUT`. Budget ~1 minute for the
first-use JIT build of CPU Adam and ~1-2 minutes for the 7B random init under zero.Init;
the planner puts host RAM at ~116 GiB, so the machine's 128 GiB is just enough.

Gradient accumulation defaults to 1 (one micro-batch per step) so 10 steps take about a
minute on an H200: peak memory depends on the micro-batch, not on the accumulation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_train.units import GiB  # noqa: E402 - after the repo is on the path

RECIPE = "7b-rtx4090"
# The tiny stand-in: the tiny-cpu Llama shape (2M parameters), same DS JSON and knobs.
TINY_MODEL_CONFIG = (
    "{model_type: llama, vocab_size: 4096, hidden_size: 128, intermediate_size: 384, "
    "num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4, "
    "max_position_embeddings: 256, tie_word_embeddings: false}"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test with a 2M-parameter model.")
    p.add_argument("--steps", type=int, default=10, help="Optimizer steps to time (after 1 warm-up step).")
    p.add_argument("--micro-batch", type=int, help="Override the recipe's micro-batch size.")
    p.add_argument("--grad-accum", type=int, default=1, help="Micro-batches per step (default 1).")
    p.add_argument("--gpu-mem-cap", type=float, default=24.0, help="GiB the process may allocate on the GPU.")
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results"), help="Results directory."
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="More recipe overrides.")
    return p.parse_args(argv)


def overrides_for(args: argparse.Namespace) -> list[str]:
    out = ["model.init=random", "tracking.mode=disabled"]
    if args.tiny:
        tokenizer = Path(__file__).resolve().parent.parent / "llm_train" / "assets" / "tiny" / "tokenizer"
        out += [
            "model.name_or_path=null",
            f"model.tokenizer={tokenizer}",
            f"model.config={TINY_MODEL_CONFIG}",
            "data.seq_len=128",
            "hardware.device=cpu",
        ]
    micro = args.micro_batch or (2 if args.tiny else None)
    if micro:
        out.append(f"optim.micro_batch_size={micro}")
    return out + list(args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from llm_train.runtime import collectives, launcher
    from llm_train.runtime.fast import prepare_op_loads

    launcher.set_single_process_env()
    launcher.use_deepspeed_in_accelerate()
    prepare_op_loads()  # as a training worker does (the same cpu_adam build)
    collectives.skip_unused_shm_op()  # and, as it does, no build of DeepSpeed's unused CPU shm op
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import psutil
    import torch

    from llm_train.config.hardware import Device
    from llm_train.config.recipe import load_recipe
    from llm_train.config.resolution import resolve_run
    from llm_train.planning.fit import memory_inputs, needs
    from llm_train.planning.guards import check_host_ram
    from llm_train.planning.memory import estimate_memory
    from llm_train.planning.shapes import shape_from_config

    cuda = torch.cuda.is_available() and not args.tiny
    cap_gib = None
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        cap_gib = min(args.gpu_mem_cap, total / GiB)
        # Before any allocation: the caching allocator refuses to grow past this fraction.
        torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / total, 0)

    overrides = overrides_for(args)
    recipe = load_recipe(RECIPE, overrides)
    micro = recipe.optim.micro_batch_size
    overrides += [f"optim.global_batch_size={micro * args.grad_accum}", f"optim.max_steps={args.steps + 1}"]
    device = Device.detect() if cuda else Device(kind="cpu", name="cpu", bf16=True)
    run = resolve_run(RECIPE, overrides, world_size=1, device=device)
    shape = shape_from_config(run.model_fields)
    inputs = memory_inputs(run, shape, 1)
    estimate = estimate_memory(inputs)
    est_device, est_host = needs(estimate, inputs, "cuda" if cuda else "cpu")
    record: dict[str, Any] = {
        "bench": "gpu_memory_7b",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "tiny-cpu" if args.tiny else ("gpu" if cuda else "cpu"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "recipe": RECIPE,
        "overrides": overrides,
        "params": shape.num_params,
        "zero_stage": run.layout.zero_stage,
        "offload": [run.layout.offload_optimizer, run.layout.offload_params],
        "precision": run.layout.precision,
        "micro_batch": micro,
        "grad_accum": run.layout.grad_accum,
        "seq_len": recipe.data.seq_len,
        "gpu_mem_cap_gib": cap_gib,
        "estimate_gpu_gib": round(est_device / GiB, 3),
        "estimate_host_gib": round(est_host / GiB, 3),
        "estimate_gpu_terms_gib": {k: round(v / GiB, 3) for k, v in estimate.gpu_terms.items()},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        check_host_ram(run)
        measure(run, args, record, cuda, psutil, torch)
        status = 0
    except Exception as exc:  # an OOM is a result too: record it
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        status = 1
    line = json.dumps(record)
    with (out_dir / "gpu_memory_7b.jsonl").open("a") as handle:
        handle.write(line + "\n")
    print(line, flush=True)
    return status


def measure(
    run: Any, args: argparse.Namespace, record: dict[str, Any], cuda: bool, psutil: Any, torch: Any
) -> None:
    """Build the engine exactly as a training run does, then time steps on random tokens."""
    from llm_train.runtime.zero_engine import ZeroEngine

    recipe, layout = run.recipe, run.layout
    proc = psutil.Process()
    started = time.perf_counter()
    zero = ZeroEngine(run, print)
    zero.start()  # zero.Init under ZeRO-3, as in a run
    zero.build(args.steps + 1, lambda phase: None)
    engine, model = zero.ds, zero.model
    record["setup_s"] = round(time.perf_counter() - started, 1)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (layout.micro_batch_size, recipe.data.seq_len), generator=gen)

    def used_on_device() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free  # includes the CUDA context and anything else on the card

    peak_used = 0
    peak_rss = proc.memory_info().rss
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine.train()
    for step in range(args.steps + 1):  # step 0 warms up (allocator, CPU Adam first call)
        t0 = time.perf_counter()
        for _ in range(layout.grad_accum):
            x = batch.to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            if cuda:
                peak_used = max(peak_used, used_on_device())
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        peak_rss = max(peak_rss, proc.memory_info().rss)
        losses.append(round(float(loss.detach().float()), 4))
        if step > 0:
            times.append(elapsed)
    record["steps"] = len(times)
    record["losses"] = losses
    record["step_time_s_median"] = round(statistics.median(times), 3)
    record["step_times_s"] = [round(t, 3) for t in times]
    record["tokens_per_s"] = round(
        layout.micro_batch_size * layout.grad_accum * recipe.data.seq_len / statistics.median(times), 1
    )
    # ru_maxrss is KiB on Linux: the true peak, including moments between our samples.
    record["host_rss_peak_gib"] = round(
        max(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / GiB, 3
    )
    record["host_ratio_estimate_over_measured"] = round(
        record["estimate_host_gib"] / record["host_rss_peak_gib"], 3
    )
    if cuda:
        record["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
        record["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 3)
        record["peak_gpu_used_gib"] = round(peak_used / GiB, 3)
        record["gpu_ratio_estimate_over_measured"] = round(
            record["estimate_gpu_gib"] / record["peak_gpu_used_gib"], 3
        )


if __name__ == "__main__":
    sys.exit(main())
