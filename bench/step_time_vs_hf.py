"""llm_train's training step against the Hugging Face Trainer's on one CPU job, side by side in one run.

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

    python -m bench.step_time_vs_hf [--rounds 8] [--steps 150] [--warmup 10] [--threads 1] [--out FILE]

Writes FILE, else bench/results/step_time_vs_hf-DATE.json, with the command in its `command` field;
prints one line per round as it ends.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.harness import OFFLINE_ENV, REPO, kill_group, versions
from bench.hf_trainer_peer import command, save_job
from bench.mfu_matrix import CPU_SIZES, LOSS_STEPS, job, resolve, train_cmd

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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--out", type=Path, help="Result file (default bench/results/step_time_vs_hf-DATE.json).")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps - 1:
        p.error("need 0 < --warmup < --steps - 1")
    return args


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


def main() -> None:
    args = parse_args()
    invoked = shlex.join([Path(sys.executable).name, *sys.argv])
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
    out = args.out or REPO / "bench" / "results" / f"step_time_vs_hf-{time.strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for k in STATS:
        r = summary[f"{k[:-2]}_ratio"]
        print(
            f"{k[:-2]} ratio llm_train/HF: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
