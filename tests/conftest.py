"""Test tiers: unit (default), e2e (real multi-process DeepSpeed on CPU), gpu (skipped without CUDA)."""

from __future__ import annotations

import pytest


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
