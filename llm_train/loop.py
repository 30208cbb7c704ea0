"""The step loop: forward, backward, step, log, evaluate, checkpoint. Nothing else happens here.

The DeepSpeed engine owns gradient accumulation: `engine.backward` scales each
micro-batch loss by 1/accumulation and reduces gradients at the boundary, and
`engine.step` only updates the weights (and steps the LR schedule) at the boundary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_train.collectives import WORLD, Collectives
from llm_train.console import progress_line
from llm_train.control import RunControl
from llm_train.errors import UserError
from llm_train.metrics import StepMeter
from llm_train.profiling import NullProfiler, StepProfiler
from llm_train.tracking import Trackers

EXIT_NONFINITE = 3
MAX_SKIPS_IN_A_ROW = 8  # with on_nonfinite=skip: more than this means the run itself is broken


class NonFiniteLoss(UserError):
    exit_code = EXIT_NONFINITE


@dataclass
class LoopConfig:
    max_steps: int
    grad_accum: int
    tokens_per_step: int  # global: micro x accum x dp x seq_len
    log_every: int
    eval_every: int  # 0 = only at the end
    on_nonfinite: str = "stop"
    start_step: int = 0


@dataclass
class LoopResult:
    last_step: int
    preempted: bool
    metrics: dict[str, float] = field(default_factory=dict)


def _grad_norm_if_untracked(engine: Any) -> float | None:
    """ZeRO-0 in fp32 clips without keeping the norm: measure it at the boundary, before the step.

    Under AutoTP a rank holds a slice of each replaced weight (DeepSpeed marks those
    `tensor_model_parallel`) and a whole copy of the rest: the slices' squares are summed over
    the tensor-parallel group, the copies counted once.
    """
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    sliced, whole = torch.zeros((), device=engine.device), torch.zeros((), device=engine.device)
    tp = False
    for param in engine.module.parameters():
        if param.grad is None:
            continue
        square = param.grad.detach().float().pow(2).sum()
        if getattr(param, "tensor_model_parallel", False):
            sliced += square
            tp = True
        else:
            whole += square
    if tp:
        from deepspeed.utils import groups

        sliced = Collectives(groups.get_tensor_model_parallel_group()).sum(sliced)
    return float((sliced + whole).sqrt())


@torch.no_grad()
def evaluate(engine: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    engine.eval()
    losses = [engine(**_to(b, engine.device)).loss for b in batches]
    engine.train()
    return WORLD.mean(torch.stack(losses).mean()) if losses else float("nan")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # Non-tensor entries are forward flags (packed batches carry use_cache=False).
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def train_loop(
    engine: Any,
    batches: Iterator[dict[str, torch.Tensor]],
    eval_set: list[dict[str, torch.Tensor]],
    cfg: LoopConfig,
    tracker: Trackers,
    control: RunControl,
    save: Callable[[int], None],
    say: Callable[[str], None],
    meter: StepMeter | None = None,
    profiler: StepProfiler | NullProfiler | None = None,
) -> LoopResult:
    engine.train()
    meter = meter or StepMeter(cfg.tokens_per_step)  # throughput, MFU, memory for each logged row
    profiler = profiler or NullProfiler()
    metrics: dict[str, float] = {}
    skipped = 0
    started = time.perf_counter()
    for step in range(cfg.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        micro_losses = []
        grad_norm = None
        logged = step % cfg.log_every == 0 or step in (cfg.start_step + 1, cfg.max_steps)
        for _ in range(cfg.grad_accum):
            loss = engine(**_to(next(batches), engine.device)).loss
            # Skipping must be decided before backward, by all ranks together (one collective per
            # micro-batch), so it is only paid for when asked for.
            while cfg.on_nonfinite == "skip" and not WORLD.all_finite(loss):
                if skipped >= MAX_SKIPS_IN_A_ROW:
                    raise NonFiniteLoss(
                        f"non-finite loss at step {step}: {skipped} micro-batches skipped in a row"
                    )
                skipped += 1  # drop this micro-batch before backward: the weights never see it
                loss = engine(**_to(next(batches), engine.device)).loss
            engine.backward(loss)
            if logged and engine.is_gradient_accumulation_boundary():  # only measured when it is logged
                grad_norm = _grad_norm_if_untracked(engine)
            engine.step()
            micro_losses.append(loss.detach())
        loss_value, flags = WORLD.mean_and_any(torch.stack(micro_losses).mean(), control.local_flags())
        if not math.isfinite(loss_value):  # on_nonfinite=stop: exit before anything is saved
            raise NonFiniteLoss(
                f"non-finite loss at step {step}; resume from the last checkpoint with a lower optim.lr, "
                "or set checkpoint.on_nonfinite=skip to drop such micro-batches"
            )
        step_time = time.perf_counter() - t0
        meter.record(step_time)
        profiler.step()

        if logged:
            if grad_norm is None:
                tracked = engine.get_global_grad_norm()
                grad_norm = float(tracked) if tracked is not None else float("nan")
            lr = engine.get_lr()[0]
            metrics = {
                "loss": loss_value,
                "lr": lr,
                "grad_norm": grad_norm,
                **meter.flush(),
                "skipped_microbatches": skipped,
                "overflow_skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            }
            tracker.log(metrics, step)
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - cfg.start_step) * (cfg.max_steps - step)
            say(progress_line(step, cfg.max_steps, metrics, eta))

        if eval_set and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps):
            eval_loss = evaluate(engine, eval_set)
            tracker.log({"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}, step)
            say(f"step {step}: eval loss {eval_loss:.4f} (ppl {math.exp(min(eval_loss, 50.0)):.1f})")
            metrics["eval_loss"] = eval_loss

        save_now, stop_now = control.decide(step, flags)
        if save_now and step < cfg.max_steps:  # the final checkpoint is the caller's
            save(step)
        if stop_now and step < cfg.max_steps:
            return LoopResult(step, True, metrics)
    return LoopResult(cfg.max_steps, False, metrics)
