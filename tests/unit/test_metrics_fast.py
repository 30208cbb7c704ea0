"""Speed switches: each is off or a safe default, and a missing requirement is a one-line error."""

from __future__ import annotations

import pytest

from llm_train.errors import UserError
from llm_train.fast import apply_liger, compile_engine, set_cuda_alloc_conf
from llm_train.recipe import MemorySection


def test_switches_default_off() -> None:
    memory = MemorySection()
    assert not memory.liger_kernels and not memory.torch_compile
    assert apply_liger(memory, "llama", zero_stage=3) is None
    assert compile_engine(object(), memory) is None


def test_liger_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(UserError, match=r"memory.liger_kernels=true needs a CUDA GPU"):
        apply_liger(MemorySection(liger_kernels=True), "llama", zero_stage=2)


def test_compile_needs_an_engine_that_can() -> None:
    with pytest.raises(UserError, match="memory.torch_compile=true needs DeepSpeed >= 0.14"):
        compile_engine(object(), MemorySection(torch_compile=True))

    class Engine:
        compiled = False

        def compile(self) -> None:
            self.compiled = True

    engine = Engine()
    assert "torch.compile on" in (compile_engine(engine, MemorySection(torch_compile=True)) or "")
    assert engine.compiled


def test_alloc_conf_only_when_unset_and_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert set_cuda_alloc_conf() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert set_cuda_alloc_conf() is True
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # the user's choice, even empty, is kept
    assert set_cuda_alloc_conf() is False
