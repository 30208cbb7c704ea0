"""Speed switches: each is off or a safe default, and a missing requirement is a one-line error."""

from __future__ import annotations

import pytest

from llm_train.config.recipe_sections import MemorySection
from llm_train.errors import UserError
from llm_train.runtime.model.fast import apply_liger, compile_notice, dynamo_plugin, set_cuda_alloc_conf


def test_switches_default_off() -> None:
    memory = MemorySection()
    assert not memory.liger_kernels and memory.torch_compile == "off"
    assert apply_liger(memory, "llama", zero_stage=3) is None
    assert compile_notice(memory) is None


def test_liger_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(UserError, match=r"memory.liger_kernels=true needs a CUDA GPU"):
        apply_liger(MemorySection(liger_kernels=True), "llama", zero_stage=2)


@pytest.mark.parametrize(
    ("stage", "tiled_loss", "expected"),
    [
        (2, False, {"fused_linear_cross_entropy": True, "cross_entropy": False}),
        (3, False, {"fused_linear_cross_entropy": False, "cross_entropy": True}),
        (2, True, {"fused_linear_cross_entropy": False, "cross_entropy": False}),
    ],
)
def test_liger_loss_kernels_follow_zero_stage_and_tiled_loss(
    monkeypatch: pytest.MonkeyPatch, stage: int, tiled_loss: bool, expected: dict[str, bool]
) -> None:
    """Which of Liger's loss kernels are asked for (Liger itself needs a GPU: a stand-in records the call)."""
    import sys
    import types

    import torch

    calls: list[dict[str, bool]] = []

    def apply_liger_kernel_to_llama(
        rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True
    ) -> None:
        calls.append(
            {"cross_entropy": cross_entropy, "fused_linear_cross_entropy": fused_linear_cross_entropy}
        )

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    notice = apply_liger(MemorySection(liger_kernels=True, tiled_loss=tiled_loss), "llama", zero_stage=stage)
    assert calls == [expected]
    assert notice is not None and ("tiled_loss" in notice) == tiled_loss


@pytest.mark.parametrize(
    ("asked", "backend", "regional"),
    [
        ("off", "NO", False),
        ("model", "INDUCTOR", False),
        ("layers", "INDUCTOR", True),
        (True, "INDUCTOR", False),
    ],
)
def test_compile_switch_is_accelerates_dynamo_plugin(
    monkeypatch: pytest.MonkeyPatch, asked: object, backend: str, regional: bool
) -> None:
    """'layers' is Accelerate's regional compilation of the DeepSpeed module, 'model' DeepSpeed's engine.compile;
    an accelerate config's ACCELERATE_DYNAMO_* variables switch nothing (true, the old bool, means 'model')."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    memory = MemorySection(torch_compile=asked)  # type: ignore[arg-type]
    plugin = dynamo_plugin(memory)
    assert plugin.backend.name == backend and plugin.use_regional_compilation is regional
    notice = compile_notice(memory)
    assert (notice is None) == (backend == "NO")
    assert notice is None or ("each decoder layer" in notice) == regional


def test_alloc_conf_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert set_cuda_alloc_conf() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # the user's choice, even empty, is kept
    assert set_cuda_alloc_conf() is False
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")  # torch's newer name counts too
    assert set_cuda_alloc_conf() is False


def test_alloc_conf_is_set_before_anything_initialises_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hardware detection initialises CUDA (device name, bf16 support): the allocator setting must precede it."""
    import torch

    from llm_train import train
    from llm_train.config.hardware import Device
    from llm_train.errors import UserError

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    seen: dict[str, str | None] = {}

    def first_cuda_call(*args: object, **kwargs: object) -> None:
        seen.setdefault("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise UserError("stop here")

    import os

    monkeypatch.setattr(Device, "detect", staticmethod(first_cuda_call))
    monkeypatch.setattr(torch.cuda, "_lazy_init", first_cuda_call)
    assert train.main(["--recipe", "tiny-cpu"]) == 2
    assert seen == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_flash_attention_2_is_refused_in_one_line_when_flash_attn_does_not_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import types

    from llm_train.errors import UserError
    from llm_train.runtime.model.fast import check_attention_kernel

    check_attention_kernel(MemorySection(attention="sdpa"))  # nothing to check
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # an import of it raises ImportError
    with pytest.raises(UserError, match=r"memory.attention=flash_attention_2 .*memory.attention=sdpa"):
        check_attention_kernel(MemorySection(attention="flash_attention_2"))
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    check_attention_kernel(MemorySection(attention="flash_attention_2"))  # installed: accepted


def test_compile_over_the_alst_switches_is_refused_in_one_line() -> None:
    """Their own autograd functions and saved-tensor hooks under torch.compile: not verified, so refused."""
    from llm_train.config.recipe import load_recipe

    with pytest.raises(
        UserError, match=r"memory.torch_compile=layers is not verified with memory.tiled_mlp=true"
    ):
        load_recipe("tiny-cpu", ["memory.torch_compile=layers", "memory.tiled_mlp=true"])
    assert load_recipe("tiny-cpu", ["memory.torch_compile=layers"]).memory.torch_compile == "layers"
