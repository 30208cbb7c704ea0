"""Does `optim.state_dtype=bf16` cost fine-tuning quality? fp32 vs bf16 optimizer states, side by side.

bf16 master weights and Adam states (DeepSpeed's bf16_master_weights_and_grads +
bf16_optimizer_states) halve the host RAM of ZeRO-Offload, but a bf16 weight has 8 bits of
mantissa: an update smaller than about 2^-9 of the weight rounds away to nothing, and
fine-tuning learning rates produce exactly such updates. So this measures it (issue #14):

1. pretrain the tiny-cpu Llama from scratch on the bundled corpus (fp32, ZeRO-2) and export it;
2. fine-tune that model on the bundled chat examples (tiny-cpu-chat: a new format and loss on
   assistant turns only, i.e. a real fine-tune) for STEPS steps at lr 1e-5 and 1e-4, with fp32
   and with bf16 optimizer states: 4 runs, all precision=bf16, ZeRO-2 + optimizer CPU offload
   (DeepSpeed's CPU Adam), same seed, data order and eval set; one process each (a world of one
   is the same math as two, and the 2-core machine runs it twice as fast without gloo);
3. report each run's first and final train loss, the mean of its last 20 steps, and its eval loss
   at each evaluation, against the pretrained model's eval loss before fine-tuning (a 1-step run
   at lr 1e-12), and how much of the fp32 run's eval improvement the bf16 run kept.

    .venv/bin/python -m bench.bf16_states_quality [--steps 300] [--pretrain-steps 200] [--work DIR]

Writes bench/results/bf16-states-quality-<date>.txt (the table) and prints it. About 25 min on 2 CPU
cores (each run ~4-6 min, one intra-op thread); with --work DIR, finished runs found there are reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, versions
from bench.harness import run_or_exit as run

TRAIN = str(REPO / "llm_train" / "train.py")
LRS = (1e-5, 1e-4)
STATES = ("fp32", "bf16")
TAIL = 20  # steps averaged for the final train loss: single-step losses vary by batch
# One intra-op thread: on a busy 2-core machine torch's spinning thread pool made steps ~10x slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def pretrain(out: Path, steps: int) -> Path:
    """The tiny-cpu model, trained from scratch on the bundled corpus; returns its exported HF directory."""
    if (out / "final" / "config.json").is_file():
        return out / "final"  # kept from an earlier invocation with the same --work
    run(
        [
            sys.executable,
            TRAIN,
            "--recipe",
            "tiny-cpu",
            "--ds-config",
            "zero2",
            "--output-dir",
            str(out),
            f"--max-steps={steps}",
            "precision=fp32",
            "eval.every=0",
            "output.sample_prompt=null",
        ],
        timeout=3600,
        env=ONE_THREAD,
    )
    return out / "final"


def finetune(
    out: Path, model: Path, lr: float, state_dtype: str, steps: int, eval_every: int, warmup: int = 10
) -> float:
    """One fine-tuning run; returns its wall time in seconds (0 when a finished run in `out` is reused)."""
    if _finished(out, steps):
        return 0.0
    started = time.monotonic()
    run(
        [
            sys.executable,
            TRAIN,
            "--recipe",
            "tiny-cpu-chat",
            "--ds-config",
            "zero2_offload",
            "--output-dir",
            str(out),
            f"--max-steps={steps}",
            "precision=bf16",
            f"optim.state_dtype={state_dtype}",
            f"optim.lr={lr}",
            f"optim.warmup_steps={warmup}",
            "model.init=pretrained",
            f"model.name_or_path={model}",
            f"eval.every={eval_every}",
            "eval.batches=16",
            # 300 steps are ~20 passes over the 185 bundled conversations: the point is the size of
            # the updates, not generalisation, and all four runs see the same data in the same order.
            "data.max_epochs=100",
            "output.log_every=1",
            "output.sample_prompt=null",
        ],
        timeout=3600,
        env=ONE_THREAD,
    )
    return time.monotonic() - started


def _finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return any(r.get("step") == steps and "eval_loss" in r for r in rows)


def eval_before(work: Path, model: Path) -> float:
    """The pretrained model's eval loss on the fine-tuning eval set, before any fine-tuning.

    The loop evaluates after a step, never before the first; one step at lr 1e-12 changes no
    weight (in fp32 master weights, then cast to bf16), so its eval is the starting point.
    """
    run_dir = work / "before"
    finetune(run_dir, model, 1e-12, "fp32", steps=1, eval_every=1, warmup=0)
    return float(summarise(run_dir)["evals"][1])  # type: ignore[index]


def summarise(run_dir: Path) -> dict[str, object]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    last = max(losses)
    tail = [losses[s] for s in sorted(losses)[-TAIL:]]
    return {
        "first": losses[min(losses)],
        "final": losses[last],
        "tail_mean": statistics.fmean(tail),
        "evals": evals,
    }


def report(
    results: dict[tuple[float, str], dict[str, object]], before: float, steps: int, pretrain_steps: int
) -> str:
    lines = [
        f"# bf16 vs fp32 optimizer states, fine-tuning quality ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        f"# {json.dumps(versions())}",
        f"# model: tiny-cpu Llama (~2M params) pretrained {pretrain_steps} steps on the bundled corpus (fp32),",
        f"# then fine-tuned {steps} steps on the bundled chat examples (tiny-cpu-chat, packed, seq_len 256,",
        "# micro-batch 4, cosine schedule with 10 warmup steps to 0.1 x lr, weight decay 0.01, seed 1234);",
        "# precision=bf16, ZeRO-2 + optimizer CPU offload (DeepSpeed CPU Adam), one process; same data and eval set.",
        "# fp32 states: bf16 weights/grads, fp32 master weights + Adam moments (the default).",
        "# bf16 states: optim.state_dtype=bf16 (bf16_master_weights_and_grads + bf16_optimizer_states).",
        f"# 'first' = train loss of step 1's batch; 'last-{TAIL} mean' = mean train loss of the last {TAIL} steps",
        "# (the same batches in every run); eval = held-out 5% of the chat examples (the same in every run).",
        f"# eval loss before fine-tuning (the pretrained model): {before:.4f}",
        "",
    ]
    eval_steps = sorted({s for r in results.values() for s in r["evals"]})  # type: ignore[attr-defined]
    header = f"{'lr':>7} {'states':>6} {'first':>7} {'final':>7} {f'last-{TAIL} mean':>13}" + "".join(
        f" {f'eval@{s}':>9}" for s in eval_steps
    )
    lines += [header, "-" * len(header)]
    for (lr, dtype), r in sorted(results.items(), key=lambda item: (item[0][0], item[0][1] != "fp32")):
        evals = r["evals"]
        lines.append(
            f"{lr:>7.0e} {dtype:>6} {r['first']:>7.4f} {r['final']:>7.4f} {r['tail_mean']:>13.4f}"
            + "".join(f" {evals.get(s, float('nan')):>9.4f}" for s in eval_steps)  # type: ignore[attr-defined]
        )
    lines.append("")
    final_eval = eval_steps[-1]
    for lr in LRS:
        full, half = results[(lr, "fp32")], results[(lr, "bf16")]
        gain_full = before - full["evals"][final_eval]  # type: ignore[index]
        gain_half = before - half["evals"][final_eval]  # type: ignore[index]
        kept = 100.0 * gain_half / gain_full if gain_full > 0 else float("nan")
        d_train = half["tail_mean"] - full["tail_mean"]  # type: ignore[operator]
        lines.append(
            f"lr {lr:.0e}: eval loss fell {gain_full:.4f} with fp32 states, {gain_half:.4f} with bf16 states "
            f"({kept:.0f}% of the fp32 improvement); bf16 ends {gain_full - gain_half:+.4f} eval loss and "
            f"{d_train:+.4f} last-{TAIL} train loss above fp32"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="Fine-tuning steps per run.")
    parser.add_argument(
        "--pretrain-steps", type=int, default=200, help="Pretraining steps of the tiny model."
    )
    parser.add_argument(
        "--out", type=Path, help="Result file (default bench/results/bf16-states-quality-<date>.txt)."
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="Keep the runs in this directory (default: a temporary one); finished runs there are reused.",
    )
    args = parser.parse_args()
    eval_every = max(1, args.steps // 3)
    results: dict[tuple[float, str], dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bf16-states-") as tmp:
        work = args.work or Path(tmp)
        started = time.monotonic()
        model = pretrain(work / "pretrain", args.pretrain_steps)
        print(f"pretrained {args.pretrain_steps} steps in {time.monotonic() - started:.0f}s", flush=True)
        before = eval_before(work, model)
        print(f"eval loss before fine-tuning: {before:.4f}", flush=True)
        for lr in LRS:
            for dtype in STATES:
                run_dir = work / f"ft-{lr:g}-{dtype}"
                seconds = finetune(run_dir, model, lr, dtype, args.steps, eval_every)
                results[(lr, dtype)] = summarise(run_dir)
                r = results[(lr, dtype)]
                print(
                    f"lr {lr:g} {dtype}: first {r['first']:.4f} final {r['final']:.4f} "
                    f"evals {r['evals']} ({seconds:.0f}s)",
                    flush=True,
                )
    text = report(results, before, args.steps, args.pretrain_steps)
    out = args.out or REPO / "bench" / "results" / f"bf16-states-quality-{time.strftime('%Y%m%d-%H%M')}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
