"""Long-sequence memory on CPU, measured against the planner: peak RSS per process of real training
runs with and without DeepSpeed ALST (Ulysses sequence parallelism, tiled MLP, tiled loss), next to
what llm_train/planning/memory_estimate.py predicts for the same configurations (issue #15, "Memory").

    .venv/bin/python -m bench.long_context_memory [--seq-len 8192] [--base-seq-len 256] [--configs A,B,C,D,E]
        # ~8 min on 2 cores; writes bench/results/long-context-memory-<date>.txt

Each configuration trains 2 steps of the tiny-cpu-sp2 recipe (tiny Llama, ZeRO-3, sdpa, fp32,
micro-batch 1) through `accelerate launch`:

  A  sp=1, 1 process, no switches                      (the baseline a user starts from)
  B  sp=2, 2 processes, memory.tiled_mlp + tiled_loss  (ALST)
  C  sp=2, 2 processes, no switches                    (Ulysses alone)
  D  sp=1, 1 process, tiled_mlp + tiled_loss           (the switches alone)
  E  A with padded rows (an attention mask), see below

Measure: VmHWM (the kernel's peak resident set) of every training process, read from
/proc/PID/status while it runs; under sp=2 the larger of the two ranks (the planner's numbers are
per rank). On CPU torch has no caching allocator: tensors are malloc'd and freed, so the peak RSS
is the peak of what was live plus what glibc's heap keeps (after step 1 RSS stays a few hundred MiB
above its floor, reused by step 2, so the peak is step 1's). Each configuration also runs at --base-seq-len; the
difference isolates the sequence-dependent part (activations, logits, all-to-all buffers) from
Python, torch, DeepSpeed and the model states.

Predicted: the planner's per-rank terms for the same recipe and overrides (planning.candidate
memory_inputs -> estimate_memory), the same difference of activations + logits and loss +
Ulysses all-to-all buffers, with the 10% allocator slack the planner adds on CPU
(planning.candidate.needs). The planner counts this fp32 run's activations at 4 bytes (16-bit runs at 2).

Rows: the whole bundled corpus is one document (`sample_by: document`) cut into full rows of
seq_len tokens, so no row is padded and sp=1's sdpa runs causal without a mask, as sp=2 does
(the run drops the mask of padded rows under SP). Configuration E keeps the recipe's paragraph
rows (~45 tokens of text, the rest padding). At sp=1 HF passes sdpa a [seq x seq] bool mask, and
the peak grows by one fp32 [seq x seq] tensor per layer (measured at 8k: ~+1.1 GiB, ~4 x 256 + 64 MiB).
The planner does not count it.

Tiled loss cuts ceil(tokens x vocab x 4 bytes / 1 GiB) tiles (runtime/tiling.py): with the
tiny model's 4,096-token vocabulary that is one tile at 8k, so here it changes nothing and the
planner agrees; B's saving is sequence parallelism and the tiled MLP. --vocab-size raises the
vocabulary (rows beyond the tokenizer's stay untrained) to make the loss tile on a machine with
the RAM for sp=1's full logits (at 8k, 69,632 gives 2 tiles under sp=2 and ~2 GiB of logits
under sp=1, several times that at the loss's peak; not run on this 2-core, 23 GiB machine).

A benchmark, not a test: it prints the table and the ratios and never fails on their values.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

from bench.harness import OFFLINE_ENV, REPO, as_a_training_worker, proc_kib_field, versions
from llm_train.config.resolution import resolve_run
from llm_train.planning.candidate import CPU_PROCESS_HOST_BYTES, memory_inputs, needs
from llm_train.planning.memory_estimate import ALLOCATOR_SLACK_FRACTION, estimate_memory
from llm_train.planning.shapes import shape_from_config
from llm_train.runtime.launch_env import SPAWNED_ENV, free_port

MiB = 2**20
RECIPE = "tiny-cpu-sp2"
CORPUS = REPO / "llm_train" / "assets" / "tiny" / "corpus.txt"
ACCELERATE = Path(sys.executable).with_name("accelerate")
TRAIN = "llm_train/train.py"
STEPS = 2
POLL_S = 0.1
# The planner's sequence-dependent per-rank terms.
SEQUENCE_TERMS = ("activations", "logits_and_loss", "sequence_parallel_buffers")
SWITCHES = ["memory.tiled_mlp=true", "memory.tiled_loss=true"]


@dataclass(frozen=True)
class Config:
    name: str
    what: str
    sp: int
    switches: bool
    padded_rows: bool = False

    @property
    def processes(self) -> int:
        return self.sp


CONFIGS = {
    c.name: c
    for c in (
        Config("A", "sp=1, no switches", 1, False),
        Config("B", "sp=2 + tiled MLP + tiled loss", 2, True),
        Config("C", "sp=2, no switches", 2, False),
        Config("D", "sp=1 + tiled MLP + tiled loss", 1, True),
        Config("E", "sp=1, no switches, padded rows (mask)", 1, False, padded_rows=True),
    )
}


def overrides(config: Config, seq_len: int, vocab_size: int | None) -> list[str]:
    out = [
        f"data.seq_len={seq_len}",
        f"model.config.max_position_embeddings={seq_len}",
        "optim.micro_batch_size=1",
        f"deepspeed.sequence_parallel={config.sp}",
        f"hardware.processes_per_node={config.processes}",
        "data.eval_fraction=0",
        "eval.every=0",
        "output.sample_prompt=null",
        "output.log_every=1",
        "checkpoint.at_end=false",
        "tracking.mode=disabled",
        "data.num_proc=1",  # tokenise in the rank: no forked tokenisers beside it
    ]
    if not config.padded_rows:
        out.append(f"data.train=[{{path: {CORPUS}, sample_by: document}}]")
    if vocab_size:
        out.append(f"model.config.vocab_size={vocab_size}")
    return out + (SWITCHES if config.switches else [])


# --- the planner's prediction ------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicted:
    terms: dict[str, int]
    """The planner's per-rank terms (bytes)."""
    process_bytes: int
    """What the planner expects one CPU training process to hold: its terms x (1 + slack) + the process."""

    def sequence_bytes(self) -> float:
        """Activations + logits + all-to-all buffers, with the planner's allocator slack."""
        return sum(self.terms.get(k, 0) for k in SEQUENCE_TERMS) * (1 + ALLOCATOR_SLACK_FRACTION)


def predict(config: Config, seq_len: int, vocab_size: int | None) -> Predicted:
    run = resolve_run(RECIPE, overrides(config, seq_len, vocab_size), world_size=config.processes)
    inputs = memory_inputs(run, shape_from_config(run.model_fields))
    estimate = estimate_memory(inputs)
    device_bytes, _ = needs(estimate, inputs, "cpu")
    return Predicted(estimate.gpu_terms, device_bytes + CPU_PROCESS_HOST_BYTES)


# --- a real run --------------------------------------------------------------------------------------


@dataclass
class Measured:
    rank_peaks: list[int] = field(default_factory=list)
    """VmHWM of each training process (bytes)."""
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.rank_peaks)


def _vm_hwm(pid: int) -> int | None:
    return proc_kib_field(f"/proc/{pid}/status", "VmHWM")


def _runs_train(proc: psutil.Process) -> bool:
    """Runs llm_train/train.py itself (not the `accelerate launch` CLI, whose arguments name it too)."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    return any(arg.endswith(TRAIN) for arg in cmd) and not any(arg.endswith("accelerate") for arg in cmd[:2])


@dataclass
class _Seen:
    """A train.py process of one launch: its parent, whether the launcher spawned it, its VmHWM."""

    ppid: int
    spawned: bool
    peak: int = 0


def _ranks(seen: dict[int, _Seen]) -> list[int]:
    """The training ranks among the train.py processes of one launch.

    With several processes the first train.py spawns the ranks with LLM_TRAIN_SPAWNED set
    (runtime/launch_env.py); with one it trains itself. Either may fork helpers, which keep its command
    line and environment: a child whose parent is a train.py process with the same flag is a fork.
    """

    def forked(pid: int) -> bool:
        parent = seen.get(seen[pid].ppid)
        return parent is not None and parent.spawned == seen[pid].spawned

    started = [pid for pid in seen if not forked(pid)]
    launchers = {seen[pid].ppid for pid in started if seen[pid].ppid in seen}
    return [pid for pid in started if pid not in launchers]


def measure(config: Config, seq_len: int, vocab_size: int | None, work: Path) -> Measured:
    run_dir = work / f"{config.name}-{seq_len}"
    log = work / f"{config.name}-{seq_len}.log"
    cmd = [
        str(ACCELERATE),
        "launch",
        "--num_processes",
        str(config.processes),
        "--main_process_port",
        str(free_port()),
        TRAIN,
        "--recipe",
        RECIPE,
        "--output-dir",
        str(run_dir),
        f"--max-steps={STEPS}",
        *overrides(config, seq_len, vocab_size),
    ]
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_OFFLINE": "1"}
    seen: dict[int, _Seen] = {}
    started = time.time()
    with open(log, "w") as out:
        proc = psutil.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
        # VmHWM only grows, so a reading at any time after the peak is the peak; the last reading
        # comes at most POLL_S before the process ends (its teardown and export take longer).
        while proc.poll() is None:
            try:
                children = proc.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                if child.pid not in seen and _runs_train(child):
                    with contextlib.suppress(psutil.Error):
                        spawned = SPAWNED_ENV in child.environ()
                        seen[child.pid] = _Seen(child.ppid(), spawned)
                hwm = _vm_hwm(child.pid) if child.pid in seen else None
                if hwm is not None:
                    seen[child.pid].peak = max(seen[child.pid].peak, hwm)
            time.sleep(POLL_S)
    result = Measured(wall_s=time.time() - started)
    if proc.returncode != 0:
        sys.exit(
            f"{config.name} at {seq_len} failed (exit {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}"
        )
    ranks = _ranks(seen)
    if len(ranks) != config.processes:
        sys.exit(
            f"{config.name} at {seq_len}: found {len(ranks)} training ranks, expected {config.processes}"
        )
    result.rank_peaks = sorted((seen[pid].peak for pid in ranks), reverse=True)
    result.losses = _losses(log)
    return result


def _losses(log: Path) -> list[float]:
    """Per-step losses from the console ("| loss 8.3851 |"): the configurations train the same rows."""
    losses = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("step ") and "| loss " in line:
            losses.append(float(line.split("| loss ")[1].split()[0]))
    return losses


# --- report ------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def report(
    configs: list[Config],
    seq_len: int,
    base: int,
    vocab_size: int | None,
    measured: dict[tuple[str, int], Measured],
    predicted: dict[tuple[str, int], Predicted],
) -> str:
    lines = [
        f"# bench/long_context_memory.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "# " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        f"# recipe {RECIPE} (tiny Llama: hidden 128, intermediate 384, 4 layers, 4 heads, vocab "
        f"{vocab_size or 4096}), ZeRO-3, sdpa, fp32, micro-batch 1, {STEPS} steps; rows: the corpus as one "
        "document cut into full rows (E: the recipe's padded paragraph rows)",
        f"# peak RSS = VmHWM per training process (max over ranks); 'seq part' = peak at {seq_len} - peak at {base}",
        "# predicted = planner per-rank terms (activations + logits and loss + all-to-all buffers) x 1.10 slack,",
        "#   same difference",
        "",
        f"{'config':<42} {'peak@' + str(seq_len):>10} {'peak@' + str(base):>9} {'seq part':>9} "
        f"{'predicted':>9} {'planner/proc':>12} {'ranks @' + str(seq_len):>16} {'wall s':>7}  losses",
    ]
    seq_part: dict[str, float] = {}
    pred: dict[str, float] = {}
    for c in configs:
        long, short = measured[(c.name, seq_len)], measured[(c.name, base)]
        p_long, p_short = predicted[(c.name, seq_len)], predicted[(c.name, base)]
        seq_part[c.name] = long.peak - short.peak
        pred[c.name] = p_long.sequence_bytes() - p_short.sequence_bytes()
        ranks = "/".join(_mib(r) for r in long.rank_peaks)
        losses = " ".join(f"{x:.4f}" for x in long.losses)
        lines.append(
            f"{c.name + '  ' + c.what:<42} {_mib(long.peak):>10} {_mib(short.peak):>9} {_mib(seq_part[c.name]):>9} "
            f"{_mib(pred[c.name]):>9} {_mib(p_long.process_bytes):>12} "
            f"{ranks:>16} {long.wall_s:>7.0f}  {losses}"
        )
    lines.append(
        "(MiB; 'planner/proc' is the planner's whole CPU process at the long sequence: terms x 1.10 + 1 GiB)"
    )
    lines.append("")
    lines.append(f"planner terms per rank at {seq_len} (MiB):")
    for c in configs:
        terms = predicted[(c.name, seq_len)].terms
        shown = ", ".join(f"{k} {_mib(v)}" for k, v in terms.items() if k != "cuda_context_and_slack")
        lines.append(f"  {c.name}: {shown}")
    lines.append("")
    lines.append("ratios of the sequence-dependent part, measured vs predicted:")
    pairs = [
        ("B", "A", "ALST vs sp=1 (the issue's claim)"),
        ("C", "A", "Ulysses alone"),
        ("D", "A", "tiled switches alone"),
        ("B", "C", "switches under sp=2"),
        ("E", "A", "padded-row mask"),
    ]
    for num, den, what in pairs:
        if num in seq_part and den in seq_part and seq_part[den] > 0:
            predicted = pred[num] / pred[den] if pred[den] else float("nan")
            lines.append(
                f"  {num}/{den} {what:<34} measured {seq_part[num] / seq_part[den]:.2f}   predicted {predicted:.2f}"
            )
    if "A" in seq_part and "B" in seq_part:
        verdict = "lower" if seq_part["B"] < seq_part["A"] else "NOT lower"
        lines.append(
            f"direction: B's sequence-dependent peak RSS is {verdict} than A's "
            f"({_mib(seq_part['B'])} vs {_mib(seq_part['A'])} MiB); whole-process peak "
            f"{_mib(measured[('B', seq_len)].peak)} vs {_mib(measured[('A', seq_len)].peak)} MiB"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    as_a_training_worker()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--base-seq-len", type=int, default=256, help="Short run subtracted from each peak.")
    parser.add_argument(
        "--configs", default="A,B,C,D,E", help="Comma-separated among A-E (see the docstring)."
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="Override model.config.vocab_size.")
    parser.add_argument("--no-write", action="store_true", help="Print only; no bench/results file.")
    args = parser.parse_args()
    configs = [CONFIGS[name.strip()] for name in args.configs.split(",")]
    measured: dict[tuple[str, int], Measured] = {}
    predicted: dict[tuple[str, int], Predicted] = {}
    with tempfile.TemporaryDirectory(prefix="long-context-memory-") as tmp:
        for config in configs:
            for seq_len in (args.seq_len, args.base_seq_len):
                predicted[(config.name, seq_len)] = predict(config, seq_len, args.vocab_size)
                m = measure(config, seq_len, args.vocab_size, Path(tmp))
                measured[(config.name, seq_len)] = m
                print(
                    f"{config.name} seq {seq_len}: peak {_mib(m.peak)} MiB per rank ({m.wall_s:.0f} s)",
                    flush=True,
                )
    text = report(configs, args.seq_len, args.base_seq_len, args.vocab_size, measured, predicted)
    print(text)
    if not args.no_write:
        out = REPO / "bench" / "results" / f"long-context-memory-{datetime.now(timezone.utc):%Y%m%d-%H%M}.txt"
        out.write_text(text)
        print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
