"""QLoRA's frozen base: bitsandbytes 4-bit / 8-bit weights, loaded through transformers.

`lora.quantize: nf4` loads every linear layer of the base model as a bitsandbytes `Linear4bit`
(NF4 codes with double quantisation: ~0.52 byte per weight), `int8` as `Linear8bitLt`
(LLM.int8(): 1 byte per weight plus a scale per row). The embeddings and the output layer stay
in the 16-bit training dtype: transformers never quantises the output embeddings, and
`nn.Embedding` has no bitsandbytes counterpart here. LoRA adapters (PEFT) on top train in the
training dtype, like any other LoRA run.

Why these settings:
- compute dtype = the training dtype (bf16, fp16 on cards without bf16, fp32 on CPU): the
  4-bit weights are dequantised to it for every matmul;
- quant storage = the compute dtype: the packed 4-bit bytes are stored as a tensor of that
  dtype, so ZeRO-3 flattens and partitions them like any 16-bit weight (with uint8 storage it
  would refuse to mix dtypes in one flat buffer), and DeepSpeed's mixed-precision cast, which
  converts floating parameters to the training dtype, has nothing to convert;
- no `prepare_model_for_kbit_training`: PEFT's helper upcasts every non-quantised weight
  (embeddings, head, norms) to fp32, ~2 GiB more on an 8B model, which DeepSpeed's bf16 engine
  would cast straight back; freezing the base (PEFT does that) and non-reentrant activation
  checkpointing (model.py) are what QLoRA training needs.

bitsandbytes 0.50 also runs on CPU (its wheel ships a CPU backend), which is what the tests use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard, cast

from llm_train.config.recipe import LoraSection
from llm_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from bitsandbytes.nn import Linear4bit, Linear8bitLt
    from transformers import BitsAndBytesConfig

INSTALL_HINT = "pip install 'llm_train[qlora]' (or pip install bitsandbytes)"


def quantized(lora: LoraSection | None) -> bool:
    return lora is not None and lora.quantize != "none"


def check_bitsandbytes(lora: LoraSection | None) -> None:
    """Refuse in one line, before any worker starts, a QLoRA recipe on a machine without bitsandbytes."""
    if not quantized(lora):
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        assert lora is not None
        raise UserError(
            f"lora.quantize={lora.quantize} needs bitsandbytes, which does not import ({exc}); "
            f"{INSTALL_HINT}, or set lora.quantize=none"
        ) from None


def quantization_config(lora: LoraSection, dtype: torch.dtype) -> BitsAndBytesConfig:
    """transformers' BitsAndBytesConfig for `lora.quantize`, computing (and storing) in `dtype`."""
    check_bitsandbytes(lora)
    from transformers import BitsAndBytesConfig

    if lora.quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def is_quantized_linear(module: torch.nn.Module) -> TypeGuard[Linear4bit | Linear8bitLt]:
    """A bitsandbytes 4-bit or 8-bit linear layer (the base layer under a PEFT adapter, not PEFT's wrapper,
    which shares the class name)."""
    try:
        from bitsandbytes.nn import Linear4bit, Linear8bitLt
    except ImportError:
        return False
    return isinstance(module, (Linear4bit, Linear8bitLt))


def dequantized_weight(module: Linear4bit | Linear8bitLt, dtype: torch.dtype) -> torch.Tensor:
    """The full-precision weight of a bitsandbytes linear layer, in `dtype`, on the layer's device.

    PEFT's own helper (the one its merge uses) does the bitsandbytes calls for both layer kinds.
    """
    from peft.utils.integrations import dequantize_bnb_weight

    weight = cast(
        "torch.nn.Parameter", module.weight
    )  # bitsandbytes' Params4bit / Int8Params (Linear says Tensor)
    return dequantize_bnb_weight(weight, state=getattr(module, "state", None)).to(dtype)


def describe_quantized(model: torch.nn.Module, lora: LoraSection) -> str:
    """One line for the start-up log: how much of the base is quantised, and what the adapters train."""
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    packed = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"base model: {len(layers)} linear layers in {lora.quantize} (bitsandbytes, {packed / 2**20:,.1f} MiB "
        f"on this rank), embeddings and output layer 16-bit; {trainable:,} trainable adapter parameters"
    )
