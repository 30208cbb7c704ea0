"""Every source file compiles without warnings on this Python, so none appears on another.

The GPU machine runs Python 3.12, where an invalid escape in a docstring is a SyntaxWarning
printed at every launch; on 3.11 the same text is a silent DeprecationWarning. Compiling
with warnings turned into errors catches both here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p for folder in ("llm_train", "bench", "tests", "launch", "tools") for p in (REPO / folder).rglob("*.py")
)


def test_sources_were_found() -> None:
    assert len(SOURCES) > 50


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_compiles_without_warnings(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
