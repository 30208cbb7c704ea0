"""Session-wide e2e fixtures: the reference runs are launched once and shared by every module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.reference import VARIANTS, run_args
from tests.helpers import assert_ok, launch, make_tiny_pretrained


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("pretrained") / "tiny")


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("zero")
    out = {}
    for variant in VARIANTS:
        run_dir = base / variant
        assert_ok(launch(run_args(variant, run_dir, pretrained)))
        out[variant] = run_dir
    return out
