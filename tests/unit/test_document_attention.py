"""Attention kernels: packed rows give every sample the loss it has alone, `auto` picks by what is installed,
and the kernels that build no s x s mask are refused where they are not verified.

flex_attention runs forward on CPU (its backward does not: config/attention_kernel.py), so its exactness is
checked here and its speed on the GPU (bench/mfu_matrix.py, which also compares the compiled GPU
kernels' losses with sdpa's). Here flex runs uncompiled (dynamo disabled): torch's reference path
with the same block mask, which is what decides exactness. Compiled, each new shape costs 15-70 s
on 2 CPU cores; checked by hand once: the compiled CPU kernel's packed logits matched each sample
alone within 1.2e-7 (fp32), as the reference path's do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llm_train.config.attention_kernel import Installed, choose_attention
from llm_train.config.hardware import Device
from llm_train.config.resolution import resolve_run
from llm_train.data import prepare_data
from llm_train.data.model_inputs import IGNORE, build_rows
from llm_train.errors import UserError
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import shape_of
from llm_train.planning.search.candidate import memory_inputs
from llm_train.runtime.model import document_attention as sdpa_flex
from llm_train.units import GiB
from tests.devices import H100, H200, RTX_4090, RTX_4090_UNREAD
from tests.helpers import tiny_llama_config
from tests.unit.data_fixtures import data_section, get_tokenizer, text_rows, write_jsonl

# fp32 on CPU: the same math in another order (one causal row vs. a block-diagonal one) differs by
# a few ulps of the logits (~1e-7 measured); 1e-5 on a mean token loss of ~8 leaves two orders of margin.
LOSS_ATOL = 1e-5
CPU_KERNELS = ["sdpa", "eager", "flex_attention", "sdpa_flex"]


def _model(attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    sdpa_flex.register_sdpa_flex()
    torch.manual_seed(0)  # the same weights for every kernel
    config = tiny_llama_config(vocab_size=len(get_tokenizer()), max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def packed_batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Two packed rows of 128 tokens from the bundled tokenizer's text: several samples each, and a padding tail."""
    tmp_path = tmp_path_factory.mktemp("attention")
    path = write_jsonl(tmp_path / "docs.jsonl", text_rows(24, max_words=40))
    split = prepare_data(
        data_section(tmp_path, train=[str(path)], seq_len=128), get_tokenizer(), seed=0
    ).train
    rows = build_rows(split, [(0, 0), (0, 1)])
    return {k: torch.from_numpy(v) for k, v in rows.items() if isinstance(v, np.ndarray)}


@pytest.fixture
def uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_attention uncompiled (module docstring): transformers' two compile calls in their plain forms."""
    from torch.nn.attention import flex_attention as torch_flex
    from transformers import masking_utils
    from transformers.integrations import flex_attention

    def plain_flex(query, key, value, training=False, **kwargs):  # type: ignore[no-untyped-def]
        return torch_flex.flex_attention(query, key, value, **kwargs)

    def plain_block_mask(*args, _compile=False, **kwargs):  # type: ignore[no-untyped-def]
        return torch_flex.create_block_mask(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "compile_friendly_flex_attention", plain_flex)
    monkeypatch.setattr(masking_utils, "create_block_mask", plain_block_mask)


def _samples(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sample with targets; the padding tail (labels all -100) is left out."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        positions = batch["position_ids"][row].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for lo, hi in zip(starts, starts[1:], strict=False):
            if not (batch["labels"][row, lo:hi] == IGNORE).all():
                out.append((row, lo, hi))
    return out


def _sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean next-token loss of one sample: labels shifted inside the sample, its first token never a target."""
    return float(torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE))


@pytest.mark.parametrize("attention", CPU_KERNELS)
def test_packed_samples_have_the_loss_they_have_alone(
    attention: str, packed_batch: dict[str, torch.Tensor], uncompiled: None
) -> None:
    """Per-sample losses of packed rows = each sample run alone as one causal row (sdpa, is_causal), fp32."""
    samples = _samples(packed_batch)
    assert len(samples) >= 4 and len({row for row, _, _ in samples}) == 2  # several per row, both rows
    model = _model(attention)
    reference = _model("sdpa")
    with torch.no_grad():
        packed = model(**packed_batch, use_cache=False).logits
        for row, lo, hi in samples:
            labels = packed_batch["labels"][row, lo:hi]
            alone = reference(input_ids=packed_batch["input_ids"][row, lo:hi].unsqueeze(0)).logits[0]
            assert _sample_loss(packed[row, lo:hi], labels) == pytest.approx(
                _sample_loss(alone, labels), abs=LOSS_ATOL
            ), (attention, row, lo, hi)


def test_sdpa_flex_sends_unpacked_rows_to_sdpa_is_causal_and_packed_rows_to_flex(
    monkeypatch: pytest.MonkeyPatch, packed_batch: dict[str, torch.Tensor], uncompiled: None
) -> None:
    """Never the dense mask: a batch without boundaries gets sdpa with no mask (is_causal), a packed one a BlockMask."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations import flex_attention, sdpa_attention

    seen: list[str] = []
    real_sdpa, real_flex = sdpa_attention.sdpa_attention_forward, flex_attention.flex_attention_forward

    def spy_sdpa(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        seen.append("sdpa, no mask" if attention_mask is None else f"sdpa, {type(attention_mask).__name__}")
        return real_sdpa(module, query, key, value, attention_mask, **kwargs)

    def spy_flex(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        seen.append("flex, BlockMask" if isinstance(attention_mask, BlockMask) else "flex, other")
        return real_flex(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy_sdpa)
    monkeypatch.setattr(flex_attention, "flex_attention_forward", spy_flex)
    model = _model("sdpa_flex")
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        model(input_ids=packed_batch["input_ids"][:, :40], use_cache=False)  # plain causal rows
        assert seen == ["sdpa, no mask"] * layers
        seen.clear()
        full = torch.ones_like(packed_batch["input_ids"][:, :40])
        model(input_ids=packed_batch["input_ids"][:, :40], attention_mask=full, use_cache=False)  # no padding
        assert seen == ["sdpa, no mask"] * layers
        seen.clear()
        model(**packed_batch, use_cache=False)
        assert seen == ["flex, BlockMask"] * layers


HAVE_ALL = Installed(flash_attn=True, torch_version=(2, 11))
NO_FLASH = Installed(flash_attn=False, torch_version=(2, 11))
OLD_TORCH = Installed(flash_attn=False, torch_version=(2, 4))


@pytest.mark.parametrize(
    ("device", "degrees", "installed", "kernel"),
    [
        ("cpu", {}, HAVE_ALL, "sdpa"),  # flex cannot train on CPU, flash-attn needs a GPU
        (H200, {}, HAVE_ALL, "flash_attention_2"),
        (H200, {}, NO_FLASH, "sdpa_flex"),  # the GPU machine: torch 2.11, no flash-attn
        (H200, {}, OLD_TORCH, "sdpa"),
        (H200, {"sp": 2}, NO_FLASH, "sdpa"),  # Ulysses wraps sdpa / flash-attention only
        (H200, {"sp": 2}, HAVE_ALL, "flash_attention_2"),
        (H200, {"pp": 2}, NO_FLASH, "sdpa"),  # pipeline stages build their own masks
        (H200, {"tp": 2}, NO_FLASH, "sdpa"),  # flex under AutoTP: not verified
        ("cuda", {}, NO_FLASH, "sdpa"),  # a card whose shared memory is not known: the safe road
    ],
)
def test_auto_picks_the_fastest_exact_kernel_installed(
    device: Device | str, degrees: dict[str, int], installed: Installed, kernel: str
) -> None:
    choice = choose_attention("auto", device, installed=installed, head_dim=128, **degrees)
    assert choice.kernel == kernel and choice.why.startswith(f"auto -> {kernel}")
    # An explicit choice is kept as it is.
    assert choose_attention("eager", device, installed=installed, **degrees).kernel == "eager"


@pytest.mark.parametrize(
    ("device", "head_dim", "kernel", "because"),
    [
        # pytorch/pytorch#133254: the flex backward at head_dim 128 asks 131,074 bytes; a 4090 has 101,376.
        (
            RTX_4090,
            128,
            "sdpa",
            "needs 128 KiB of shared memory per block, NVIDIA GeForce RTX 4090 has 99 KiB",
        ),
        (
            H100,
            128,
            "sdpa_flex",
            "needs 128 KiB of shared memory per block, NVIDIA H100 80GB HBM3 has 227 KiB",
        ),
        (RTX_4090, 64, "sdpa_flex", "fits every card at head_dim 64"),
        # A dry run for a named card: no torch properties, the compute capability's table value.
        (Device("cuda", "A10", True, (8, 6)), 128, "sdpa", "A10 has 99 KiB"),
        (Device("cuda", "A100-80GB", True, (8, 0)), 128, "sdpa_flex", "A100-80GB has 163 KiB"),
        (Device("cuda", "RTX 5090", True, (12, 0)), 256, "sdpa", "needs 227 KiB"),  # #198224
        (Device("cuda", "GPU", True), 128, "sdpa", "this GPU's shared memory per block is not known"),
    ],
)
def test_auto_takes_flex_only_where_its_backward_fits_the_card_at_the_models_head_dim(
    device: Device, head_dim: int, kernel: str, because: str
) -> None:
    choice = choose_attention("auto", device, installed=NO_FLASH, head_dim=head_dim)
    assert choice.kernel == kernel and choice.why.startswith(f"auto -> {kernel}: ")
    assert because in choice.why and "\n" not in choice.why


def test_the_dry_run_of_a_4090_recipe_says_sdpa_and_why_and_the_planner_counts_its_mask() -> None:
    # 8b-32k-rtx4090 packs 32k-token rows of Llama-3.1-8B (head_dim 128) on an RTX 4090, without flash-attn.
    if Installed.here().flash_attn:
        pytest.skip("flash-attn is installed here: auto takes it")
    run = resolve_run("8b-32k-rtx4090", [], world_size=1, device=RTX_4090_UNREAD)
    assert run.recipe.memory.attention == "sdpa"
    assert (
        "at head_dim 128 needs 128 KiB of shared memory per block, NVIDIA GeForce RTX 4090 has 99 KiB"
        in run.attention
    )
    h100 = resolve_run("8b-32k-rtx4090", [], world_size=1, device=H100)
    assert h100.recipe.memory.attention == "sdpa_flex"
    # The planner estimates the kernel the run will use: the dense mask sdpa gets for packed rows.
    shape = shape_of("meta-llama/Llama-3.1-8B")
    assert "attention_mask" in estimate_memory(memory_inputs(run, shape, 1)).gpu_terms
    assert "attention_mask" not in estimate_memory(memory_inputs(h100, shape, 1)).gpu_terms


def test_flex_kernels_need_torch_2_5() -> None:
    with pytest.raises(UserError, match=r"memory.attention=sdpa_flex needs torch >= 2.5 .* torch 2.4"):
        choose_attention("sdpa_flex", "cuda", installed=OLD_TORCH)


def test_the_run_records_the_kernel_and_the_dry_run_says_why() -> None:
    run = resolve_run("tiny-cpu", ["memory.attention=auto"], world_size=2)
    assert run.recipe.memory.attention == "sdpa" and "on CPU" in run.attention
    assert "attention: sdpa" in run.recipe_yaml()  # the resolved recipe holds the kernel, never "auto"


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("tiny-cpu", ["memory.attention=sdpa_flex"], "cannot train on CPU"),
        ("tiny-cpu", ["memory.attention=flex_attention"], "cannot train on CPU"),
        ("1b-zero2", ["memory.attention=sdpa_flex", "deepspeed.sequence_parallel=2"], "plain ZeRO path only"),
        ("13b-pp2-zero1", ["memory.attention=flex_attention"], "plain ZeRO path only"),
    ],
)
def test_flex_kernels_are_refused_where_they_cannot_run(
    recipe: str, overrides: list[str], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        resolve_run(recipe, overrides, world_size=2)


def test_the_planner_counts_the_dense_mask_only_where_one_is_built() -> None:
    """Packed rows at 32k: sdpa's [b, 1, s, s] mask (GiBs), nothing for the kernels that build none."""
    shape = shape_of("meta-llama/Llama-3.1-8B")
    base = dict(shape=shape, world_size=1, zero_stage=3, seq_len=32_768, dense_mask=True)
    base.update(activation_checkpointing=True)
    sdpa = estimate_memory(MemoryInputs.of(**base, attn_impl="sdpa")).gpu_terms
    assert sdpa["attention_mask"] > 2 * GiB
    for kernel in ("sdpa_flex", "flex_attention", "flash_attention_2"):
        terms = estimate_memory(MemoryInputs.of(**base, attn_impl=kernel)).gpu_terms
        assert "attention_mask" not in terms, kernel
        assert terms["activations"] == sdpa["activations"], kernel  # the rest is the same kernel class


def test_an_unknown_kernel_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="sdpa_flex"):
        resolve_run("tiny-cpu", ["memory.attention=flex"], world_size=1)
