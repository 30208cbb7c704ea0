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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llm_train.config.hardware import Device
from llm_train.config.layout import workers_for
from llm_train.config.resolution import Resolved, resolve_run, steps_for_epochs
from llm_train.data import (
    BatchStream,
    StreamingBatches,
    StreamSpec,
    eval_batches,
    eval_split,
    is_streaming,
    load_blocks,
)
from llm_train.data.volume import DataVolume, check_volume
from llm_train.errors import EXIT_PREEMPTED, UserError
from llm_train.observability.console import quiet, startup_summary
from llm_train.observability.metrics import StartupClock, StepMeter
from llm_train.observability.profiling import enable_flops_profiler, make_profiler
from llm_train.observability.tracking import open_trackers
from llm_train.runtime import collectives, launcher
from llm_train.runtime.checkpoint import Checkpointer, read_manifest
from llm_train.runtime.control import RunControl
from llm_train.runtime.engine import Engine, process_group_timeout
from llm_train.runtime.export import read_reference, sample_text, verify_export, write_check
from llm_train.runtime.loop import LoopConfig, train_loop
from llm_train.runtime.lora import is_adapter_export, verify_adapter_export
from llm_train.runtime.model import load_tokenizer
from llm_train.runtime.resume_layout import (
    ResumeLayout,
    check_same_plan,
    peek_manifest,
    plan_resume,
    saved_layout,
)
from llm_train.runtime.run_state import (
    check_recipe,
    choose_checkpoint,
    convert_for_resume,
    make_saver,
    read_data_state,
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
    allow_batch_change: bool = False
    allow_data_revision_change: bool = False
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
    workers = workers_for(recipe.data.loader_workers, layout.offload_optimizer != "none")
    if is_streaming(recipe.data):
        # Tokenised and packed on the fly (data/streaming.py). A stream has no length: recipe.py demands
        # optim.max_steps, and the data-volume guard has no epochs to count.
        spec = StreamSpec.build(recipe.data, tokenizer, recipe.optim.seed)
        stream = StreamingBatches(spec, layout.micro_batch_size, dp_rank, layout.dp, workers=workers)
        say(f"data: data.train is streamed ({stream.workers} loader workers per rank); epochs not counted")
        eval_blocks = eval_split(recipe.data, tokenizer, recipe.optim.seed, say)
        return run, tokenizer, stream, eval_blocks, recipe.optim.max_steps
    train_blocks, eval_blocks = load_blocks(recipe.data, tokenizer, recipe.optim.seed, say)
    stream = BatchStream(
        train_blocks, layout.micro_batch_size, dp_rank, layout.dp, recipe.optim.seed, workers=workers
    )
    max_steps = recipe.optim.max_steps or steps_for_epochs(
        recipe.optim.epochs or 1.0, stream.per_epoch, layout.grad_accum
    )
    # Before any model is loaded: a run that would loop over a small corpus thousands of times stops here.
    volume = DataVolume.of(layout, stream.order.epoch_len, max_steps, recipe.data.seq_len, train_blocks.pairs)
    requested = recipe.optim.epochs if recipe.optim.max_steps is None else None
    say(check_volume(volume, recipe.data.max_epochs, requested))
    if recipe.optim.max_steps is None:
        run = resolve_again(options, layout.world_size, max_steps)
    return run, tokenizer, stream, eval_blocks, max_steps


def resolve_again(options: RunOptions, world_size: int, max_steps: int | None = None) -> Resolved:
    return resolve_run(
        options.recipe,
        list(options.overrides),
        world_size,
        Device.detect(),
        options.ds_config,
        max_steps,
        options.output_dir,
    )


def plan_layout_change(
    run: Resolved, options: RunOptions, say: Callable[[str], None]
) -> tuple[Resolved, RunOptions, ResumeLayout]:
    """Before anything is built: how the checkpoint to resume differs from this launch's layout.

    A kept global batch changes the accumulation, which the DeepSpeed config and the step
    count depend on, so the run is resolved again with it.
    """
    manifest = peek_manifest(options.resume or "auto", run.recipe.output_dir / "checkpoints")
    if manifest is None:
        return run, options, ResumeLayout()
    plan = plan_resume(saved_layout(manifest), run.layout, options.allow_batch_change)
    for notice in plan.notices:
        say(f"notice: {notice}")
    if plan.grad_accum is not None:
        options = replace(options, overrides=(*options.overrides, f"optim.grad_accum={plan.grad_accum}"))
        run = resolve_again(options, run.layout.world_size, run.recipe.optim.max_steps)  # keeps --max-steps
    return run, options, plan


def load_universal(run: Resolved) -> Resolved:
    """The same run, with DeepSpeed told to load checkpoints in the universal format."""
    checkpoint = {**run.ds_config.get("checkpoint", {}), "load_universal": True}
    return replace(run, ds_config={**run.ds_config, "checkpoint": checkpoint})


def prepare_resume(
    options: RunOptions, root: Path, run: Resolved, plan: ResumeLayout, rank: int, say: Callable[[str], None]
) -> Path | None:
    """The verified checkpoint to resume (the same on every rank), converted when the layout changed."""
    comm = collectives.WORLD
    patience_s = run.recipe.deepspeed.timeout_minutes * 60
    chosen = choose_checkpoint(options.resume or "auto", root, rank, comm, say, patience_s)
    if chosen is None:
        return None
    manifest = read_manifest(chosen)
    check_recipe(chosen, manifest, run.recipe, say)
    verified = plan_resume(saved_layout(manifest), run.layout, options.allow_batch_change)
    check_same_plan(chosen, plan, verified)
    if plan.universal:
        convert_for_resume(chosen, root, rank, comm, patience_s, say)
    return chosen


def check_same_data(stream: Any, comm: collectives.Collectives) -> None:
    """Every rank resolved its hub sources to the same commits (each asks the hub itself, at start-up)."""
    revisions = getattr(getattr(stream, "spec", None), "revisions", None)
    if revisions is None:
        return
    seen = comm.gather_objects(revisions)
    if any(r != seen[0] for r in seen):
        raise UserError(
            f"the ranks read different revisions of the streamed hub data ({seen[0]} vs "
            f"{next(r for r in seen if r != seen[0])}): it changed on the hub while the run started; pin "
            "data.train[i].revision to one commit and relaunch"
        )


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
    plan = ResumeLayout()
    if options.resume:
        run, options, plan = plan_layout_change(run, options, say)
    run, tokenizer, stream, eval_blocks, max_steps = build_data(run, options, dp_rank, say)
    if plan.universal:
        run = load_universal(run)
    recipe, layout = run.recipe, run.layout
    clock.mark("data")

    enable_flops_profiler(
        run.ds_config, options.profile, options.flops_profiler, out
    )  # --flops-profiler: DeepSpeed reads the DS config
    engine = make_engine(run, say)
    collectives.join_restarted_world(
        process_group_timeout(recipe.deepspeed.timeout_minutes)
    )  # a no-op unless torchrun restarted it
    engine.start()
    clock.mark("distributed init")
    me = {
        "rank": rank,
        "dp_rank": dp_rank,
        "world_size": collectives.world_size(),
        "pg_timeout_s": collectives.timeout_s(),  # what the process group got (deepspeed.timeout_minutes)
        **engine.world_info(),
    }
    ranks = collectives.WORLD.gather_objects(me)
    if rank == 0:
        create_run_dir(out, run, options.overwrite and not options.resume)
        (out / "world.json").write_text(
            json.dumps({"world_size": layout.world_size, "ranks": ranks}, indent=2)
        )
    startup_summary(run, say, extra=engine.summary_rows(ranks))

    comm = collectives.WORLD
    check_same_data(stream, comm)
    resume_from = (
        prepare_resume(options, out / "checkpoints", run, plan, rank, say) if options.resume else None
    )
    if resume_from is not None:  # before the model is built: a data position that cannot continue is one line
        for notice in stream.check_state(read_data_state(resume_from), options.allow_data_revision_change):
            say(f"notice: {notice}")

    engine.build(max_steps, clock.mark)  # marks "model build" and "deepspeed init"
    # DPO with a cached reference scores every pair now, while the engine still holds the initial
    # model: before a checkpoint's weights are loaded into it (runtime/reference.py).
    engine.objective.prepare([stream.split, eval_blocks], dp_rank, layout.dp, say)
    meter = StepMeter.for_run(run, engine.token_flops(), options.peak_tflops, clock)

    import torch

    torch.manual_seed(recipe.optim.seed + rank)  # dropout differs per rank, reproducibly
    start_step, tracker_run_id = 0, None
    if resume_from is not None:
        restored = restore_run_state(
            engine.ds, resume_from, stream, rank, plan, recipe.optim.seed, options.allow_data_revision_change
        )
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
    checkpointer = Checkpointer(
        out / "checkpoints",
        rank,
        recipe.checkpoint.keep_last_n,
        comm,
        patience_s=recipe.deepspeed.timeout_minutes * 60,
    )
    control = RunControl(
        recipe.checkpoint.every_steps, recipe.checkpoint.every_minutes, grace_s=recipe.checkpoint.grace_s
    )
    control.install_signal_handlers()
    save = make_saver(
        checkpointer,
        control,
        engine.ds,
        stream,
        tokenizer,
        rank,
        layout,
        recipe,
        tracker,
        say,
        reference=lambda: engine.reference_logits(tokenizer),
    )
    evals = eval_batches(eval_blocks, layout.micro_batch_size, dp_rank, layout.dp, recipe.eval.batches)
    cfg = LoopConfig(
        max_steps=max_steps,
        log_every=recipe.output.log_every,
        eval_every=recipe.eval.every,
        start_step=start_step,
    )
    tokens_per_step = layout.global_batch_size * recipe.sequences_per_sample * recipe.data.seq_len
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
    # The engine recorded the trained model's logits on a fixed batch next to final/ (engine.export).
    report = verify_export(final, read_reference(final))
    write_check(final, report)
    say(f"exported {report.tensors} tensors to {final} (verified: {report.describe()})")
    if sample_prompt:
        say(f"sample: {sample_text(final, sample_prompt)!r}")
