"""llm_train's training loop against a hand-written minimal Accelerate + DeepSpeed loop, side by side.

Same tiny-cpu model, packed corpus, batch and DeepSpeed config (the JSON llm_train
resolves is handed to the baseline), 2 processes on CPU, both logging every step. Two comparisons:

- separate launches: each reports the wall time of every loop iteration after WARMUP (forward,
  backward, step, loss reduction, logging, metrics: everything the loop does), so start-up is not in
  it (bench/startup.py measures that). A round is one launch of each, in alternating order; its ratio
  is median iteration time (llm_train) / median iteration time (minimal): medians, because on a
  shared machine single iterations stall when another process takes the core. The result is the
  median of the rounds' ratios.
- one engine: both loops train ONE DeepSpeed engine alternately, BLOCK steps each (llm_train's
  `train_loop` with its tracker, meter, run control and progress line; the minimal loop printing its
  loss), so load from other processes on a shared machine falls on both alike and only what each
  loop does around forward/backward/step differs.

Target: <= 1.03.

    .venv/bin/python -m bench.overhead [--rounds 5] [--steps 60]

Prints one line per round and the ratios; writes bench/results/overhead-<date>.json. The loops run
as this module's own launches (`accelerate launch -m bench.overhead minimal|interleaved ...`). The
minimal loop is what a user writes without llm_train: an Accelerator with a DeepSpeed plugin, a
model built after it (so ZeRO-3 builds it inside zero.Init, as llm_train does), AdamW and the
four-line loop; it prints the loss every `--log-every` steps like a user's loop would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from bench.harness import (
    CORPUS,
    REPO,
    TOKENIZER,
    accelerate_launch,
    as_a_training_worker,
    versions,
    write_result,
)
from bench.harness import run_or_exit as run_offline
from llm_train.config.recipe import TrackingSection
from llm_train.config.resolution import resolve_run
from llm_train.observability.metrics import StepMeter
from llm_train.observability.tracking import open_trackers
from llm_train.runtime.control import RunControl
from llm_train.runtime.loop import LoopConfig, train_loop
from llm_train.runtime.zero_engine import ZeroEngine

# One intra-op thread per rank for both loops (what llm_train's launcher and Accelerate pick on a
# 2-core machine anyway), so threading never differs between them.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TARGET = 1.03


def run(cmd: list[str]) -> None:
    run_offline(cmd, timeout=1800, env=ONE_THREAD)


def resolved_ds_config() -> dict:
    from llm_train.config.hardware import Device

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
            "bench.overhead", "minimal", "--ds-config", str(ds_config), *script_args, deepspeed=True
        )
    )
    return json.loads(out.read_text())["iteration_s"]


def interleaved_ratios(work: Path, ds_config: Path, rounds: int, block: int) -> list[float]:
    """Per-round ratios of the one-engine, alternating-blocks comparison (`interleaved` below)."""
    out = work / "interleaved.json"
    script_args = [f"--rounds={rounds}", f"--block={block}", "--out", str(out)]
    run(
        accelerate_launch(
            "bench.overhead", "interleaved", "--ds-config", str(ds_config), *script_args, deepspeed=True
        )
    )
    blocks = json.loads(out.read_text())
    return [a / b for a, b in zip(blocks["llm_train"], blocks["minimal"], strict=True)]


def compare() -> None:
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
            interleaved_ratios(work, ds_config, args.interleaved_rounds, args.block)
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


# --- the two loops' launches ----------------------------------------------------------------------


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


def minimal() -> None:
    """The minimal loop's launch: the wall time of every iteration after the warm-up, into --out."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    recipe, ds_config, accelerator, model = setup(args.ds_config)
    optim = recipe["optim"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
    model, optimizer = accelerator.prepare(model, optimizer)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    blocks = packed_blocks(recipe["data"]["seq_len"])
    blocks = blocks[accelerator.process_index :: accelerator.num_processes]  # shard by rank
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))

    model.train()
    marks: list[float] = []
    for step in range(1, args.steps + 1):
        start = (step * micro) % (len(order) - micro)
        batch = blocks[order[start : start + micro]].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)  # DeepSpeed: backward + step at the accumulation boundary
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0:
            accelerator.print(f"step {step} loss {loss.item():.4f}")
        marks.append(time.perf_counter())  # end of step `step`, after its logging, as llm_train's elapsed_s
    iterations = [b - a for a, b in zip(marks[args.warmup - 1 : -1], marks[args.warmup :], strict=True)]
    if accelerator.is_main_process:
        Path(args.out).write_text(
            json.dumps({"iteration_s": iterations, "world_size": accelerator.num_processes})
        )
    finish(accelerator)


def finish(accelerator: Accelerator) -> None:
    accelerator.end_training()  # also destroys the process group (AcceleratorState.destroy_process_group)


def run_and_exit(main: Callable[[], None]) -> None:
    main()
    sys.stdout.flush()
    # As in llm_train/train.py: skip interpreter teardown, where gloo/shm threads sometimes
    # abort ("terminate called without an active exception") after all results are written.
    os._exit(0)


def interleaved() -> None:
    """Both loops on one engine in alternating blocks: each block's seconds per step, into --out (rank 0)."""
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


def main() -> None:
    as_a_training_worker()
    if len(sys.argv) > 1 and sys.argv[1] in ("minimal", "interleaved"):
        role = sys.argv.pop(1)
        run_and_exit(minimal if role == "minimal" else interleaved)
    compare()


if __name__ == "__main__":
    main()
