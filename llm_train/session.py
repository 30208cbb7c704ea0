"""One training run inside one worker process: world, data, model, engine, loop, export.

The order matters and is commented where it does: the DeepSpeed config is final before
the model exists (ZeRO-3 partitions weights as they are created), and the world is
checked before any data is dealt out by rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from llm_train import launcher
from llm_train.resolve import Resolved, resolve_run, steps_for_epochs

_MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def _accelerator(run: Resolved) -> Any:
    import torch
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    # Multi-node launcher fields say *where* (launch/ uses them); any other DeepSpeed field says *what*.
    where = {
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_inclusion_filter",
        "deepspeed_exclusion_filter",
    }
    what = [f for f in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f and f not in where]
    if what:
        from llm_train.errors import UserError

        raise UserError(
            "your accelerate config sets DeepSpeed fields "
            f"({','.join(what)}); with llm_train the recipe and its DeepSpeed JSON "
            "own them: keep only machines/processes/rendezvous in the accelerate config (see launch/)"
        )
    # Without a GPU, Accelerate must be told the backend or every rank believes it is rank 0
    # of a world of 1 while DeepSpeed runs a world of N (DESIGN.md fact 2).
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    plugin = DeepSpeedPlugin(hf_ds_config=run.ds_config)
    return Accelerator(
        deepspeed_plugin=plugin,
        mixed_precision=_MIXED_PRECISION[run.plan.precision],
        kwargs_handlers=handlers,
    )


def _prepare_engine(run: Resolved, accelerator: Any, model: Any, max_steps: int) -> Any:
    """The DeepSpeed engine, with the optimizer and LR schedule it steps at each accumulation boundary."""
    from functools import partial

    from accelerate.utils import DummyOptim, DummyScheduler

    from llm_train.optim import build_optimizer, build_scheduler

    optim = run.recipe.optim
    schedule = partial(build_scheduler, optim=optim, max_steps=max_steps)
    if "optimizer" in run.ds_config:
        # A DS JSON with its own optimizer (common in configs written for other tools): DeepSpeed
        # builds it from the resolved values, and our schedule unless the JSON has one too.
        optimizer = DummyOptim(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        callable_ = None if "scheduler" in run.ds_config else schedule
        scheduler = DummyScheduler(optimizer, max_steps, optim.warmup_steps, lr_scheduler_callable=callable_)
        engine, _, _ = accelerator.prepare(model, optimizer, scheduler)
        return engine
    optimizer = build_optimizer(model, optim, run.plan.offload_optimizer)
    engine, _ = accelerator.prepare(model, optimizer)
    if "scheduler" not in run.ds_config:
        # Accelerate hands DeepSpeed only its own scheduler types; giving the engine ours means it
        # steps the LR exactly at accumulation boundaries, skips it on fp16 overflow, and saves it
        # in its checkpoints. The ZeRO wrappers update the client optimizer's param_groups.
        engine.lr_scheduler = schedule(optimizer)
    return engine


def build_data(run: Resolved, args: argparse.Namespace, dp_rank: int, say: Callable[[str], None]) -> tuple:
    """(run, tokenizer, train stream for this data-parallel rank, eval blocks, max_steps).

    Data comes before the engine: with optim.epochs the number of steps is only known here,
    and it feeds the DeepSpeed scheduler's "auto" values, so the run is resolved again.
    """
    from llm_train.data import BatchStream, load_blocks
    from llm_train.model import load_tokenizer
    from llm_train.plan import Device

    recipe, plan = run.recipe, run.plan
    tokenizer = load_tokenizer(recipe.model)
    train_blocks, eval_blocks = load_blocks(recipe.data, tokenizer, recipe.optim.seed, say)
    stream = BatchStream(train_blocks, plan.micro_batch_size, dp_rank, plan.dp, recipe.optim.seed)
    max_steps = recipe.optim.max_steps or steps_for_epochs(
        recipe.optim.epochs or 1.0, stream.per_epoch, plan.grad_accum
    )
    if recipe.optim.max_steps is None:
        run = resolve_run(
            args.recipe,
            args.overrides,
            plan.world_size,
            Device.detect(),
            args.ds_config,
            max_steps,
            args.output_dir,
        )
    return run, tokenizer, stream, eval_blocks, max_steps


def run_training(run: Resolved, args: argparse.Namespace, say: Callable[[str], None]) -> int:
    if run.plan.pp > 1:  # Accelerate cannot drive DeepSpeed's pipeline engine: llm_train/pipeline.py does
        from llm_train.pipeline import run_pipeline

        return run_pipeline(run, args, say)
    launcher.set_single_process_env()
    launcher.use_deepspeed_in_accelerate()
    from llm_train.console import quiet, startup_summary

    quiet(args.verbose)
    started = time.perf_counter()

    import torch

    from llm_train import collectives
    from llm_train.data import eval_batches
    from llm_train.export import sample_text, save_hf_model, verify_export
    from llm_train.fast import apply_liger, compile_engine
    from llm_train.loop import LoopConfig, train_loop
    from llm_train.metrics import StartupClock, StepMeter, model_flops_per_token
    from llm_train.model import build_model
    from llm_train.profiling import enable_flops_profiler, make_profiler
    from llm_train.rundir import check_output_dir, create_run_dir
    from llm_train.tracking import open_trackers

    recipe, plan = run.recipe, run.plan
    out = recipe.output_dir
    clock = StartupClock.start(out)  # start-up split -> startup.json at the first step
    if not args.resume:
        check_output_dir(out, args.overwrite)  # every rank checks before rank 0 creates anything

    # Data first: the number of steps (for epochs) feeds the DeepSpeed scheduler's "auto" values.
    rank = int(os.environ["RANK"])
    dp_rank = rank // (plan.tp * plan.pp)  # ranks of one TP/PP group share a data-parallel rank
    run, tokenizer, stream, eval_blocks, max_steps = build_data(run, args, dp_rank, say)

    clock.mark("data")
    enable_flops_profiler(run.ds_config, args, out)  # --flops-profiler: DeepSpeed reads it from the DS config
    hf_ds_config = None
    if plan.zero_stage == 3:
        # Registered before the model exists, so transformers builds it inside zero.Init and no
        # rank materialises the full model. The reference must stay alive while the model is built.
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(run.ds_config)
    accelerator = _accelerator(run)
    if accelerator.num_processes != plan.world_size or accelerator.process_index != rank:
        raise RuntimeError(
            f"Accelerate sees rank {accelerator.process_index} of {accelerator.num_processes}, "
            f"the launcher said rank {rank} of {plan.world_size}"
        )
    clock.mark("distributed init")
    ranks = collectives.WORLD.gather_objects(
        {"rank": rank, "dp_rank": dp_rank, "world_size": accelerator.num_processes}
    )
    if accelerator.is_main_process:
        create_run_dir(out, run, args.overwrite)
        (out / "world.json").write_text(json.dumps({"world_size": plan.world_size, "ranks": ranks}, indent=2))
    startup_summary(run, say)

    from llm_train.checkpoint import Checkpointer
    from llm_train.control import EXIT_PREEMPTED, RunControl
    from llm_train.run_state import (
        check_compatible,
        choose_checkpoint,
        make_saver,
        restore_run_state,
        truncate_metrics,
    )

    comm = collectives.WORLD
    resume_from = (
        choose_checkpoint(args.resume, out / "checkpoints", rank, comm, say) if args.resume else None
    )
    if resume_from is not None:
        check_compatible(resume_from, plan.world_size, recipe, say)

    if notice := apply_liger(recipe.memory, run.model_fields.get("model_type"), plan.zero_stage):
        say(notice)
    model = build_model(recipe.model, recipe.memory, plan.precision, recipe.optim.seed, recipe.lora)
    clock.mark("model build")
    engine = _prepare_engine(run, accelerator, model, max_steps)
    if notice := compile_engine(engine, recipe.memory):
        say(notice)
    clock.mark("deepspeed init")
    meter = StepMeter.for_run(run, model_flops_per_token(model, recipe.data.seq_len), args, clock)
    del hf_ds_config

    config_for_tracker = {
        "recipe": recipe.model_dump(mode="json"),
        "ds_config": run.ds_config,
        "plan": plan.as_dict(),
    }
    torch.manual_seed(recipe.optim.seed + rank)  # dropout differs per rank, reproducibly
    start_step, tracker_run_id = 0, None
    if resume_from is not None:
        restored = restore_run_state(engine, resume_from, stream, rank)
        start_step, tracker_run_id = restored["step"], restored.get("tracker_run_id")
        say(f"resumed from {resume_from} at step {start_step}")
    elif args.resume:
        say("no complete checkpoint to resume from; starting at step 0")
    if accelerator.is_main_process:
        truncate_metrics(out / "metrics.jsonl", start_step)
    accelerator.wait_for_everyone()
    cfg = LoopConfig(
        max_steps=max_steps,
        grad_accum=plan.grad_accum,
        tokens_per_step=plan.global_batch_size * recipe.data.seq_len,
        log_every=recipe.output.log_every,
        eval_every=recipe.eval.every,
        on_nonfinite=recipe.checkpoint.on_nonfinite,
        start_step=start_step,
    )
    tracker = open_trackers(
        recipe.tracking, out, config_for_tracker, accelerator.is_main_process, tracker_run_id, start_step
    )
    checkpointer = Checkpointer(out / "checkpoints", rank, recipe.checkpoint.keep_last_n, comm)
    control = RunControl(
        recipe.checkpoint.every_steps, recipe.checkpoint.every_minutes, grace_s=recipe.checkpoint.grace_s
    )
    control.install_signal_handlers()

    save = make_saver(
        checkpointer, control, engine, stream, tokenizer, rank, plan.world_size, recipe, tracker, say
    )

    evals = eval_batches(eval_blocks, plan.micro_batch_size, dp_rank, plan.dp, recipe.eval.batches)
    say(
        f"training {max_steps} steps, {cfg.tokens_per_step:,} tokens per step; setup took {time.perf_counter() - started:.1f}s"
    )
    clock.mark("resume, trackers")
    with make_profiler(args, out, rank, start_step, max_steps, say) as profiler:
        result = train_loop(engine, stream, evals, cfg, tracker, control, save, say, meter, profiler)
    metrics = result.metrics
    if result.preempted:
        # The loop saved after the agreed stop step; exit resumable, without exporting.
        tracker.close()
        say(
            f"stopped by signal {control.stop_signal} after step {result.last_step}; resume with --resume auto"
        )
        accelerator.end_training()
        collectives.destroy()
        return EXIT_PREEMPTED
    if recipe.checkpoint.at_end:
        save(result.last_step)

    # Export: every rank takes part in gathering ZeRO-3 shards; rank 0 writes and verifies.
    state_dict = accelerator.get_state_dict(engine)
    final = out / "final"
    if accelerator.is_main_process:
        from llm_train.lora import export_view  # LoRA: merged weights or the adapter; else unchanged

        save_hf_model(
            *export_view(accelerator.unwrap_model(engine), state_dict, recipe.lora), tokenizer, final
        )
    accelerator.wait_for_everyone()
    tracker.close()
    say(
        f"trained in {time.perf_counter() - started:.0f}s: final loss {metrics.get('loss', float('nan')):.4f}; "
        f"run directory {out} (config/, metrics.jsonl, final/)"
    )
    accelerator.end_training()
    collectives.destroy()

    # Checked the way a user loads it: plain transformers, no ZeRO-3 context (which would try to
    # partition the skeleton across a world that has just been torn down).
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if rank == 0:
        from llm_train.lora import is_adapter_export, verify_adapter_export

        if is_adapter_export(final):  # lora.export=adapter: PEFT files, no full model to load or sample
            say(f"exported a LoRA adapter ({verify_adapter_export(final)} tensors) to {final}")
            return 0
        tensors = verify_export(final)
        say(f"exported {tensors} tensors to {final} (verified against the config's shapes)")
        if recipe.output.sample_prompt:
            say(f"sample: {sample_text(final, recipe.output.sample_prompt)!r}")
    return 0
