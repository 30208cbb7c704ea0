"""The step loop: step, log, evaluate, checkpoint, stop. Nothing else happens here.

One loop for every engine (runtime/engines/engine.py) and every objective (runtime/loss/): the
engine runs one optimizer step and reports its loss; the loop agrees with the other ranks on that
loss and on the stop and checkpoint flags in one collective, meters, logs (with the objective's own
metrics, averaged over ranks on logged steps only), evaluates and saves on schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from llm_train.data.model_inputs import SpanTally
from llm_train.observability.console import bench_line, eval_line, progress_line
from llm_train.observability.metrics import StepMeter
from llm_train.observability.profiling import NullProfiler, StepProfiler
from llm_train.observability.tracking import Trackers
from llm_train.runtime.base.collectives import WORLD
from llm_train.runtime.benchmark import PeriodicBench
from llm_train.runtime.checkpointing.control import RunControl
from llm_train.runtime.engines.engine import Batch, Engine, NonFiniteLoss


@dataclass(frozen=True)
class LoopConfig:
    max_steps: int
    log_every: int
    eval_every: int  # 0 = only at the end
    start_step: int = 0


@dataclass
class LoopResult:
    last_step: int
    preempted: bool
    metrics: dict[str, float] = field(default_factory=dict)


def train_loop(
    engine: Engine,
    batches: Iterator[Batch],
    eval_set: list[Batch],
    cfg: LoopConfig,
    tracker: Trackers,
    control: RunControl,
    save: Callable[[int], None],
    say: Callable[[str], None],
    meter: StepMeter,
    profiler: StepProfiler | NullProfiler | None = None,
    bench: PeriodicBench | None = None,
) -> LoopResult:
    profiler = profiler or NullProfiler()
    batches = SpanTally(batches)  # the documents' lengths in the batches trained on: MFU's attention span
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    for step in range(cfg.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        logged = step % cfg.log_every == 0 or step in (cfg.start_step + 1, cfg.max_steps)
        try:
            result = engine.train_step(batches, measure_grad_norm=logged)  # only measured when logged
        except NonFiniteLoss as exc:
            raise NonFiniteLoss(f"step {step}: {exc}") from None
        mean_loss, flags = WORLD.mean_and_any(result.loss, control.local_flags())
        loss_value = float(result.loss) if result.loss_is_global else mean_loss
        if not math.isfinite(loss_value):  # on_nonfinite=stop: exit before anything is saved
            raise NonFiniteLoss(
                f"non-finite loss at step {step}; resume from the last checkpoint with a lower optim.lr, "
                "or set checkpoint.on_nonfinite=skip to drop such micro-batches"
            )
        meter.record(time.perf_counter() - t0, *batches.take())
        profiler.step()

        if logged:
            grad_norm = result.grad_norm if result.grad_norm is not None else engine.grad_norm()
            metrics = {
                "loss": loss_value,
                **WORLD.means(result.metrics),  # e.g. DPO's reward accuracy and margin
                "lr": engine.ds.get_lr()[0],
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                **meter.flush(),  # throughput, MFU, memory
                "skipped_microbatches": engine.skipped_microbatches,
                "overflow_skipped_steps": int(getattr(engine.ds, "skipped_steps", 0)),
            }
            tracker.log(metrics, step)
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - cfg.start_step) * (cfg.max_steps - step)
            say(progress_line(step, cfg.max_steps, metrics, eta))

        if eval_set and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps):
            evaluated = engine.evaluate(eval_set)
            tracker.log(evaluated, step)
            say(eval_line(step, evaluated))
            metrics["eval_loss"] = evaluated["eval_loss"]

        if bench is not None and bench.due(step, cfg.max_steps):  # recipe eval.tasks, through lm-eval
            measured = bench.run(step)
            tracker.log(measured, step)
            say(bench_line(step, measured))

        save_now, stop_now = control.decide(step, flags)
        if save_now and step < cfg.max_steps:  # the final checkpoint is the caller's
            save(step)
        if stop_now and step < cfg.max_steps:
            return LoopResult(step, True, metrics)
    return LoopResult(cfg.max_steps, False, metrics)
