"""A missing optional part is never silent: skipped and listed on a fresh machine, a failure in CI.

Each case runs pytest in a child process over a small test file that needs a part, with the part
"missing" through LLM_TRAIN_TESTS_WITHOUT (tests/optional.py), so the rule is checked on a machine
that has every part, as CI's has.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.optional import PARTS, import_or_skip, needs

NEEDS_LIBAIO = """
from tests.optional import import_or_skip, needs

@needs("libaio")
def test_nvme():
    pass

def test_plain():
    pass
"""
NEEDS_BNB_AT_IMPORT = """
from tests.optional import import_or_skip

bnb = import_or_skip("bitsandbytes")

def test_qlora():
    pass
"""
NEEDS_GPU = """
import pytest

@pytest.mark.gpu
def test_on_the_card():
    pass
"""


def _pytest(tmp_path: Path, source: str, without: str, ci: bool, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env |= {"LLM_TRAIN_TESTS_WITHOUT": without, "PYTHONPATH": str(REPO), **({"CI": "true"} if ci else {})}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.optional", "-p", "no:cacheprovider", *extra]
    cmd += ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_case.py")]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_part_skips_with_its_fix_and_the_run_says_what_was_not_tested(tmp_path: Path) -> None:
    result = _pytest(tmp_path, NEEDS_LIBAIO, "libaio", False, "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    assert f"missing libaio: {PARTS['libaio'].how}" in result.stdout  # the skip's own reason
    summary = [line for line in result.stdout.splitlines() if line.startswith("not tested here")]
    assert summary == [
        "not tested here (skipped tests or modules per missing part): "
        f"libaio: 1 skipped ({PARTS['libaio'].how})"
    ]


@pytest.mark.parametrize("source", [NEEDS_LIBAIO, NEEDS_BNB_AT_IMPORT])
def test_in_ci_the_same_absence_fails_the_run(tmp_path: Path, source: str) -> None:
    part = "libaio" if "libaio" in source else "bitsandbytes"
    result = _pytest(tmp_path, source, part, ci=True)
    assert result.returncode not in (0, 5), result.stdout + result.stderr  # 5 would be "nothing collected"
    assert f"{part} is missing in CI, where .ci/run installs it" in result.stdout


def test_a_missing_gpu_is_a_skip_even_in_ci(tmp_path: Path) -> None:
    result = _pytest(tmp_path, NEEDS_GPU, "a CUDA GPU", ci=True)
    assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout + result.stderr
    assert "a CUDA GPU: 1 skipped" in result.stdout


def test_nothing_missing_says_so_and_durations_are_written(tmp_path: Path) -> None:
    durations = tmp_path / "out" / "durations.tsv"
    result = _pytest(
        tmp_path, NEEDS_LIBAIO.replace('@needs("libaio")', ""), "", False, "--durations-file", str(durations)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not tested here: nothing skipped for a missing part" in result.stdout
    rows = durations.read_text().splitlines()
    assert rows[0] == "seconds\ttest" and sorted(r.split("\t")[1] for r in rows[1:]) == [
        "test_case.py::test_nvme",
        "test_case.py::test_plain",
    ]
    assert all(float(r.split("\t")[0]) >= 0 for r in rows[1:])


def test_an_unknown_part_is_refused_at_once() -> None:
    with pytest.raises(KeyError, match="unknown optional part 'libaoi'"):
        needs("libaoi")
    with pytest.raises(KeyError, match="unknown optional part"):
        import_or_skip("nonexistent_package_xyz")


def test_the_suite_declares_optional_parts_only_through_tests_optional() -> None:
    """pytest.importorskip and skipif hide an absence from the summary and from CI: none left."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "optional.py" or path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("importorskip", "skipif"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.attr}")
    assert not offenders, offenders
