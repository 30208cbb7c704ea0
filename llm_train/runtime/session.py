"""One training run inside one worker process, the same for every engine.

    settle the run (data) -> world -> resume point -> model + engine -> loop -> checkpoint / export -> verify

The order matters and is commented where it does: data comes first (with optim.epochs the
number of steps, which the DeepSpeed config's schedule needs, is only known from the data),
the world is checked before anything is written, and the DeepSpeed config is final before
the model exists (ZeRO-3 partitions weights as they are created). The run arrives resolved
(train.py); what only the worker learns changes it by value (`Resolved.refine`, in `settle_run`),
never by resolving it again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config.layout import workers_for
from llm_train.config.objectives import objective_spec
from llm_train.config.resolution import Resolved, steps_for_epochs
from llm_train.data import (
    Batches,
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
from llm_train.observability.console import startup_summary
from llm_train.observability.library_logs import quiet
from llm_train.observability.metrics import StartupClock, StepMeter
from llm_train.observability.profiling import flops_profiler_config, make_profiler
from llm_train.observability.tracking import Trackers, open_trackers
from llm_train.planning.search.guards import RunEstimate
from llm_train.runtime.base import collectives, compat, launch_env
from llm_train.runtime.benchmark import PeriodicBench, recipe_options
from llm_train.runtime.benchmark import unavailable as benchmark_unavailable
from llm_train.runtime.checkpointing.control import RunControl
from llm_train.runtime.checkpointing.logit_reference import read_reference
from llm_train.runtime.checkpointing.resume import Resume, TrainerState
from llm_train.runtime.checkpointing.run_state import Saver
from llm_train.runtime.engines.engine import Engine, process_group_timeout, to_device
from llm_train.runtime.export.load import sample_text
from llm_train.runtime.export.verify import verify_export, write_check
from llm_train.runtime.loop import LoopConfig, LoopResult, train_loop
from llm_train.runtime.model.lora import is_adapter_export, verify_adapter_export
from llm_train.runtime.model.model import load_tokenizer
from llm_train.runtime.model.processor_files import copy_processor_files, model_processor_sources
from llm_train.runtime.rl.grpo import Rollouts
from llm_train.runtime.rl.wiring import grpo_prompts, grpo_rollouts
from llm_train.runtime.rundir import check_output_dir, create_run_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.prepare import PackedSplit

Say = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    """What the command line adds to a resolved run (library code never sees argparse)."""

    resume: str | None = None
    overwrite: bool = False
    verbose: bool = False
    profile: str | None = None
    flops_profiler: bool = False
    peak_tflops: float | None = None
    estimate: RunEstimate | None = None
    """The planner's estimate this process made before start (train.py): the start-up summary reads it."""


@dataclass(frozen=True)
class RunData:
    """This data-parallel rank's data, and the number of steps it makes."""

    tokenizer: PreTrainedTokenizerBase
    stream: Batches
    eval_blocks: PackedSplit | None
    max_steps: int


@dataclass(frozen=True)
class Worker:
    """What every step of this worker's run reads: the settled run, the options, this rank."""

    run: Resolved
    options: RunOptions
    rank: int
    say: Say
    clock: StartupClock  # the start-up split -> startup.json at the first step
    started: float  # time.perf_counter() at the start of run_training

    @property
    def dp_rank(self) -> int:
        return self.run.layout.dp_rank(self.rank)  # ranks of one TP group / one pipeline share one


def run_training(run: Resolved, options: RunOptions, resume: Resume, say: Say) -> int:
    """Train `run` in this worker; `resume`: planned before start and `run` refined by it (train.py; a fresh
    start without --resume). Checkpointing is two calls here, `resume.open` and `resume.restore`, and the
    `Saver` the loop saves through."""
    prepare_process(run, options, say)
    started, rank, out = time.perf_counter(), int(os.environ["RANK"]), run.recipe.output_dir
    clock = StartupClock.start(out)
    if not options.resume:
        check_output_dir(out, options.overwrite)  # every rank checks before rank 0 creates anything
    run, data = settle_run(run, options, run.layout.dp_rank(rank), say)
    clock.mark("data")
    w = Worker(run, options, rank, say, clock, started)
    engine = start_world(w)
    check_same_data(data.stream, collectives.WORLD)
    resume.open(run, data.stream, say)
    meter = build_engine(w, engine, data)
    state = resume.restore(engine.ds, data.stream)
    tracker = open_trackers(
        run.recipe.tracking, out, tracker_config(run), rank == 0, state.tracker_run_id, state.step
    )
    cadence = run.recipe.checkpoint
    control = RunControl(cadence.every_steps, cadence.every_minutes, grace_s=cadence.grace_s)
    control.install_signal_handlers()
    save = Saver(run, rank, engine, data.stream, data.tokenizer, tracker, control, say)
    result = train(w, engine, data, state, tracker, control, save, meter)
    if result.preempted:  # the loop saved after the agreed stop step: exit resumable, no export
        tracker.close()
        say(
            f"stopped by signal {control.stop_signal} after step {result.last_step}; resume with --resume auto"
        )
        engine.finish()
        return EXIT_PREEMPTED
    finish(w, engine, data, tracker, save, result)
    return 0


def prepare_process(run: Resolved, options: RunOptions, say: Say) -> None:
    """The environment DeepSpeed and Accelerate read, before either is imported or logs anything."""
    launch_env.set_single_process_env()
    launch_env.use_deepspeed_in_accelerate()
    launch_env.use_pin_memory_backend(run.recipe.deepspeed.pinning)
    prepare_libraries(options.verbose)
    for warning in compat.version_warnings():  # one line per library outside its tested window
        say(warning)


def prepare_libraries(verbose: bool) -> None:
    """Library logs quieted, DeepSpeed's op loads and kernels set up: before any of it imports or logs.

    Also tests/workers.py's first step, before the imports its forked workers share.
    """
    quiet(verbose)  # before DeepSpeed is imported (defer_muon_compile imports it) or logs anything
    compat.hub_kernels_off()  # before any model loads (the launcher's workers inherit it)
    compat.prepare_op_loads()
    compat.defer_muon_compile()
    compat.skip_unused_shm_op()


def settle_run(run: Resolved, options: RunOptions, dp_rank: int, say: Say) -> tuple[Resolved, RunData]:
    """The run as this worker trains it, and its data: the values known only now, given by value.

    `run` arrives refined by the resume (train.py: the kept global batch's accumulation, which the step
    count from optim.epochs depends on); the steps and the flops profiler then change the DeepSpeed
    config, which must be final before the engine exists.
    """
    data = build_data(run, dp_rank, say)
    steps_counted = run.recipe.optim.max_steps is None
    profiler = (
        flops_profiler_config(options.profile, run.recipe.output_dir) if options.flops_profiler else None
    )
    if steps_counted or profiler is not None:
        run = run.refine(max_steps=data.max_steps if steps_counted else None, flops_profiler=profiler)
    return run, data


def build_data(run: Resolved, dp_rank: int, say: Say) -> RunData:
    """The tokenizer, this data-parallel rank's train stream, the eval blocks, and the number of steps.

    With optim.epochs the number of steps is only known here (the caller refines the run with it).
    """
    recipe, layout = run.recipe, run.layout
    tokenizer = load_tokenizer(recipe.model)
    if objective_spec(recipe.objective).generates:
        prompts, max_steps = grpo_prompts(run, tokenizer, say)
        return RunData(tokenizer, prompts, None, max_steps)
    workers = workers_for(recipe.data.loader_workers, layout.offload_optimizer != "none")
    if is_streaming(recipe.data):
        # Tokenised and packed on the fly (data/stream_windows.py). A stream has no length: recipe.py demands
        # optim.max_steps, and the data-volume guard has no epochs to count.
        spec = StreamSpec.build(recipe.data, tokenizer, recipe.optim.seed)
        stream = StreamingBatches(spec, layout.micro_batch_size, dp_rank, layout.dp, workers=workers)
        say(f"data: data.train is streamed ({stream.workers} loader workers per rank); epochs not counted")
        eval_blocks = eval_split(recipe.data, tokenizer, recipe.optim.seed, say)
        assert recipe.optim.max_steps is not None  # recipe.py: a streamed run sets optim.max_steps
        return RunData(tokenizer, stream, eval_blocks, recipe.optim.max_steps)
    train_blocks, eval_blocks = load_blocks(recipe.data, tokenizer, recipe.optim.seed, say)
    batches = BatchStream(
        train_blocks, layout.micro_batch_size, dp_rank, layout.dp, recipe.optim.seed, workers=workers
    )
    max_steps = recipe.optim.max_steps or steps_for_epochs(
        recipe.optim.epochs or 1.0, batches.per_epoch, layout.grad_accum
    )
    # Before any model is loaded: a run that would loop over a small corpus thousands of times stops here.
    volume = DataVolume.of(layout, batches.epoch_len, max_steps, recipe.data.seq_len, train_blocks.pairs)
    requested = recipe.optim.epochs if recipe.optim.max_steps is None else None
    say(check_volume(volume, recipe.data.max_epochs, requested))
    return RunData(tokenizer, batches, eval_blocks, max_steps)


def make_engine(run: Resolved, say: Say) -> Engine:
    # Accelerate cannot drive DeepSpeed's pipeline engine: pipelines get their own.
    if run.layout.pp > 1:
        from llm_train.runtime.engines.pipeline_engine import PipelineEngine

        return PipelineEngine(run, say)
    from llm_train.runtime.engines.zero_engine import ZeroEngine

    return ZeroEngine(run, say)


def start_world(w: Worker) -> Engine:
    """The engine, the process group, the run directory and world.json (rank 0), the start-up summary."""
    run = w.run
    engine = make_engine(run, w.say)
    # A no-op unless torchrun restarted this worker.
    collectives.join_restarted_world(process_group_timeout(run.recipe.deepspeed.timeout_minutes))
    engine.start()
    w.clock.mark("distributed init")
    me = {
        "rank": w.rank,
        "dp_rank": w.dp_rank,
        "world_size": collectives.world_size(),
        "pg_timeout_s": collectives.timeout_s(),  # what the process group got (deepspeed.timeout_minutes)
        **engine.world_info(),
    }
    ranks = collectives.WORLD.gather_objects(me)
    out = run.recipe.output_dir
    if w.rank == 0:
        create_run_dir(out, run, w.options.overwrite and not w.options.resume)
        (out / "world.json").write_text(
            json.dumps({"world_size": run.layout.world_size, "ranks": ranks}, indent=2)
        )
    startup_summary(run, w.say, extra=engine.summary_rows(ranks), estimated=w.options.estimate)
    return engine


def check_same_data(batches: Batches, comm: collectives.Collectives) -> None:
    """Every rank resolved its hub sources to the same commits (a stream asks the hub itself, at start-up)."""
    if not batches.revisions:
        return  # tokenised ahead: the data's fingerprint follows its content
    seen = comm.gather_objects(batches.revisions)
    if any(r != seen[0] for r in seen):
        raise UserError(
            f"the ranks read different revisions of the streamed hub data ({seen[0]} vs "
            f"{next(r for r in seen if r != seen[0])}): it changed on the hub while the run started; pin "
            "data.train[i].revision to one commit and relaunch"
        )


def build_engine(w: Worker, engine: Engine, data: RunData) -> StepMeter:
    """The model and the DeepSpeed engine, the objective prepared, the step meter."""
    engine.build(data.max_steps, w.clock.mark)  # marks "model build" and "deepspeed init"
    # DPO with a cached reference scores every pair now, while the engine still holds the initial
    # model: before a checkpoint's weights are loaded into it (runtime/engines/reference.py).
    engine.objective.prepare([data.stream.split, data.eval_blocks], w.dp_rank, w.run.layout.dp, w.say)
    return StepMeter.for_run(w.run, engine.token_flops(), w.options.peak_tflops, w.clock)


def tracker_config(run: Resolved) -> dict[str, Any]:
    """What the trackers record as the run's configuration."""
    return {
        "recipe": run.recipe.model_dump(mode="json"),
        "ds_config": run.ds_config,
        "plan": run.layout.as_dict(),
    }


def train(
    w: Worker,
    engine: Engine,
    data: RunData,
    state: TrainerState,
    tracker: Trackers,
    control: RunControl,
    save: Callable[[int], None],
    meter: StepMeter,
) -> LoopResult:
    """The step loop from the start step to max_steps, under the profiler --profile asks for."""
    recipe, layout = w.run.recipe, w.run.layout
    evals = eval_batches(data.eval_blocks, layout.micro_batch_size, w.dp_rank, layout.dp, recipe.eval.batches)
    cfg = LoopConfig(
        max_steps=data.max_steps,
        log_every=recipe.output.log_every,
        eval_every=recipe.eval.every,
        start_step=state.step,
    )
    tokens_per_step = layout.global_batch_size * recipe.sequences_per_sample * recipe.data.seq_len
    w.say(
        f"training {data.max_steps} steps, {tokens_per_step:,} tokens per step; "
        f"setup took {time.perf_counter() - w.started:.1f}s"
    )
    w.clock.mark("resume, trackers")
    options = w.options
    profiler = make_profiler(
        options.profile, options.flops_profiler, recipe.output_dir, w.rank, state.step, data.max_steps, w.say
    )
    bench = periodic_bench(w, engine, data)
    # GRPO's micro-batches are generated from the prompts the stream deals (runtime/rl/grpo.py).
    batches = (
        rollouts(w, engine, data, tracker, cfg) if objective_spec(recipe.objective).generates else data.stream
    )
    with profiler:
        return train_loop(engine, batches, evals, cfg, tracker, control, save, w.say, meter, profiler, bench)


def rollouts(w: Worker, engine: Engine, data: RunData, tracker: Trackers, cfg: LoopConfig) -> Rollouts:
    """The engine's micro-batches under an objective that generates (runtime/rl/wiring.py assembles them)."""
    ds = engine.ds
    place = partial(to_device, device=ds.device)
    return grpo_rollouts(
        w.run, ds, engine.objective, data.stream, data.tokenizer, w.rank, place, tracker, cfg, w.say
    )


def periodic_bench(w: Worker, engine: Engine, data: RunData) -> PeriodicBench | None:
    """eval.tasks during training, on the schedule its steps give (a resumed run keeps it); None without."""
    section, run = w.run.recipe.eval, w.run
    if not section.tasks:
        return None
    if why := benchmark_unavailable(run):
        w.say(
            f"notice: eval.tasks skipped: {why}; evaluate the export afterwards with "
            f"`llm-train eval {run.recipe.output_dir} --tasks {','.join(section.tasks)}`"
        )
        return None
    patience = process_group_timeout(run.recipe.deepspeed.timeout_minutes).total_seconds()
    return PeriodicBench(
        recipe_options(section),
        section.tasks_every or section.every,
        data.tokenizer,
        engine.benchmark_model,
        run.recipe.output_dir / "checkpoints",  # beside the checkpoints' own exchanges (file_sync.py)
        collectives.WORLD,
        w.rank,
        patience,
    )


def finish(
    w: Worker,
    engine: Engine,
    data: RunData,
    tracker: Trackers,
    save: Callable[[int], None],
    result: LoopResult,
) -> None:
    """The last checkpoint, final/ (every rank), then its check the way a user loads it (rank 0)."""
    recipe = w.run.recipe
    if recipe.checkpoint.at_end:
        save(result.last_step)
    final = recipe.output_dir / "final"
    engine.export(final, data.tokenizer)
    if w.rank == 0 and final.is_dir():
        # The input's processor files (an image-text model's image processor, chat template), as it had them.
        copy_processor_files(
            model_processor_sources(recipe.model.name_or_path, recipe.model.revision, recipe.model.tokenizer),
            final,
        )
    tracker.close()
    w.say(
        f"trained in {time.perf_counter() - w.started:.0f}s: final loss "
        f"{result.metrics.get('loss', float('nan')):.4f}; run directory {recipe.output_dir} "
        "(config/, metrics.jsonl, final/)"
    )
    engine.finish()
    if w.rank == 0:
        # A reward model scores text and generates none: no sample.
        verify_final(
            final,
            recipe.output.sample_prompt if objective_spec(recipe.objective).head == "lm" else None,
            w.say,
        )


def verify_final(final: Path, sample_prompt: str | None, say: Say) -> None:
    """Check final/ the way a user loads it, after the world is gone; print a sample."""
    if is_adapter_export(final):  # lora.export=adapter: PEFT files, no full model to load or sample
        count, dtype = verify_adapter_export(final)
        say(f"exported a LoRA adapter ({count} tensors, {dtype}) to {final}")
        return
    # The engine recorded the trained model's logits on a fixed batch next to final/ (engine.export).
    report = verify_export(final, read_reference(final))
    write_check(final, report)
    say(f"exported {report.tensors} tensors to {final} (verified: {report.describe()})")
    if sample_prompt:
        say(f"sample: {sample_text(final, sample_prompt)!r}")
