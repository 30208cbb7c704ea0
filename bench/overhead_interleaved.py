"""bench/overhead.py, part 2: both loops on ONE DeepSpeed engine, alternated in short blocks.

Launched by bench/overhead.py (accelerate launch --num_processes 2 --use_deepspeed). One
engine (tiny-cpu model, the DS config llm_train resolves, AdamW) is trained alternately
for BLOCK steps by llm_train's `train_loop` (with its tracker, meter, run control and
progress line, logging every step) and for BLOCK steps by the minimal Accelerate loop
(printing its loss every step). Because the blocks alternate every few seconds, load from
other processes on a shared machine falls on both loops alike; what differs is only what
each loop does around forward/backward/step. Rank 0 writes every block's seconds per step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from minimal_loop import finish, packed_blocks, run_and_exit, setup  # bench/ is this script's folder

from llm_train.config.recipe import TrackingSection
from llm_train.config.resolution import resolve_run
from llm_train.observability.metrics import StepMeter
from llm_train.observability.tracking import open_trackers
from llm_train.runtime.control import RunControl
from llm_train.runtime.loop import LoopConfig, train_loop
from llm_train.runtime.zero_engine import ZeroEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    recipe, ds_config, accelerator, model = setup(args.ds_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["optim"]["lr"])
    engine, optimizer = accelerator.prepare(model, optimizer)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    seq_len = recipe["data"]["seq_len"]
    blocks = packed_blocks(seq_len)[accelerator.process_index :: accelerator.num_processes]

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        start = 0
        while True:
            start = (start + micro) % (len(blocks) - micro)
            x = blocks[start : start + micro]
            yield {"input_ids": x, "labels": x}

    stream = batches()
    main_rank = accelerator.is_main_process
    say = print if main_rank else (lambda _: None)
    tracker = open_trackers(TrackingSection(), Path(tempfile.mkdtemp(prefix="overhead_")), {}, main_rank)
    control = RunControl(0, 0.0)
    tokens_per_step = micro * seq_len * accelerator.num_processes
    # llm_train's own engine code (train_step, grad norm) around the engine prepared above.
    run = resolve_run(
        "tiny-cpu", ["optim.grad_accum=1"], accelerator.num_processes, ds_config_path=args.ds_config
    )
    wrapped = ZeroEngine(run, say)
    wrapped.ds, wrapped.model, wrapped.accelerator = engine, model, accelerator

    def ours(first: int) -> None:
        cfg = LoopConfig(max_steps=first + args.block - 1, log_every=1, eval_every=0, start_step=first - 1)
        meter = StepMeter(tokens_per_step, micro * accelerator.num_processes, accelerator.num_processes)
        train_loop(wrapped, stream, [], cfg, tracker, control, lambda step: None, say, meter)

    def minimal(first: int) -> None:
        for step in range(first, first + args.block):
            batch = next(stream)
            loss = engine(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.print(f"step {step} loss {loss.item():.4f}")

    step = 1
    ours(step)  # warm-up of both paths, not timed
    step += args.block
    minimal(step)
    step += args.block
    blocks_s: dict[str, list[float]] = {"llm_train": [], "minimal": []}
    for round_ in range(args.rounds):
        order = [("llm_train", ours), ("minimal", minimal)]
        for name, loop in order if round_ % 2 == 0 else order[::-1]:
            accelerator.wait_for_everyone()
            t0 = time.perf_counter()
            loop(step)
            blocks_s[name].append((time.perf_counter() - t0) / args.block)
            step += args.block
    tracker.close()
    if main_rank:
        Path(args.out).write_text(json.dumps(blocks_s))
    finish(accelerator)


if __name__ == "__main__":
    run_and_exit(main)
