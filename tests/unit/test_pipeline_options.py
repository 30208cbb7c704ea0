"""The pipeline engine's option table (tests/unit/pipeline_options.py) against the schema and the dry run.

A table check, so it runs in the unit tier: a recipe key added without a pipeline classification fails
here, before any launch (CI failed on it twice while it lived in the e2e tier: 403b5b1, 2016d82). The
refused options are checked through the dry run, which resolves exactly as a launch does; the options
that work are trained in tests/e2e/test_pipeline_options.py.
"""

from __future__ import annotations

import pytest

from llm_train import train
from llm_train.config.recipe import Recipe
from tests.unit.pipeline_options import OPTIONS, REFUSED_VALUES, leaf_keys


def test_every_recipe_option_is_classified_for_pipelines() -> None:
    assert sorted(OPTIONS) == sorted(leaf_keys(Recipe))


def _dry_run(overrides: list[str], capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code = train.main(["--recipe", "tiny-cpu-pp2", "--dry-run", "--world-size", "2", *flags, *overrides])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "override, message",
    [(o[1], o[2]) for o in OPTIONS.values() if o[0] == "refused"] + REFUSED_VALUES,
)
def test_what_the_pipeline_engine_cannot_do_is_refused_in_one_line(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _dry_run([override], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert message in err


@pytest.mark.parametrize("override, message", [(o[1], o[2]) for o in OPTIONS.values() if o[0] == "skipped"])
def test_what_a_pipeline_run_leaves_out_it_names(override: str, message: str) -> None:
    from llm_train.config.resolution import resolve_run
    from llm_train.runtime.benchmark import unavailable

    # Only the layout decides; the task list itself is checked before any launch (check_recipe_tasks).
    overrides = [override.format(corpus="."), "eval.tasks=[llm_train_tiny]"]
    why = unavailable(resolve_run("tiny-cpu-pp2", overrides, world_size=2))
    assert why is not None and message in why, why


def test_the_flops_profiler_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _dry_run([], capsys, "--flops-profiler")
    assert code == 2 and "--flops-profiler is not supported with deepspeed.pipeline_stages=2" in err
