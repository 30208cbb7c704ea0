"""Entry point: `accelerate launch llm_train/train.py --recipe NAME [key.sub=value ...]`.

parse -> resolve (recipe, DeepSpeed JSON, plan) -> build (world, data, model, engine)
-> train -> export -> close. Also runs as `python llm_train/train.py` (one process).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import the package, not this folder's modules as top-level names.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from llm_train.config import accelerate_launch
from llm_train.config.accelerate_launch import AccelerateLaunch
from llm_train.config.gpu_evidence import evidence_lines
from llm_train.config.hardware import Device, gpus_without_p2p
from llm_train.config.objectives import objective_spec
from llm_train.config.recipe import Recipe
from llm_train.config.resolution import Resolved, resolve_run
from llm_train.data.prompts import load_prompts
from llm_train.data.volume import hub_sources, planned_volume
from llm_train.errors import UserError
from llm_train.observability.profiling import parse_range
from llm_train.planning.search.guards import (
    RunEstimate,
    auto_pinning,
    check_host_ram,
    check_memlock,
    check_nvme_path,
    estimate_run,
    memory_rows,
)
from llm_train.planning.speed.checkpoint_cost import checkpoint_lines
from llm_train.runtime.base import launch_env
from llm_train.runtime.base.launch_env import PIN_BACKEND_ENV
from llm_train.runtime.benchmark import check_recipe_tasks
from llm_train.runtime.checkpointing.resume import Resume
from llm_train.runtime.model.fast import check_attention_kernel, disable_nccl_p2p, set_cuda_alloc_conf
from llm_train.runtime.model.model import load_tokenizer
from llm_train.runtime.model.optim import check_optimizer_package
from llm_train.runtime.model.quantized_base import check_bitsandbytes, check_staged_quantizer
from llm_train.runtime.rl.rewards import check_columns, load_rewards
from llm_train.runtime.rundir import check_output_dir
from llm_train.runtime.session import RunOptions, run_training


def build_parser(recipe_positional: bool = False, add_help: bool = True) -> argparse.ArgumentParser:
    """train.py's arguments; `llm-train dry-run` takes the same ones with the recipe as a positional."""
    parser = argparse.ArgumentParser(
        prog="llm_train/train.py", description=__doc__.splitlines()[0], add_help=add_help
    )
    recipe_help = "A name in recipes/ (see `llm-train recipes`) or a YAML path."
    if recipe_positional:
        parser.add_argument("recipe", help=recipe_help)
    else:
        parser.add_argument("--recipe", required=True, help=recipe_help)
    parser.add_argument(
        "--ds-config", help="A DeepSpeed JSON to use instead of the recipe's deepspeed.config."
    )
    parser.add_argument("--output-dir", help="Run directory (default: the recipe's output.dir).")
    parser.add_argument("--max-steps", type=int, help="Shortcut for optim.max_steps=N.")
    parser.add_argument(
        "--overwrite", action="store_true", help="Replace a run directory that holds another run."
    )
    parser.add_argument(
        "--skip-ram-check", action="store_true", help="Start even if the planner says host RAM is too small."
    )
    parser.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="Continue from the newest complete checkpoint of the run directory (auto) or from PATH; "
        "the world size, TP degree, ZeRO stage and offload may differ from the checkpoint's.",
    )
    parser.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="With --resume: train on with this launch's global batch instead of keeping the checkpoint's.",
    )
    parser.add_argument(
        "--allow-data-revision-change",
        action="store_true",
        help="With --resume: continue a streamed hub dataset that now resolves to another commit than the "
        "checkpoint read (its saved offsets then point at other rows).",
    )
    parser.add_argument(
        "--allow-base-change",
        action="store_true",
        help="With --resume of a LoRA run: continue its adapters on a base model other than the one they were "
        "trained on.",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="Print the resolved recipe, DS JSON, plan, memory; exit."
    )
    parser.add_argument("--world-size", type=int, help="With --dry-run: plan for this many processes.")
    parser.add_argument("--verbose", action="store_true", help="Keep DeepSpeed / torch / transformers logs.")

    add_observability_args(parser)  # --peak-tflops, --profile A-B, --flops-profiler
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="Recipe overrides, e.g. optim.lr=1e-4."
    )
    return parser


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """The observability flags of `llm_train/train.py` (metrics peak, profiling)."""
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="Dense bf16 peak TFLOP/s of one device, for MFU (default: from the GPU table; none on CPU).",
    )
    parser.add_argument(
        "--profile",
        metavar="A-B",
        type=_profile_range,
        help="Record a torch.profiler trace of optimizer steps A..B into RUN_DIR/profile/ "
        "(open in TensorBoard or https://ui.perfetto.dev).",
    )
    parser.add_argument(
        "--flops-profiler",
        action="store_true",
        help="Also run DeepSpeed's flops profiler at the first --profile step (or step 2); "
        "summary in RUN_DIR/profile/flops_profiler.txt.",
    )


def _profile_range(spec: str) -> str:
    # Checked while parsing, so a typo fails in a second, not after the model has loaded.

    try:
        parse_range(spec)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
    return spec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # Intermixed: overrides may stand before, between and after the options. Plain parse_args
    # gives the nargs="*" positional only the first run of them and refuses the rest.
    return build_parser().parse_intermixed_args(argv)


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(message: str) -> None:
    if is_rank0():
        print(message, flush=True)


def print_dry_run(run: Resolved) -> None:

    print(f"# recipe {run.recipe.name} (resolved)\n{run.recipe_yaml()}")
    print(f"# DeepSpeed config {run.ds_path} (effective)\n{run.ds_json()}\n")
    print("# parallel plan")
    for key, value in run.layout.rows():
        print(f"  {key:<12} {value}")
    print(f"  {'attention':<12} {run.recipe.memory.attention} ({run.attention})")
    for label, line in evidence_lines(run.recipe, run.layout):
        print(f"  {label:<12} {line}")
    rows = memory_rows(run)
    if rows:
        print("# memory estimate per GPU / host (first estimate; see `llm-train plan`)")
        for key, value in rows:
            print(f"  {key:<28} {value}")
    if run.notice:
        print(f"notice: {run.notice}")
    if lines := checkpoint_lines(run):
        print("# checkpoints (estimate; see llm_train/planning/speed/checkpoint_cost.py for the rates)")
        for line in lines:
            print(f"  {line}")
    # Last, because it may tokenise local data (into the cache the run reads) and refuses a run
    # that would loop over its data more than data.max_epochs times.
    recipe = run.recipe
    print("# data volume")
    if objective_spec(
        recipe.objective
    ).generates:  # prompts are read at start-up, and an RL run revisits them by design
        grpo = recipe.grpo
        prompts = run.layout.global_batch_size // grpo.num_generations
        print(f"  {prompts} prompts per step, {grpo.num_generations} completions each (objective grpo)")
        print_reward_check(recipe)
        return
    line = planned_volume(
        recipe.data, recipe.optim, run.layout, lambda: load_tokenizer(recipe.model), lambda m: print(f"  {m}")
    )
    print(f"  {line}")


def print_reward_check(recipe: Recipe) -> None:
    """GRPO's rewards as a run would meet them: each imported (or loaded), an overlong buffer below
    max_completion_length, and every field they need present in the prompt rows; one line if not."""
    grpo = recipe.grpo
    rewards = load_rewards(grpo.rewards, grpo.max_completion_length)
    print("# rewards")
    for reward in rewards:
        needs = f", reads {', '.join(reward.columns)}" if reward.columns else ""
        print(f"  {reward.key} {reward.label}: loaded{needs}, weight {reward.weight}")
    # The fields each reward reads are checked against the prompt rows where a dry run can read them: as
    # data/volume.py planned_volume does, it downloads no hub dataset and goes on without a hub tokenizer.
    remote = hub_sources(recipe.data)
    if remote:
        print(f"  reward fields not checked before the run: data.train names the hub dataset {remote[0]}")
        return
    try:
        tokenizer = load_tokenizer(recipe.model)
    except UserError as exc:
        print(f"  reward fields not checked before the run: {exc}")
        return
    room = recipe.data.seq_len - grpo.max_completion_length
    parts = load_prompts(recipe.data, tokenizer, room, lambda m: print(f"  {m}"), grpo.chat_template_kwargs)
    check_columns(rewards, sorted({k for part in parts for p in part[:1] for k in p.columns}))


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    """Run (or dry-run) what `argv` asks for; `args`: the same already parsed (`llm-train dry-run`)."""
    # First of all: the CUDA allocator reads its settings when CUDA initialises, and hardware
    # detection below initialises it.
    set_cuda_alloc_conf()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv) if args is None else args
    try:
        spawn, accelerate = None, None
        if args.dry_run:
            world_size = args.world_size
            if world_size is not None and world_size < 1:
                # 0 used to fall through to the recipe's own hardware without a word.
                raise UserError(f"--world-size {world_size}: plan for at least 1 process (or leave it out)")
            device = None
        else:
            if args.world_size is not None:
                raise UserError(
                    "--world-size only applies to --dry-run; the launcher decides the real world size"
                )
            accelerate = launch_env.accelerate_launch()  # the user's accelerate config and flags, if any
            accelerate_launch.refuse(accelerate)
            spawn = launch_env.world_from_accelerate_parent()
            world_size = launch_env.world_from_env() or (spawn.world_size if spawn else 1)

            device = Device.detect()
            # NCCL reads its P2P switch when the process group starts (later, in the session).
            if p2p_notice := disable_nccl_p2p(gpus_without_p2p()):
                say(f"notice: {p2p_notice}")
        made: list[RunEstimate] = []  # deepspeed.pinning=auto's estimates: the chosen one is the run's own
        run = resolve(args, world_size, device, accelerate, made)
        if args.dry_run:
            print_dry_run(run)
            return 0

        nproc_per_node = spawn.nproc_per_node if spawn is not None else None
        # The planner's estimate, once per process: every check before start and the start-up summary read it.
        estimated = estimate_run(run, nproc_per_node, made)
        resume = check_before_start(run, args, nproc_per_node, estimated)
        if spawn is not None:
            say(f"starting {spawn.nproc_per_node} local worker(s) of a world of {spawn.world_size}")
            if accelerate is not None:  # the workers' parent is this process, not the launcher
                os.environ[accelerate_launch.ENV] = accelerate.to_json()
            return launch_env.spawn_workers(spawn, [str(Path(__file__).resolve()), *argv])

        # The worker's run as the resume trains it (the kept global batch, universal loading): before the
        # data, whose step count from optim.epochs depends on the accumulation.
        run = resume.refine(run, say)
        options = RunOptions(
            resume=args.resume,
            overwrite=args.overwrite,
            verbose=args.verbose,
            profile=args.profile,
            flops_profiler=args.flops_profiler,
            peak_tflops=args.peak_tflops,
            estimate=estimated,
        )
        return run_training(run, options, resume, say)
    except UserError as exc:
        if is_rank0():
            print(f"llm-train: error: {exc}", file=sys.stderr, flush=True)
        launch_env.record_error(f"llm-train: error: {exc}")  # every rank: torchrun reports the first to fail
        return exc.exit_code


def resolve(
    args: argparse.Namespace,
    world_size: int | None,
    device: Device | None,
    accelerate: AccelerateLaunch | None = None,
    made: list[RunEstimate] | None = None,
) -> Resolved:
    """The run these arguments ask for on `world_size` processes (None: the hardware the recipe declares).

    `accelerate`: what the user's accelerate config and launch flags say (its deepspeed_config_file
    stands for --ds-config; its other what-fields are reported against the recipe's in one notice).
    `llm-train train` calls this too, before it starts any launcher, so that a bad input is one line.
    """
    run = resolve_run(
        args.recipe,
        args.overrides,
        world_size=world_size or None,
        device=device,
        ds_config_path=accelerate_launch.ds_config(accelerate, args.ds_config),
        max_steps=args.max_steps,
        output_dir=args.output_dir,
    )
    if notice := accelerate_launch.reconcile(accelerate, run, args.ds_config):
        run = run.refine(notice=notice)
    if run.recipe.deepspeed.pinning == "auto":
        # Decided once, here: the run (its DS JSON, the run directory's recipe.yaml, the checkpoints'
        # recipe hash) carries the allocator it decided on from now on.
        pinning, notice = auto_pinning(run, made=made)
        run = run.refine(pinning=pinning, notice=notice)
    backend = os.environ.get(PIN_BACKEND_ENV)
    if backend and backend != ("native" if run.recipe.deepspeed.pinning == "native" else "torch"):
        say(
            f"notice: {PIN_BACKEND_ENV}={backend} in the environment is replaced by deepspeed.pinning="
            f"{run.recipe.deepspeed.pinning} (the recipe decides; set deepspeed.pinning=native for exact-size pins)"
        )
    if args.flops_profiler and run.layout.pp > 1:
        raise UserError(
            f"--flops-profiler is not supported with deepspeed.pipeline_stages={run.layout.pp} (DeepSpeed "
            "profiles the engine's forward, which the pipeline schedule bypasses); use --profile A-B"
        )
    return run


def check_before_start(
    run: Resolved, args: argparse.Namespace, nproc_per_node: int | None, estimated: RunEstimate | None = None
) -> Resume:
    """What a dry run cannot know but a start can: the run directory, kernels, host RAM, the NVMe path.
    `estimated`: the run's estimate on this node (guards.estimate_run; made here when None), read by every check.

    Returns the planned resume (a fresh start without --resume): a layout change a resume cannot
    bridge is refused here, before any worker starts, and a worker trains with the plan it made here.
    """
    if not args.resume:
        check_output_dir(run.recipe.output_dir, args.overwrite)
    resume = Resume.plan(
        args.resume or None,
        run.recipe.output_dir / "checkpoints",
        run.layout,
        args.allow_batch_change,
        args.allow_data_revision_change,
        run.recipe,
        args.allow_base_change,
    )
    check_attention_kernel(run.recipe.memory)
    check_bitsandbytes(run.recipe.lora)
    check_staged_quantizer(run.recipe.lora, run.layout.zero_stage)  # transformers' op is the tested one
    check_recipe_tasks(run.recipe.eval)  # lm-eval installed, every task of eval.tasks known
    check_optimizer_package(run.recipe.optim)
    if objective_spec(
        run.recipe.objective
    ).generates:  # a reward function that cannot be imported: one line, now
        load_rewards(run.recipe.grpo.rewards, run.recipe.grpo.max_completion_length)
    estimated = estimated or estimate_run(run, nproc_per_node)
    if not args.skip_ram_check:
        check_host_ram(run, estimated=estimated)  # one line now, rather than the OS killing a rank mid-load
    check_nvme_path(run, nproc_per_node, estimated)
    check_memlock(run, nproc_per_node, estimated=estimated)
    return resume


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and closed by now. Skipping interpreter teardown avoids a
    # sporadic C++ "terminate called without an active exception" from communication
    # threads still being destroyed, which would turn a finished run into exit code 250.
    os._exit(code)
