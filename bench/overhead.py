"""What llm_train adds around the work, each measured side by side in one run: three comparisons.

    .venv/bin/python -m bench.overhead loop [--rounds 5] [--steps 60]     # target <= 1.03
    .venv/bin/python -m bench.overhead vs-hf [--rounds 8] [--steps 150]   # target <= 1.0
    .venv/bin/python -m bench.overhead startup [--repeats 3]

- `loop` (the default): llm_train's training loop against a hand-written minimal Accelerate +
  DeepSpeed loop, 2 CPU processes (`loop` below says how);
- `vs-hf`: llm_train's step against the Hugging Face Trainer's on bench/mfu_matrix.py's --cpu-tiny
  job, both launched at once (`vs_hf` below);
- `startup`: launch to the end of the first optimizer step of tiny-cpu, by phase (`startup` below).

Each prints its ratios and writes bench/results/{overhead,step_time_vs_hf,startup}-<date>.json.
The loops of `loop` run as this module's own launches (`accelerate launch -m bench.overhead
minimal|interleaved ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from bench.harness import (
    CORPUS,
    OFFLINE_ENV,
    REPO,
    TOKENIZER,
    accelerate_launch,
    as_a_training_worker,
    kill_group,
    versions,
    write_result,
)
from bench.harness import run_or_exit as run_offline
from bench.hf_trainer_peer import command, save_job
from bench.mfu_matrix import CPU_SIZES, LOSS_STEPS, job, resolve, train_cmd
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


def tiny_cpu_launch(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    """tiny-cpu's 2-process launch for `steps` steps, with no evaluation, sample or final checkpoint."""
    args = ["--recipe", "tiny-cpu", "--output-dir", str(run_dir), f"--max-steps={steps}", *overrides]
    quiet = ["eval.every=0", "eval.batches=1", "output.sample_prompt=null", "checkpoint.at_end=false"]
    return accelerate_launch("llm_train/train.py", *args, *quiet)


# --- loop: llm_train's loop against a minimal one ------------------------------------------------------


def resolved_ds_config() -> dict:
    from llm_train.config.hardware import Device

    return resolve_run(
        "tiny-cpu", ["checkpoint.at_end=false"], world_size=2, device=Device.detect()
    ).ds_config


def llm_train_iterations(work: Path, i: int, steps: int, warmup: int, log_every: int) -> list[float]:
    run_dir = work / f"llm_train-{i}"
    run(tiny_cpu_launch(run_dir, steps, f"output.log_every={log_every}"))
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


def loop(argv: list[str]) -> None:
    """llm_train's training loop against a hand-written minimal Accelerate + DeepSpeed loop.

    Same tiny-cpu model, packed corpus, batch and DeepSpeed config (the JSON llm_train resolves is
    handed to the baseline), 2 processes on CPU, both logging every step. Two comparisons:

    - separate launches: each reports the wall time of every loop iteration after the warm-up
      (forward, backward, step, loss reduction, logging, metrics: everything the loop does), so
      start-up is not in it (`startup` measures that). A round is one launch of each, in alternating
      order; its ratio is median iteration time (llm_train) / median iteration time (minimal):
      medians, because on a shared machine single iterations stall when another process takes the
      core. The result is the median of the rounds' ratios.
    - one engine: both loops train ONE DeepSpeed engine alternately, --block steps each (llm_train's
      `train_loop` with its tracker, meter, run control and progress line; the minimal loop printing
      its loss), so load from other processes on a shared machine falls on both alike and only what
      each loop does around forward/backward/step differs.

    The minimal loop is what a user writes without llm_train: an Accelerator with a DeepSpeed plugin,
    a model built after it (so ZeRO-3 builds it inside zero.Init, as llm_train does), AdamW and the
    four-line loop; it prints the loss every --log-every steps like a user's loop would.
    """
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead loop",
        description="llm_train's training loop against a minimal Accelerate + DeepSpeed loop",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument(
        "--interleaved-rounds", type=int, default=8, help="0 skips the one-engine comparison."
    )
    parser.add_argument("--block", type=int, default=8, help="Steps per block in the one-engine comparison.")
    args = parser.parse_args(argv)

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


# --- vs-hf: llm_train's step against the Hugging Face Trainer's --------------------------------------

LOSS_ABS = 1e-4
MIN_STEPS = 10  # per contender, inside the window both trained in
STATS = ("wall_s", "fast_s", "cpu_s")  # per step, each launch: see the docstring
TIMEOUT_S = 600.0  # one round; at ~0.1 s a step it needs ~30 s, several times that on a loaded machine


@dataclass
class Contender:
    """One launch of a round: its process, and each metrics row with when this script saw it and the
    process's CPU seconds then."""

    name: str
    metrics: Path
    proc: subprocess.Popen[bytes]
    rows: list[dict[str, Any]] = field(default_factory=list)
    seen_at: list[tuple[float, float]] = field(default_factory=list)  # (perf_counter, CPU seconds) per row
    offset: int = 0
    pending: str = ""

    def poll(self) -> None:
        """Read the rows written since the last poll."""
        if not self.metrics.exists():
            return
        with self.metrics.open() as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.pending = (self.pending + chunk).split("\n")
        if not lines:
            return
        now = time.perf_counter()
        try:
            cpu = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return
        for line in lines:
            row = json.loads(line)
            if "loss" in row:
                self.rows.append(row)
                self.seen_at.append((now, cpu.user + cpu.system))

    def stop(self) -> None:
        kill_group(self.proc)


def commands(work: Path, steps: int) -> tuple[dict[str, list[str]], Any]:
    """Both launches (two steps beyond the measured ones, so that neither is stopped in its last step), on
    the matrix's --cpu-tiny baseline with tiny-cpu's own data; and llm_train's resolved run."""
    overrides = [*job(CPU_SIZES), f"data.cache_dir={work / 'cache'}"]
    run = resolve(CPU_SIZES, overrides)
    save_job(run, work, steps + 2)  # the peer's model config and the rows llm_train's run trains on
    ours = train_cmd(work / "llm_train", steps, CPU_SIZES.extra_args, overrides)
    peer = command(run, work, work / "hf_trainer", steps + 2, gpu=False)
    return {"llm_train": ours, "hf_trainer": peer}, run


def run_round(cmds: dict[str, list[str]], work: Path, steps: int, env: dict[str, str]) -> list[Contender]:
    """Both launches at once; each stopped once it has logged `steps` rows (or at TIMEOUT_S)."""
    contenders = []
    for name, cmd in cmds.items():
        metrics = work / name / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        with (work / f"{name}.log").open("w") as log:
            # Its own process group (a kill takes its helpers too), as the harness launches.
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )
        contenders.append(Contender(name, metrics, proc))
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < TIMEOUT_S:
            time.sleep(0.01)
            running = [c for c in contenders if c.proc.poll() is None and len(c.rows) < steps]
            for c in running:
                c.poll()
                if len(c.rows) >= steps:
                    c.stop()
            if not running:
                break
    finally:
        for c in contenders:
            c.stop()
    return contenders


def measure(contenders: list[Contender], warmup: int) -> dict[str, dict[str, Any]]:
    """Per contender, its steps inside the window in which both were past their warm-up and training."""
    for c in contenders:
        if len(c.rows) <= warmup + MIN_STEPS:
            raise RuntimeError(f"{c.name}: {len(c.rows)} steps logged (exit {c.proc.returncode})")
    start = max(c.seen_at[warmup - 1][0] for c in contenders)  # the end of the last warm-up step
    end = min(c.seen_at[-1][0] for c in contenders)
    got = {}
    for c in contenders:
        inside = [i for i, (t, _) in enumerate(c.seen_at) if start <= t <= end]
        if len(inside) < MIN_STEPS:
            raise RuntimeError(f"{c.name}: {len(inside)} steps while both trained; raise --steps")
        first, last = inside[0], inside[-1]
        rows = c.rows[first : last + 1]
        if c.name == "llm_train":
            wall = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:], strict=False)]
        else:
            wall = [r["step_time_s"] for r in rows[1:]]
        got[c.name] = {
            "steps": len(wall),
            "wall_s": statistics.median(wall),
            "fast_s": statistics.quantiles(wall, n=10)[0],
            "cpu_s": (c.seen_at[last][1] - c.seen_at[first][1]) / (last - first),
            "first_losses": [r["loss"] for r in c.rows[:LOSS_STEPS]],
        }
    return got


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def vs_hf(argv: list[str]) -> None:
    """llm_train's training step against the Hugging Face Trainer's on one CPU job.

    The job is bench/mfu_matrix.py's --cpu-tiny `baseline` against its `hf_trainer`: the tiny-cpu model
    (random init, its seed), fp32, seq 128, micro-batch 2, one process, ds_configs/zero2.json, AdamW at a
    constant lr, sdpa, a metrics row every step. The Trainer (bench/hf_trainer_peer.py, as it is) gets the
    same initial weights and the rows llm_train's data layer deals rank 0 of that run, in its order (here
    from tiny-cpu's bundled corpus, packed).

    Each round starts both at once, one torch thread each (--threads says why), the one started first
    alternating, and compares them over the seconds in which both were past their first --warmup steps and
    training: whatever else loads the machine then loads both alike (launching them one after the other,
    ABBA, measured whichever happened to run in a quiet moment: ratios from 0.36 to 2.3 on a shared 2-core
    machine at load ~10). Per contender, over its steps inside that window:

    - `wall_s`: the median interval between consecutive step ends: llm_train's consecutive rows'
      `elapsed_s` (the step and its logging), the peer's `step_time_s` (the same interval, its logging
      included too);
    - `fast_s`: the 10th percentile of those intervals;
    - `cpu_s`: the process's CPU seconds per step, read from /proc by this script as each row appears.

    Per round, the ratio llm_train / Trainer of each (below 1: llm_train's step is shorter); the result is
    the median over rounds with min and max, `passed` when the median `wall_s` ratio is <= 1.0 and both
    trained the same job (`same_job`: their first losses agree).
    """
    p = argparse.ArgumentParser(
        prog="python -m bench.overhead vs-hf",
        description="llm_train's training step against the Hugging Face Trainer's",
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=150, help="Steps per launch (the first --warmup left out).")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of both launches (0: as this environment has it). Default 1: on a shared "
        "2-core machine torch's two OpenMP threads spin while the other is descheduled, and a 0.05 s "
        "step took 2-3 s (load 10); one thread each measures each step's own work.",
    )
    args = p.parse_args(argv)
    if not 0 < args.warmup < args.steps - 1:
        p.error("need 0 < --warmup < --steps - 1")
    invoked = shlex.join([Path(sys.executable).name, "-m", "bench.overhead", "vs-hf", *argv])
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llm_train_step_vs_hf_") as tmp:
        work = Path(tmp)
        cmds, run = commands(work, args.steps)
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        env = {**os.environ, **OFFLINE_ENV, **threads}
        for i in range(args.rounds):
            order = ["llm_train", "hf_trainer"] if i % 2 == 0 else ["hf_trainer", "llm_train"]
            contenders = run_round({n: cmds[n] for n in order}, work, args.steps, env)
            try:
                got = measure(contenders, args.warmup)
            except RuntimeError as exc:
                logs = "\n".join(f"--- {n}\n{(work / f'{n}.log').read_text()[-2000:]}" for n in order)
                sys.exit(f"round {i}: {exc}\n{logs}")
            ours, theirs = got["llm_train"], got["hf_trainer"]
            record = {
                "round": i,
                "started_first": order[0],
                "steps_while_both_trained": {n: got[n]["steps"] for n in order},
                **{f"{n}_{k}": got[n][k] for n in got for k in STATS},
                **{f"{k[:-2]}_ratio": ours[k] / theirs[k] for k in STATS},
                "loadavg_1m": os.getloadavg()[0],
            }
            rounds.append({**record, "first_losses": {n: got[n]["first_losses"] for n in got}})
            print(
                json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}),
                flush=True,
            )
        cmd_text = {n: shlex.join(c).replace(tmp, "$WORK") for n, c in cmds.items()}
    tokens = run.layout.micro_batch_size * run.recipe.data.seq_len
    wall = spread([r["wall_ratio"] for r in rounds])
    # The same weights, rows and update give the same first losses; LOSS_ABS covers a peer that logs
    # them rounded to 4 decimals (as transformers 4.x's Trainer did).
    same_job = all(
        abs(a - b) <= LOSS_ABS
        for r in rounds
        for a, b in zip(r["first_losses"]["llm_train"], r["first_losses"]["hf_trainer"], strict=True)
    )
    summary = {
        "benchmark": "step_time_vs_hf",
        "command": invoked,
        "date": started,
        "setup": "CPU, one process: tiny-cpu model, fp32, seq 128, micro 2, ZeRO-2 JSON, sdpa, log every step "
        f"(bench/mfu_matrix.py --cpu-tiny's baseline vs hf_trainer); {args.steps} steps per launch, "
        f"the first {args.warmup} left out; {args.rounds} rounds, both launched at once in each",
        "same_job": same_job,
        "passed": wall["median"] <= 1.0 and same_job,
        **{f"{k[:-2]}_ratio": spread([r[f"{k[:-2]}_ratio"] for r in rounds]) for k in STATS},
        "llm_train_tokens_per_s": tokens / statistics.median(r["llm_train_wall_s"] for r in rounds),
        "hf_trainer_tokens_per_s": tokens / statistics.median(r["hf_trainer_wall_s"] for r in rounds),
        "loadavg_1m_before": load_before[0],
        "omp_num_threads": env.get("OMP_NUM_THREADS", "unset: torch uses every core"),
        "rounds": rounds,
        "commands": cmd_text,
        "versions": versions(),
    }
    write_result("step_time_vs_hf", summary)
    for k in STATS:
        r = summary[f"{k[:-2]}_ratio"]
        print(
            f"{k[:-2]} ratio llm_train/HF: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})"
        )


# --- startup: launch to the first optimizer step, by phase ----------------------------------------------


def one_launch(run_dir: Path) -> dict[str, float]:
    cmd = tiny_cpu_launch(run_dir, 1)
    launched = time.time()
    run_offline(cmd, timeout=900)
    record = json.loads((run_dir / "startup.json").read_text())
    phases = {"launcher": record["process_start"] - launched, **record["phases_s"]}
    phases["total"] = record["marks"]["first step"] - launched
    return phases


def startup(argv: list[str]) -> None:
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
    """
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead startup", description="tiny-cpu's start-up, by phase"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
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


COMPARISONS: dict[str, Callable[[list[str]], None]] = {"loop": loop, "vs-hf": vs_hf, "startup": startup}
WORKERS = {"minimal": minimal, "interleaved": interleaved}


def main() -> None:
    as_a_training_worker()
    args = sys.argv[1:]
    name = args.pop(0) if args and args[0] in (*COMPARISONS, *WORKERS) else "loop"
    if name in WORKERS:
        sys.argv[1:] = args  # the workers' own parsers read sys.argv
        run_and_exit(WORKERS[name])
    COMPARISONS[name](args)


if __name__ == "__main__":
    main()
