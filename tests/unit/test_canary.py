"""tools/canary.py (`make test-latest`): the newest set it asks for, and how it reports what moved."""

from __future__ import annotations

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO
from tools import canary

PYPROJECT = """
[project]
name = "llm_train"
dependencies = ["torch>=2.4", "transformers>=5.24,<5.25", "wandb>=0.18"]
[project.optional-dependencies]
dev = ["trl==1.16.0"]
lora = ["peft>=0.21,<0.22"]
qlora = ["llm_train[lora]", "bitsandbytes>=0.50.2,<0.51"]
other = ["not-taken>=1"]
"""


def test_the_newest_set_keeps_each_floor_and_drops_each_cap() -> None:
    reqs = canary.pyproject_requirements(PYPROJECT, extras=("dev", "lora", "qlora"))
    # llm_train's own extra is folded in, not required; an extra make install does not take is left out.
    assert [r.name for r in reqs] == ["torch", "transformers", "wandb", "trl", "peft", "bitsandbytes"]
    newest = [canary.without_upper_bounds(r) for r in reqs]
    assert newest == [
        "torch>=2.4",
        "transformers>=5.24",
        "wandb>=0.18",
        "trl>=1.16.0",
        "peft>=0.21",
        "bitsandbytes>=0.50.2",
    ]


def test_what_moved_is_one_line_per_library_saying_whether_it_left_its_window() -> None:
    reqs = [
        Requirement("transformers>=5.24,<5.25"),
        Requirement("peft>=0.21,<0.22"),
        Requirement("wandb>=0.18"),
    ]
    locked = canary.locked_versions(
        "transformers==5.24.0\n    # via x\npeft==0.21.2\nwandb==0.31.0\nrich==14.0\n"
    )
    assert locked == {"transformers": "5.24.0", "peft": "0.21.2", "wandb": "0.31.0", "rich": "14.0"}
    resolved = {
        "transformers": "5.25.0",
        "peft": "0.21.3",
        "wandb": "0.31.0",
        "rich": "15.0",
        "torch": "2.13.0",
    }
    assert canary.moved_lines(resolved, locked, reqs) == [
        "  peft 0.21.2 -> 0.21.3 (inside the window <0.22,>=0.21)",
        "  transformers 5.24.0 -> 5.25.0 (PAST the window <5.25,>=5.24)",
        "  rich 14.0 -> 15.0 (indirect)",
    ]


def test_the_canary_reads_the_real_pyproject_and_lock() -> None:
    reqs = canary.pyproject_requirements((REPO / "pyproject.toml").read_text())
    locked = canary.locked_versions((REPO / "requirements-lock.txt").read_text())
    # Every direct requirement but torch (the user's CUDA build, or the Makefile's CPU pin) is locked.
    assert {canonicalize_name(r.name) for r in reqs} - {"torch"} <= set(locked)


def test_the_report_names_each_failed_test_and_counts_the_rest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.unit.test_a" name="test_ok"/>'
        '<testcase classname="tests.unit.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.e2e.test_b" name="test_err"><error message="y"/></testcase>'
        '<testcase classname="tests.unit.test_c" name="test_skip"><skipped message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    failed, counts = canary.junit_results(junit)
    assert failed == ["tests.unit.test_a::test_bad", "tests.e2e.test_b::test_err"]
    assert counts == "1 passed, 2 failed, 1 skipped"
