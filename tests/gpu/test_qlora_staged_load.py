"""A 4-bit base staged on the host, quantised on the GPU weight by weight (runtime/model/quantized_base.py `quantizing_on`).

On a CUDA machine: the codes and quantisation state the staged load makes equal bitsandbytes' own CUDA
quantisation of the same bf16 weights, the codes end on the host and the state on the GPU, and the
allocator's peak during the load stays within the planner's bound (quantized.staged_quantize_gpu_bytes:
the state of the whole base plus the largest weight being quantised), far under the 4-bit base itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_train.config.recipe_sections import LoraSection
from tests.optional import import_or_skip

bnb = import_or_skip("bitsandbytes")

pytestmark = pytest.mark.gpu

# Llama-3-8B's layer shape, a few layers: the weights, not the small tensors, decide the peak.
FIELDS = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
}
# Beyond the planner's bytes, per quantised layer: its state's small tensors (the 16-entry code book, the
# offset, the nested absmax and 256-entry code book), each rounded up to the caching allocator's 512-byte
# blocks: under 4 KiB.
SMALL_BLOCKS_PER_LAYER = 4096


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("staged") / "base"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("llama", **FIELDS), dtype=torch.bfloat16
        )
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def test_gpu_staging_quantises_as_bitsandbytes_does_on_cuda_within_the_planners_bound(base: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llm_train.planning.memory.quantized_bytes import quantization_state_bytes, staged_quantize_gpu_bytes
    from llm_train.planning.model.shapes import shape_from_config
    from llm_train.runtime.model.quantized_base import (
        Staging,
        is_quantized_linear,
        quantization_config,
        quantizing_on,
    )

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with quantizing_on(Staging("cuda")):
        model = AutoModelForCausalLM.from_pretrained(
            base,
            dtype=torch.bfloat16,
            device_map={"": "cpu"},
            quantization_config=quantization_config(LoraSection(quantize="nf4"), torch.bfloat16),
        )
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    layers = {name: m for name, m in model.named_modules() if is_quantized_linear(m)}
    assert len(layers) == 7 * FIELDS["num_hidden_layers"]
    shape = shape_from_config(model.config.to_dict())
    small = SMALL_BLOCKS_PER_LAYER * len(layers)
    assert peak <= staged_quantize_gpu_bytes(shape, 2) + small
    state = quantization_state_bytes(shape, "nf4")
    assert state <= after <= state + small  # only the state stays on the GPU: the base is on the host
    packed = sum(m.weight.numel() * m.weight.element_size() for m in layers.values())
    assert peak < packed  # the 4-bit base was never whole on the card (here ~40% of it at the peak)

    weights = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for name, module in layers.items():
        assert module.weight.device.type == "cpu" and module.weight.quant_state.absmax.device.type == "cuda"
        codes, state_ = bnb.functional.quantize_4bit(
            weights[f"{name}.weight"].cuda(),
            blocksize=64,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.bfloat16,
        )
        mine = module.weight.quant_state
        # Packed codes stored as bf16: compared as bytes (some byte patterns read as NaN).
        assert torch.equal(module.weight.data.view(torch.uint8), codes.cpu().view(torch.uint8)), name
        for got, want in (
            (mine.absmax, state_.absmax),
            (mine.offset, state_.offset),
            (mine.state2.absmax, state_.state2.absmax),
            (mine.code, state_.code),
            (mine.state2.code, state_.state2.code),
        ):
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert (mine.shape, mine.dtype, mine.blocksize) == (state_.shape, state_.dtype, state_.blocksize)
