"""`llm-train eval MODEL --tasks T1,T2`: benchmark tasks through lm-evaluation-harness, into the run.

    llm-train eval runs/demo --tasks llm_train_tiny                     the run's final/
    llm-train eval runs/demo/checkpoints/step-00000100 --tasks ...      exported first (verified)
    llm-train eval runs/demo --tasks hellaswag,arc_easy --limit 200     lm-eval's own tasks (they download)

MODEL is what commands/model_source.py resolves (a run's final/, a checkpoint exported first into
RUN_DIR/exports/, an export; adapters through PEFT). lm-eval runs the tasks (runtime/benchmark.py);
the results go to RUN_DIR/eval/step-N.json (per task, each metric with its stderr) and step-N.md
(lm-eval's table), and to the run's trackers (metrics.jsonl, TensorBoard, W&B as its recipe has
them) as bench/TASK/METRIC at step N, the step the weights are from.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from llm_train.commands.generate import add_model_args
from llm_train.commands.model_source import (
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_source,
    torch_dtype,
)
from llm_train.errors import UserError
from llm_train.observability.library_logs import quiet
from llm_train.observability.tracking import open_trackers
from llm_train.runtime.benchmark import BenchOptions, evaluate, require_lm_eval, task_manager, write_results
from llm_train.runtime.checkpointing.commit import committed, step_name
from llm_train.runtime.checkpointing.run_state import trainer_state_path

PARALLEL = (
    "Data parallelism: started with `accelerate launch --num_processes N -m llm_train.cli eval ...` on a machine "
    "with N > 1 GPUs, lm-eval's HF backend shards the requests over the N processes and gathers them on "
    "process 0 (lm-eval 0.4.13 does this only for a model it loads from a path, on GPUs). An adapter, a "
    "quantised base, or a CPU machine: one process."
)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="Benchmark tasks (lm-evaluation-harness) on a run, a checkpoint or an export; results into the run.",
        description=__doc__.splitlines()[0] + " " + PARALLEL,
    )
    add_model_args(parser)
    parser.add_argument(
        "--tasks",
        required=True,
        help="Comma-separated lm-eval task names (`lm_eval ls tasks`); llm_train_tiny is bundled and offline.",
    )
    parser.add_argument(
        "--num-fewshot", type=int, help="Few-shot examples per prompt (default: each task's)."
    )
    parser.add_argument(
        "--limit", type=float, help="Documents per task (a fraction below 1); for a quick look."
    )
    parser.add_argument("--batch-size", type=int, default=8, help="Requests per forward pass (default 8).")
    parser.add_argument(
        "--include-path", action="append", default=[], help="A folder of lm-eval YAML tasks (repeatable)."
    )
    parser.add_argument(
        "--apply-chat-template", action="store_true", help="Render prompts with the run's chat template."
    )
    parser.add_argument(
        "--output-dir", help="Where the JSON and table go (default: RUN_DIR/eval, or MODEL/eval)."
    )
    parser.add_argument(
        "--no-trackers",
        action="store_true",
        help="Do not log the results to the run's metrics.jsonl / TensorBoard / W&B.",
    )
    parser.set_defaults(func=cmd_eval)


def options_of(args: argparse.Namespace) -> BenchOptions:
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not tasks:
        raise UserError("--tasks: name at least one lm-eval task (e.g. --tasks llm_train_tiny)")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit {args.limit}: must be > 0")
    return BenchOptions(
        tasks,
        args.num_fewshot,
        args.limit,
        args.batch_size,
        tuple(args.include_path),
        args.apply_chat_template,
    )


def cmd_eval(args: argparse.Namespace) -> int:
    quiet(verbose=False)  # transformers' load bars and advisories stay out of the results
    require_lm_eval()
    options = options_of(args)
    manager = task_manager(options)  # unknown task names: one line, before any model loads
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    import torch

    if world > 1 and torch.cuda.device_count() <= 1:
        raise UserError(
            f"llm-train eval under {world} processes: lm-eval shards requests over processes only on more than one "
            "GPU; run it as one process here"
        )
    source = resolve_source(Path(args.model), print if rank == 0 else lambda _: None)
    tokenizer = load_tokenizer(source)
    dtype = torch_dtype(args.dtype)
    model, how = _model(source, dtype, args.quantize, world)
    if rank == 0:
        print(f"llm-train eval: {source.model_dir} ({how}), tasks {', '.join(options.tasks)}", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {"dtype": dtype, "device": device} if isinstance(model, str) else {}
    result = evaluate(model, tokenizer, options, manager, **extra)
    if result is None:
        return 0  # gathered to process 0, which writes
    step = source.step
    name = step_name(step) if step is not None else source.model_dir.name
    out_dir = Path(args.output_dir) if args.output_dir else (source.run_dir or source.model_dir) / "eval"
    path = write_results(result, out_dir, name, step, str(source.model_dir), options)
    print(result.table, end="")
    print(f"llm-train eval: {len(result.tasks)} task(s) in {result.seconds:.1f}s -> {path} (+ .md)")
    if source.run_dir is not None and source.recipe is not None and step is not None and not args.no_trackers:
        _log(source, result.metrics(), step)
        print(f"llm-train eval: logged bench/* at step {step} to the run's trackers")
    return 0


def _model(source: ModelSource, dtype: object, quantize: str, world: int) -> tuple[object, str]:
    """A path for lm-eval to load (as its CLI does; data-parallel on GPUs), else the loaded model object."""
    plain = not source.adapter and quantize in ("auto", "none")
    if plain:
        return str(source.model_dir), f"loaded by lm-eval, {str(dtype).removeprefix('torch.')}"
    if world > 1:
        raise UserError(
            "llm-train eval of an adapter or a quantised base runs in one process (lm-eval shards only models it "
            "loads from a path); run it without accelerate launch, or export the run merged"
        )
    return load_model(source, dtype, quantize)


def _log(source: ModelSource, metrics: dict[str, float], step: int) -> None:
    """The results into the run's own trackers, at the step of the weights (W&B: the run the checkpoints name)."""
    assert source.run_dir is not None and source.recipe is not None
    run_id = _tracker_run_id(source.run_dir)
    # No configuration: the run's is the one training recorded (the recipe nested with the DS JSON
    # and the plan); W&B would merge a second one into it on resume, TensorBoard add another text.
    trackers = open_trackers(source.recipe.tracking, source.run_dir, None, True, run_id)
    try:
        trackers.log(metrics, step)
    finally:
        trackers.close()


def _tracker_run_id(run_dir: Path) -> str | None:
    """The W&B run id the run's newest checkpoint recorded (resume.py), so results join that run."""
    for ckpt in committed(run_dir / "checkpoints"):
        state = trainer_state_path(ckpt, 0)
        if state.is_file():
            return json.loads(state.read_text()).get("tracker_run_id")
    return None
