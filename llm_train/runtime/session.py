"""One training run inside one worker process, the same for every engine.

    data -> world -> resume point -> model + engine -> loop -> checkpoint / export -> verify

The order matters and is commented where it does: data comes first (with optim.epochs the
number of steps, which the DeepSpeed config's schedule needs, is only known from the data),
the world is checked before anything is written, and the DeepSpeed config is final before
the model exists (ZeRO-3 partitions weights as they are created).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm_train.config.hardware import Device
from llm_train.config.resolution import Resolved, resolve_run, steps_for_epochs
from llm_train.data import BatchStream, eval_batches, load_blocks
from llm_train.errors import EXIT_PREEMPTED
from llm_train.observability.console import quiet, startup_summary
from llm_train.observability.metrics import StartupClock, StepMeter
from llm_train.observability.profiling import enable_flops_profiler, make_profiler
from llm_train.observability.tracking import open_trackers
from llm_train.runtime import collectives, launcher
from llm_train.runtime.checkpoint import Checkpointer
from llm_train.runtime.control import RunControl
from llm_train.runtime.engine import Engine
from llm_train.runtime.export import sample_text, verify_export
from llm_train.runtime.loop import LoopConfig, train_loop
from llm_train.runtime.lora import is_adapter_export, verify_adapter_export
from llm_train.runtime.model import load_tokenizer
from llm_train.runtime.run_state import (
    check_compatible,
    choose_checkpoint,
    make_saver,
    restore_run_state,
    truncate_metrics,
)
from llm_train.runtime.rundir import check_output_dir, create_run_dir


@dataclass(frozen=True)
class RunOptions:
    """What the command line adds to a resolved run (library code never sees argparse)."""

    recipe: str
    overrides: tuple[str, ...] = ()
    ds_config: str | None = None
    output_dir: str | None = None
    resume: str | None = None
    overwrite: bool = False
    verbose: bool = False
    profile: str | None = None
    flops_profiler: bool = False
    peak_tflops: float | None = None


def make_engine(run: Resolved, say: Callable[[str], None]) -> Engine:
    # Accelerate cannot drive DeepSpeed's pipeline engine: pipelines get their own.
    if run.layout.pp > 1:
        from llm_train.runtime.pipeline_engine import PipelineEngine

        return PipelineEngine(run, say)
    from llm_train.runtime.zero_engine import ZeroEngine

    return ZeroEngine(run, say)


def build_data(run: Resolved, options: RunOptions, dp_rank: int, say: Callable[[str], None]) -> tuple:
    """(run, tokenizer, train stream for this data-parallel rank, eval blocks, max_steps).

    With optim.epochs the number of steps is only known here, and it feeds the DeepSpeed
    scheduler's "auto" values, so the run is resolved again.
    """
    recipe, layout = run.recipe, run.layout
    tokenizer = load_tokenizer(recipe.model)
    train_blocks, eval_blocks = load_blocks(recipe.data, tokenizer, recipe.optim.seed, say)
    stream = BatchStream(train_blocks, layout.micro_batch_size, dp_rank, layout.dp, recipe.optim.seed)
    max_steps = recipe.optim.max_steps or steps_for_epochs(
        recipe.optim.epochs or 1.0, stream.per_epoch, layout.grad_accum
    )
    if recipe.optim.max_steps is None:
        run = resolve_run(
            options.recipe,
            list(options.overrides),
            layout.world_size,
            Device.detect(),
            options.ds_config,
            max_steps,
            options.output_dir,
        )
    return run, tokenizer, stream, eval_blocks, max_steps


def run_training(run: Resolved, options: RunOptions, say: Callable[[str], None]) -> int:
    launcher.set_single_process_env()
    launcher.use_deepspeed_in_accelerate()
    quiet(options.verbose)  # before DeepSpeed logs anything
    started = time.perf_counter()
    recipe, layout = run.recipe, run.layout
    out = recipe.output_dir
    clock = StartupClock.start(out)  # start-up split -> startup.json at the first step
    if not options.resume:
        check_output_dir(out, options.overwrite)  # every rank checks before rank 0 creates anything

    rank = int(os.environ["RANK"])
    dp_rank = layout.dp_rank(rank)  # ranks of one TP group / one pipeline share a data-parallel rank
    run, tokenizer, stream, eval_blocks, max_steps = build_data(run, options, dp_rank, say)
    clock.mark("data")

    enable_flops_profiler(
        run.ds_config, options.profile, options.flops_profiler, out
    )  # --flops-profiler: DeepSpeed reads the DS config
    engine = make_engine(run, say)
    engine.start()
    clock.mark("distributed init")
    me = {"rank": rank, "dp_rank": dp_rank, "world_size": collectives.world_size(), **engine.world_info()}
    ranks = collectives.WORLD.gather_objects(me)
    if rank == 0:
        create_run_dir(out, run, options.overwrite and not options.resume)
        (out / "world.json").write_text(
            json.dumps({"world_size": layout.world_size, "ranks": ranks}, indent=2)
        )
    startup_summary(run, say, extra=engine.summary_rows(ranks))

    comm = collectives.WORLD
    resume_from = (
        choose_checkpoint(options.resume, out / "checkpoints", rank, comm, say) if options.resume else None
    )
    if resume_from is not None:
        check_compatible(resume_from, layout.world_size, recipe, say)

    engine.build(max_steps, clock.mark)  # marks "model build" and "deepspeed init"
    meter = StepMeter.for_run(run, engine.flops_per_token(recipe.data.seq_len), options.peak_tflops, clock)

    import torch

    torch.manual_seed(recipe.optim.seed + rank)  # dropout differs per rank, reproducibly
    start_step, tracker_run_id = 0, None
    if resume_from is not None:
        restored = restore_run_state(engine.ds, resume_from, stream, rank)
        start_step, tracker_run_id = restored["step"], restored.get("tracker_run_id")
        say(f"resumed from {resume_from} at step {start_step}")
    elif options.resume:
        say("no complete checkpoint to resume from; starting at step 0")
    if rank == 0:
        truncate_metrics(out / "metrics.jsonl", start_step)
    comm.barrier()

    config_for_tracker = {
        "recipe": recipe.model_dump(mode="json"),
        "ds_config": run.ds_config,
        "plan": layout.as_dict(),
    }
    tracker = open_trackers(recipe.tracking, out, config_for_tracker, rank == 0, tracker_run_id, start_step)
    checkpointer = Checkpointer(out / "checkpoints", rank, recipe.checkpoint.keep_last_n, comm)
    control = RunControl(
        recipe.checkpoint.every_steps, recipe.checkpoint.every_minutes, grace_s=recipe.checkpoint.grace_s
    )
    control.install_signal_handlers()
    save = make_saver(
        checkpointer, control, engine.ds, stream, tokenizer, rank, layout.world_size, recipe, tracker, say
    )
    evals = eval_batches(eval_blocks, layout.micro_batch_size, dp_rank, layout.dp, recipe.eval.batches)
    cfg = LoopConfig(
        max_steps=max_steps,
        log_every=recipe.output.log_every,
        eval_every=recipe.eval.every,
        start_step=start_step,
    )
    tokens_per_step = layout.global_batch_size * recipe.data.seq_len
    say(
        f"training {max_steps} steps, {tokens_per_step:,} tokens per step; "
        f"setup took {time.perf_counter() - started:.1f}s"
    )
    clock.mark("resume, trackers")
    with make_profiler(
        options.profile, options.flops_profiler, out, rank, start_step, max_steps, say
    ) as profiler:
        result = train_loop(engine, stream, evals, cfg, tracker, control, save, say, meter, profiler)
    metrics = result.metrics
    if result.preempted:  # the loop saved after the agreed stop step: exit resumable, no export
        tracker.close()
        say(
            f"stopped by signal {control.stop_signal} after step {result.last_step}; resume with --resume auto"
        )
        engine.finish()
        return EXIT_PREEMPTED
    if recipe.checkpoint.at_end:
        save(result.last_step)

    final = out / "final"
    engine.export(final, tokenizer)
    tracker.close()
    say(
        f"trained in {time.perf_counter() - started:.0f}s: final loss {metrics.get('loss', float('nan')):.4f}; "
        f"run directory {out} (config/, metrics.jsonl, final/)"
    )
    engine.finish()
    if rank == 0:
        verify_final(final, recipe.output.sample_prompt, say)
    return 0


def verify_final(final: Any, sample_prompt: str | None, say: Callable[[str], None]) -> None:
    """Check final/ the way a user loads it, after the world is gone; print a sample."""
    if is_adapter_export(final):  # lora.export=adapter: PEFT files, no full model to load or sample
        say(f"exported a LoRA adapter ({verify_adapter_export(final)} tensors) to {final}")
        return
    tensors = verify_export(final)
    say(f"exported {tensors} tensors to {final} (verified against the config's shapes)")
    if sample_prompt:
        say(f"sample: {sample_text(final, sample_prompt)!r}")
