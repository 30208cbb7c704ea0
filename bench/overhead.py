"""What llm_train adds around the work: its training loop against a hand-written minimal one, side by side.

    .venv/bin/python -m bench.overhead [--rounds 8] [--block 8]     # target <= 1.03

Both loops train ONE DeepSpeed engine (tiny-cpu's model, packed corpus, batch and the DeepSpeed config
llm_train resolves, 2 CPU processes) in alternating --block-step blocks: llm_train's `train_loop` with its
tracker, meter, run control and progress line, and the four-line loop a user writes without llm_train
(an Accelerator with a DeepSpeed plugin, AdamW, printing its loss every step). Load from other processes
on a shared machine falls on both alike, so only what each loop does around forward/backward/step
differs. The result is the median over rounds of llm_train's seconds per step over the minimal loop's;
it prints the ratio and writes bench/results/overhead-<date>.json.

Separate launches of each loop, alternated, were this bench's first comparison: on this 2-core machine
their ratios spread from 0.54 to 1.25 round to round (0.89 to 1.11 when quiet), far wider than a 3%
target, while the one-engine medians stayed within 0.97-1.05 over the four runs recorded beside them
(bench/results/overhead-old-vs-new-20261130.txt: two commits, quiet and loaded); they were retired. Start-up,
the other thing a launch adds, is in every run's own RUN_DIR/startup.json, by phase
(observability/metrics.py StartupClock).

The loops run as this module's own launch (`accelerate launch -m bench.overhead interleaved ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from bench.environment import (
    CORPUS,
    REPO,
    TOKENIZER,
    accelerate_launch,
    as_a_training_worker,
    run_or_exit,
    versions,
    write_result,
)
from llm_train.config.recipe_sections import TrackingSection
from llm_train.config.resolution import resolve_run
from llm_train.observability.metrics import StepMeter
from llm_train.observability.tracking import open_trackers
from llm_train.runtime.checkpointing.control import RunControl
from llm_train.runtime.engines.zero_engine import ZeroEngine
from llm_train.runtime.loop import LoopConfig, train_loop

# One intra-op thread per rank (what llm_train's launcher and Accelerate pick on a 2-core machine
# anyway), so threading never differs between the loops.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TARGET = 1.03


def resolved_ds_config() -> dict:
    from llm_train.config.hardware import Device

    return resolve_run(
        "tiny-cpu", ["checkpoint.at_end=false"], world_size=2, device=Device.detect()
    ).ds_config


def compare(argv: list[str]) -> None:
    """The one-engine comparison: per-round ratios, their median, against TARGET."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description="llm_train's training loop against a minimal one"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=8, help="Steps per block.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llm_train_overhead_") as tmp:
        work = Path(tmp)
        ds_config = work / "ds_config.json"  # exactly what llm_train hands DeepSpeed for this launch
        ds_config.write_text(json.dumps(resolved_ds_config()))
        out = work / "interleaved.json"
        worker = [
            "--ds-config",
            str(ds_config),
            f"--rounds={args.rounds}",
            f"--block={args.block}",
            "--out",
            str(out),
        ]
        cmd = accelerate_launch("bench.overhead", "interleaved", *worker, deepspeed=True)
        run_or_exit(cmd, timeout=1800, env=ONE_THREAD)
        blocks = json.loads(out.read_text())
    ratios = [a / b for a, b in zip(blocks["llm_train"], blocks["minimal"], strict=True)]
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio <= TARGET else "misses"
    print(
        f"one engine, alternating {args.block}-step blocks: ratio llm_train / minimal {ratio:.3f} "
        f"(median of {len(ratios)}; blocks {', '.join(f'{r:.3f}' for r in ratios)}): {verdict} the target <= {TARGET}"
    )
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": "overhead",
        "setup": "tiny-cpu, ZeRO-3 (ds_configs/zero3.json resolved), fp32, 2 processes on CPU (gloo), "
        f"micro-batch 8 x seq 128 per rank, one engine, {args.rounds} rounds of {args.block}-step blocks",
        "block_seconds_per_step": blocks,
        "block_ratios": ratios,
        "ratio_median": ratio,
        "load_average_end": os.getloadavg(),
        "target": TARGET,
        "versions": versions(),
    }
    write_result("overhead", record)


# --- the launch: both loops on one engine -----------------------------------------------------------


def packed_blocks(seq_len: int) -> torch.Tensor:
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    eos = 2
    ids: list[int] = []
    for doc in CORPUS.read_text().split("\n\n"):
        if doc.strip():
            ids += tok.encode(doc, add_special_tokens=False).ids + [eos]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def setup(ds_config_path: str) -> tuple[dict, dict, Accelerator, torch.nn.Module]:
    """tiny-cpu's recipe, the resolved DS config, an Accelerator on it, and the seeded tiny model."""
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    ds_config = json.loads(Path(ds_config_path).read_text())
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), kwargs_handlers=handlers
    )
    fields = dict(recipe["model"]["config"])
    torch.manual_seed(recipe["optim"]["seed"])
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields), attn_implementation="sdpa"
    )
    return recipe, ds_config, accelerator, model


def interleaved() -> None:
    """Both loops on one engine in alternating blocks: each block's seconds per step, into --out (rank 0)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--block", type=int, required=True)
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
    accelerator.end_training()  # also destroys the process group (AcceleratorState.destroy_process_group)


def main() -> None:
    as_a_training_worker()
    args = sys.argv[1:]
    if args[:1] == ["interleaved"]:
        sys.argv[1:] = args[1:]  # the worker's own parser reads sys.argv
        interleaved()
        sys.stdout.flush()
        # As in llm_train/train.py: skip interpreter teardown, where gloo/shm threads sometimes
        # abort ("terminate called without an active exception") after all results are written.
        os._exit(0)
    compare(args)


if __name__ == "__main__":
    main()
