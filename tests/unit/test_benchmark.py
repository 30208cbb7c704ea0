"""runtime/benchmark.py and `llm-train eval`'s inputs: lm-eval's results read right, bad inputs one line.

The evaluation itself (numbers equal to lm-eval's CLI, results in the run and its trackers) runs in
tests/e2e/test_eval.py; periodic evaluation during training in tests/e2e/test_periodic_eval.py.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from llm_train import cli
from llm_train.observability.tracking import WandbTracker, tensorboard_tag
from llm_train.runtime.benchmark import BUNDLED_TASKS, per_task
from tests.optional import require


def test_lm_evals_results_become_per_task_metrics_with_their_stderr() -> None:
    results = {
        "gsm8k": {
            "alias": "gsm8k",
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.05,
            "exact_match,flexible-extract": 0.5,
            "exact_match_stderr,flexible-extract": "N/A",  # lm-eval could not compute it
        },
        "llm_train_tiny": {
            "name": "llm_train_tiny",
            "sample_len": 32,
            "acc,none": 0.5,
            "acc_stderr,none": 0.09,
        },
    }
    assert per_task(results) == {
        "gsm8k": {
            "exact_match/strict-match": 0.25,
            "exact_match/strict-match_stderr": 0.05,
            "exact_match/flexible-extract": 0.5,
        },
        "llm_train_tiny": {"acc": 0.5, "acc_stderr": 0.09},
    }


def test_the_bundled_task_ships_with_the_package() -> None:
    import yaml

    assert {p.name for p in BUNDLED_TASKS.iterdir()} >= {
        "llm_train_tiny.yaml",
        "llm_train_tiny.py",
        "llm_train_tiny.jsonl",
    }
    text = (BUNDLED_TASKS / "llm_train_tiny.yaml").read_text()
    assert (
        "custom_dataset: !function llm_train_tiny.load" in text
    )  # read next to the YAML, from any directory
    loaded = yaml.safe_load(text.replace("!function ", ""))
    assert loaded["task"] == "llm_train_tiny" and loaded["output_type"] == "multiple_choice"


def test_the_bundled_items_are_the_builders_output() -> None:
    import json

    from llm_train.assets import eval_task
    from llm_train.assets.build import DEFAULT_OUT

    items = eval_task.build_items((DEFAULT_OUT / "corpus.txt").read_text(encoding="utf-8"))
    shipped = [json.loads(line) for line in (BUNDLED_TASKS / "llm_train_tiny.jsonl").read_text().splitlines()]
    assert shipped == items and len(items) == eval_task.ITEMS
    # Four different choices each, one of them the true continuation.
    assert all(len(set(i["choices"])) == 4 and 0 <= i["answer"] < 4 for i in items)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--tasks", "llm_train_tiyn"],
            "--tasks llm_train_tiyn: lm-eval knows no such task; did you mean llm_train_tiny",
        ),
        (["--tasks", ","], "--tasks: name at least one lm-eval task"),
        (["--tasks", "llm_train_tiny", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (
            ["--tasks", "llm_train_tiny", "--include-path", "/no/such"],
            "--include-path /no/such: no such folder",
        ),
    ],
)
def test_bad_eval_inputs_are_one_line_before_any_model_loads(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    require("lm_eval")
    assert cli.main(["eval", str(tmp_path / "no-model"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_without_lm_eval_the_command_names_the_extra(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    assert cli.main(["eval", str(tmp_path), "--tasks", "llm_train_tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'llm_train[eval]'" in err, err


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int | None]] = []
        self.defined: list[tuple[str, str]] = []

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((metrics, step))

    def define_metric(self, name: str, step_metric: str) -> None:
        self.defined.append((name, step_metric))


def test_benchmark_results_carry_their_own_step_in_wandb_and_their_sections_in_tensorboard() -> None:
    tracker = WandbTracker.__new__(WandbTracker)  # the W&B run itself is not under test
    tracker.run = FakeRun()  # type: ignore[assignment]
    tracker.log({"loss": 1.0}, step=20)
    tracker.log({"bench/t/acc": 0.5}, step=10)  # an older checkpoint, evaluated after step 20
    assert tracker.run.logged == [({"loss": 1.0}, 20), ({"bench/t/acc": 0.5, "bench/step": 10}, None)]  # type: ignore[attr-defined]
    assert tracker.run.defined == [("bench/*", "bench/step")]  # type: ignore[attr-defined]
    assert tensorboard_tag("bench/t/acc") == "bench/t/acc" and tensorboard_tag("eval_loss") == "eval/loss"


@pytest.mark.parametrize(
    "recipe, overrides, why",
    [
        ("tiny-cpu", [], None),  # ZeRO-3: a gathered copy
        ("tiny-cpu-chat", [], None),  # ZeRO-2: in place
        ("tiny-cpu-pp2", [], "deepspeed.pipeline_stages=2: each stage holds part of the model"),
        ("tiny-cpu-tp2", [], "tensor parallel 2"),
        ("tiny-cpu-sp2", [], "sequence parallel 2"),
    ],
)
def test_eval_tasks_run_where_rank_0_can_hold_the_whole_model(
    recipe: str, overrides: list[str], why: str | None
) -> None:
    from llm_train.config.resolution import resolve_run
    from llm_train.runtime.benchmark import unavailable

    found = unavailable(resolve_run(recipe, overrides, world_size=2))
    assert found == why if why is None else (found is not None and why in found), found


def test_a_recipes_task_problem_is_one_line_before_any_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require("lm_eval")
    from llm_train.commands import train as train_command

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a launcher was started")

    monkeypatch.setattr(train_command.subprocess, "Popen", no_launch)
    argv = [
        "train",
        "--recipe",
        "tiny-cpu",
        "eval.tasks=[llm_train_tiny]",
        "eval.tasks_include_path=[/no/such]",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # Named by the recipe's key (the command's flag names are --tasks / --include-path).
    assert err.count("\n") == 1 and "eval.tasks_include_path /no/such: no such folder" in err, err
