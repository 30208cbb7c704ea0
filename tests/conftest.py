"""Test tiers: unit (default), e2e (real multi-process DeepSpeed on CPU), gpu (skipped without CUDA)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# DeepSpeed JIT-builds its CPU ops (cpu_adam, the shm all-reduce, async I/O) into torch's extensions
# folder, ~/.cache/torch_extensions by default. torch rebuilds an op whenever its include paths change,
# and they name the virtual environment: two checkouts on one machine then rebuild cpu_adam at every
# other launch (minutes of compiling on 2 cores, whose RSS a memory check of the run then counts). One
# folder per environment builds each op once. Every launch the tests make inherits this.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none present")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
