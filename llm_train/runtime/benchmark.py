"""Benchmark tasks through lm-evaluation-harness: what `llm-train eval` and periodic evaluation run.

lm-eval (0.4.13, the `eval` extra) does the evaluation itself: `simple_evaluate` over its HF model
wrapper `HFLM`, with its own task definitions (`--tasks` by name; lm-eval's registry plus the
bundled `llm_train_tiny` task in llm_train/assets/eval_tasks/ and any `include_path` folder of
YAML tasks). Given a model *path*, HFLM loads it as lm-eval's own CLI would (so the numbers are
the CLI's) and, started by `accelerate launch` on more than one GPU, shards the requests over the
processes and gathers them (lm_eval/models/huggingface.py: data parallelism needs a path and
`torch.cuda.device_count() > 1`); given a live model *object* (periodic evaluation, an adapter or
a quantised base) it runs in one process.

What comes back is kept per task and metric with its standard error (`acc`, `acc_stderr`, ...),
written as JSON beside lm-eval's own table, and logged as `bench/TASK/METRIC` at the step the
weights are from.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train import ASSETS_DIR
from llm_train.config.recipe_sections import EvalSection
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.observability.tracking import BENCH
from llm_train.runtime.base.compat import no_progress_bars
from llm_train.runtime.checkpointing.file_sync import FileSync

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llm_train.runtime.base.collectives import Collectives

BUNDLED_TASKS = ASSETS_DIR / "eval_tasks"
INSTALL_HINT = "pip install 'llm_train[eval]' (or pip install lm-eval)"


@dataclass(frozen=True)
class BenchOptions:
    """What lm-eval is asked: the tasks and how they run."""

    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: float | None = None  # documents per task (a fraction below 1)
    batch_size: int = 8
    include_path: tuple[str, ...] = ()
    apply_chat_template: bool = False


@dataclass
class BenchResult:
    """One evaluation: per task, each metric and its standard error; lm-eval's own output beside it."""

    tasks: dict[str, dict[str, float]]
    samples: dict[str, int]
    seconds: float
    table: str  # lm-eval's markdown table (lm_eval.utils.make_table), as its CLI prints it
    raw: dict[str, Any] = field(repr=False)  # lm-eval's results, versions, n-shot, higher_is_better

    def metrics(self) -> dict[str, float]:
        """Flat tracker keys: bench/TASK/METRIC (and METRIC_stderr)."""
        return {
            f"{BENCH}{task}/{name}": value
            for task, values in self.tasks.items()
            for name, value in values.items()
        }

    def to_json(self, step: int | None, model: str, options: BenchOptions) -> dict[str, Any]:
        from importlib.metadata import version

        return {
            "step": step,
            "model": model,
            "tasks": self.tasks,
            "samples": self.samples,
            "seconds": round(self.seconds, 3),
            "options": {
                "tasks": list(options.tasks),
                "num_fewshot": options.num_fewshot,
                "limit": options.limit,
                "batch_size": options.batch_size,
                "apply_chat_template": options.apply_chat_template,
            },
            "lm_eval_version": version("lm-eval"),
            "lm_eval": {k: self.raw.get(k) for k in ("results", "versions", "n-shot", "higher_is_better")},
        }


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"benchmark evaluation needs lm-eval, which does not import ({exc}); {INSTALL_HINT}"
        ) from None


def quiet_lm_eval() -> None:
    """lm-eval's INFO lines and progress bars stay out of the training and command output."""
    import datasets

    datasets.disable_progress_bars()  # the bundled task's "Generating test split" bar
    for name in ("lm_eval", "lm-eval", "evaluate"):
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.cache
def task_manager(options: BenchOptions) -> Any:
    """lm-eval's TaskManager with the bundled tasks and `include_path`; unknown task names are one line.

    Indexing lm-eval's own registry (about 15,000 tasks, 0.4.13) takes 5-20 s on one core, so it is
    read only when a task is not in the bundled and included folders, and once per process (cached:
    the start's check and the periodic evaluation ask for the same options).
    """
    from lm_eval.tasks import TaskManager

    for folder in options.include_path:
        if not Path(folder).is_dir():
            raise UserError(f"--include-path {folder}: no such folder (lm-eval YAML tasks)")
    paths = [str(BUNDLED_TASKS), *options.include_path]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if set(options.tasks) <= set(manager.all_tasks):
        return manager
    manager = TaskManager(include_path=paths)
    known = set(manager.all_tasks)
    for name in options.tasks:
        if name not in known and not any(ch in name for ch in "*?["):
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise UserError(
                f"--tasks {name}: lm-eval knows no such task; {hint}`lm_eval ls tasks` lists them, or give a folder "
                "of YAML tasks with --include-path"
            )
    return manager


def evaluate(
    model: str | Any,
    tokenizer: PreTrainedTokenizerBase,
    options: BenchOptions,
    manager: Any | None = None,
    **model_args: Any,
) -> BenchResult | None:
    """Run `options.tasks` on `model` (a path, or a loaded model object); None on ranks that gather to rank 0.

    `model_args` go to HFLM (dtype, device, peft=adapter dir, ...).
    """
    require_lm_eval()
    quiet_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import make_table

    manager = manager or task_manager(options)
    started = time.perf_counter()
    with no_progress_bars():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=options.batch_size, **model_args)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(options.tasks),
            num_fewshot=options.num_fewshot,
            limit=options.limit,
            task_manager=manager,
            apply_chat_template=options.apply_chat_template,
            log_samples=False,
        )
    if out is None:  # a rank other than 0 of a data-parallel evaluation
        return None
    seconds = time.perf_counter() - started
    tasks = per_task(out["results"])
    samples = {task: int(n.get("effective", 0)) for task, n in (out.get("n-samples") or {}).items()}
    return BenchResult(tasks, samples, seconds, make_table(out), out)


def per_task(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's `results` ("acc,none": 0.5, "acc_stderr,none": 0.1, ...) as {task: {acc, acc_stderr, ...}}.

    The "none" filter is left out of the names; other filters stay (acc/strict-match); values that are
    not numbers (an alias, "N/A" for a stderr lm-eval could not compute) are not measurements.
    """
    tasks: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        metrics: dict[str, float] = {}
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not filt or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            base = name.removesuffix("_stderr")
            label = base if filt == "none" else f"{base}/{filt}"
            metrics[f"{label}_stderr" if name.endswith("_stderr") else label] = float(value)
        tasks[task] = metrics
    return tasks


def write_results(
    result: BenchResult, out_dir: Path, name: str, step: int | None, model: str, options: BenchOptions
) -> Path:
    """OUT_DIR/NAME.json (per task, with stderr) and OUT_DIR/NAME.md (lm-eval's table); returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result.to_json(step, model, options), indent=2) + "\n")
    where = f"step {step}" if step is not None else "the exported model"
    (out_dir / f"{name}.md").write_text(f"# lm-eval on {model} ({where})\n\n{result.table}")
    return path


# ------------------------------------------------------------ during training (recipe eval.tasks)


def recipe_options(section: EvalSection) -> BenchOptions:
    return BenchOptions(
        tasks=tuple(section.tasks),
        limit=section.tasks_limit,
        batch_size=section.tasks_batch_size,
        include_path=tuple(section.tasks_include_path),
    )


def check_recipe_tasks(section: EvalSection) -> None:
    """Before any worker starts: lm-eval imports and knows every task of eval.tasks (one line if not)."""
    if not section.tasks:
        return
    require_lm_eval()
    try:
        task_manager(recipe_options(section))
    except UserError as exc:
        raise UserError(
            str(exc).replace("--tasks", "eval.tasks").replace("--include-path", "eval.tasks_include_path")
        ) from None


def unavailable(run: Resolved) -> str | None:
    """Why eval.tasks cannot run on this layout during training (None: it can); the run trains on without it.

    lm-eval runs one model in one process (rank 0); the layouts below have no whole model there.
    """
    layout = run.layout
    if layout.pp > 1:
        return f"deepspeed.pipeline_stages={layout.pp}: each stage holds part of the model"
    if layout.tp > 1:
        return f"tensor parallel {layout.tp}: every layer is split over {layout.tp} ranks"
    if layout.sp > 1:
        return f"sequence parallel {layout.sp}: attention needs every rank of its group"
    lora = run.recipe.lora
    if layout.zero_stage == 3 and lora is not None and lora.quantize != "none":
        return f"lora.quantize={lora.quantize} under ZeRO-3: a quantised base does not gather into a copy"
    return None


class PeriodicBench:
    """eval.tasks on the live model every `every` steps and at the last: rank 0 evaluates, all ranks wait.

    The engine hands rank 0 the model as it trains (ZeRO-3: gathered into a copy, as the export
    gathers; engine.benchmark_model). The other ranks wait through files (file_sync.py), not inside
    a collective: an evaluation may last longer than the process group's timeout. Every rank returns
    the same metrics (rank 0's, posted), with bench/time_s, the seconds it took: training's tokens/s
    is metered on the steps alone, so it leaves them out.
    """

    def __init__(
        self,
        options: BenchOptions,
        every: int,
        tokenizer: PreTrainedTokenizerBase,
        model: Callable[[], AbstractContextManager[Any]],
        sync_root: Path,
        comm: Collectives,
        rank: int,
        patience_s: float,
    ) -> None:
        self.options, self.every, self.tokenizer, self.model = options, every, tokenizer, model
        self.sync_root, self.comm, self.rank, self.patience_s = sync_root, comm, rank, patience_s
        self.manager: Any = task_manager(options) if rank == 0 else None

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.every > 0 and step % self.every == 0)

    def run(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        sync = FileSync.open(self.sync_root, f"bench-{step}", self.comm, self.rank, self.patience_s)
        with self.model() as model:  # every rank: under ZeRO-3 the gather is a collective
            if self.rank == 0:
                with sync.working():
                    result = evaluate(model, self.tokenizer, self.options, self.manager)
                assert result is not None  # a model object: lm-eval runs it in this one process
                sync.post("bench", result.metrics())
        metrics: dict[str, float] = sync.wait("bench", [0], f"benchmark evaluation at step {step}")[0]
        return {**metrics, f"{BENCH}time_s": time.perf_counter() - started}
