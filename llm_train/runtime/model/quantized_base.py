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

Under ZeRO-3 (nf4) the base is staged on the host and partitioned before the engine exists
(runtime/engines/zero_engine.py): transformers loads a quantised model outside zero.Init (modeling_utils
`get_init_context`, 5.24: zero.Init is skipped for quantised models) and puts it whole on the current
GPU, and DeepSpeed's engine moves a model not built under zero.Init to the GPU whole before it
partitions it (engine.py `_configure_distributed_model`, 0.19.8); a 70B base (~37 GiB packed) fits no
24 GB card that way. So transformers loads it onto the CPU (device_map cpu), each weight quantised on
the staging device as it loads (`quantizing_on` below: the GPU of a GPU run, one bf16 weight there at a time,
its packed codes back to the host, its quantisation state left on the GPU; the CPU of a CPU run),
`deepspeed.zero.Init(module=...)` partitions it tensor by tensor (each one moved to the GPU whole,
broadcast from rank 0, cut, and its partition kept on the GPU, or on the host under offload_param), and
`place_quantization_state` puts what ZeRO never sees on the GPU: each layer's quantisation state
(absmax, code books: ~1/32 of the packed bytes, a plain attribute, not a parameter, so whole on every
rank; already there when the GPU quantised it) and the model's buffers.

bitsandbytes 0.50 also runs on CPU (its wheel ships a CPU backend), which is what the tests use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from llm_train.config.recipe_sections import LoraSection
from llm_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from bitsandbytes.nn import Linear4bit, Linear8bitLt
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

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


# transformers' own skip for a causal LM's 4-bit load: the output layer (quantizers/base.py get_keys_to_not_convert);
# kept by name, since naming any skip module replaces transformers' list.
DEFAULT_KEEP = ("lm_head",)


def quantization_config(
    lora: LoraSection, dtype: torch.dtype, keep: Sequence[str] = ()
) -> BitsAndBytesConfig:
    """transformers' BitsAndBytesConfig for `lora.quantize`, computing (and storing) in `dtype`.

    `keep`: module-name patterns left unquantised (transformers' should_convert_module rules) on top of
    transformers' own choice (the output layer, tied weights), which naming any skip would otherwise replace.
    """
    check_bitsandbytes(lora)
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": [*keep, *DEFAULT_KEEP]} if keep else {}
    if lora.quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        **skip,
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


def staged_on_host(lora: LoraSection | None, zero_stage: int) -> bool:
    """The quantised base loads onto the CPU and is partitioned there by ZeRO-3 (module docstring): nf4
    under ZeRO-3. int8 keeps its scales in `Int8Params.SCB`, which nothing here moves: it loads as before."""
    return zero_stage == 3 and lora is not None and lora.quantize == "nf4"


class Staging:
    """Where each 16-bit weight of a staged 4-bit base is quantised: `device` (the run's GPU, or the CPU).

    `stage` puts one weight there; bitsandbytes then quantises it on that device (`Params4bit.to(device)`
    runs `quantize_4bit` where the data is: its CUDA kernel on a GPU, its CPU backend on the CPU). A test
    can stand in its own `stage` to watch what is staged when.
    """

    def __init__(self, device: torch.device | str) -> None:
        import torch

        self.device = torch.device(device)

    def stage(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.device)


# The parameters of transformers' 4-bit quantize op (integrations/bitsandbytes.py `Bnb4bitQuantize`), as
# transformers 5.24 and 5.25 have them: `staged_quantizer` subclasses it, builds it and calls its convert by
# these names. The class is not public API (5.x's Bnb4bitDeserialize.convert takes the same two in the other
# order), so another transformers is refused rather than called with arguments it may read otherwise.
QUANTIZE_OP_PARAMETERS = {
    "__init__": ("self", "hf_quantizer"),
    "convert": ("self", "input_dict", "full_layer_name", "model", "kwargs"),
}


def check_quantize_op() -> None:
    """Refuse in one line a transformers whose 4-bit quantize op is not the one `staged_quantizer` was verified on."""
    import inspect

    import transformers
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize

    for method, expected in QUANTIZE_OP_PARAMETERS.items():
        found = tuple(inspect.signature(getattr(Bnb4bitQuantize, method)).parameters)
        if found != expected:
            raise UserError(
                f"lora.quantize=nf4 under ZeRO-3 loads its base through transformers' Bnb4bitQuantize.{method}"
                f"({', '.join(expected[1:])}), but transformers {transformers.__version__} has "
                f"{method}({', '.join(found[1:])}); install the transformers llm_train is tested with (5.24 or 5.25)"
            )


def check_staged_quantizer(lora: LoraSection | None, zero_stage: int) -> None:
    """Before any worker starts: a base that will be staged (`staged_on_host`) can be, with this transformers."""
    if staged_on_host(lora, zero_stage):
        check_quantize_op()


def staged_quantizer(staging: Staging) -> type[Bnb4BitHfQuantizer]:
    """transformers' bitsandbytes 4-bit quantizer, its quantize op staging each weight on `staging.device`."""
    check_quantize_op()
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    class StagedQuantize(Bnb4bitQuantize):
        def convert(  # type: ignore[override]  # Bnb4bitQuantize's own signature (ConversionOps' differs)
            self,
            input_dict: dict[str, list[torch.Tensor]],
            full_layer_name: str | None = None,
            model: torch.nn.Module | None = None,
            **kwargs: Any,
        ) -> dict[str, torch.Tensor]:
            result = {}
            for name, value in input_dict.items():
                weight = value[0] if isinstance(value, list) else value
                host = weight.device
                staged = staging.stage(weight)
                # transformers' own op on the staged weight: Params4bit(staged, ...).to(staged.device), i.e.
                # bitsandbytes quantises it on the staging device (and sets the module's quant_state).
                quantized = super().convert(
                    {name: [staged]}, full_layer_name=full_layer_name, model=model, **kwargs
                )[name]
                del staged  # the 16-bit copy on the staging device: gone before the next weight comes
                # The packed codes to the host (ZeRO-3 partitions them from there); the quantisation state
                # stays where it was made. A no-op with the CPU as staging device.
                quantized.data = quantized.data.to(host)
                result[name] = quantized
            return result

    class StagedBnb4BitHfQuantizer(Bnb4BitHfQuantizer):
        def get_quantize_ops(self) -> StagedQuantize:
            return StagedQuantize(hf_quantizer=self)

    return StagedBnb4BitHfQuantizer


def place_quantization_state(model: torch.nn.Module, device: torch.device) -> None:
    """Move what ZeRO-3 never moves to `device`: every 4-bit layer's quantisation state and every buffer.

    The parameters stay where they are (zero.Init moves and partitions them). A model built under
    zero.Init gets its buffers on the GPU from the context; one partitioned after loading keeps them
    where it loaded (rotary frequencies), and bitsandbytes computes on the device of the weight with
    the state on the same device.
    """
    for module in model.modules():
        if is_quantized_linear(module):
            state = getattr(module.weight, "quant_state", None)
            if state is not None:
                state.to(device)  # bitsandbytes' QuantState.to moves its tensors in place
        for buffer in module.buffers(recurse=False):
            buffer.data = buffer.data.to(device)


def release_freed_host_memory() -> None:
    """Hand the staged load's freed temporaries back to the OS (glibc's malloc_trim; a no-op elsewhere).

    transformers' loader and bitsandbytes' CPU quantiser free many mid-sized tensors, which glibc keeps in
    its arenas for reuse: measured, ~0.28 B per quantised weight after the load, growing with the model,
    and ~0.15 GB after malloc_trim (bench/qlora_staged_load.py). The partitions ZeRO-3 allocates next are
    large blocks that never reuse them, so they would stay resident for the whole run.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class QuantizedBase:
    """What one rank holds of the quantised base, measured on its parameters (bytes)."""

    layers: int
    packed: int
    """The packed 4/8-bit weights of the whole base."""
    held: int
    """This rank's share of them: its ZeRO-3 partitions (`ds_tensor`), or all of them without ZeRO-3."""
    state: int
    """The quantisation state (absmax, code books), whole on every rank."""
    device: str
    """Where this rank's share lives (the host under offload_param)."""


def quantized_base(model: torch.nn.Module) -> QuantizedBase:
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    packed = held = state = 0
    device = "none"
    for module in layers:
        weight = cast("torch.nn.Parameter", module.weight)
        partition = getattr(weight, "ds_tensor", None)  # ZeRO-3's partition; the whole numel is ds_numel
        whole = int(getattr(weight, "ds_numel", weight.numel())) * weight.element_size()
        packed += whole
        held += partition.numel() * partition.element_size() if partition is not None else whole
        device = str((partition if partition is not None else weight).device.type)
        state += _state_bytes(getattr(weight, "quant_state", None))
    return QuantizedBase(len(layers), packed, held, state, device)


def _state_bytes(state: object) -> int:
    if state is None:
        return 0
    tensors = [getattr(state, k, None) for k in ("absmax", "code", "offset")]
    nested = getattr(state, "state2", None)
    if nested is not None:
        tensors += [nested.absmax, nested.code]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def describe_quantized(model: torch.nn.Module, lora: LoraSection, held_by_rank: list[int]) -> str:
    """One line for the start-up log: how much of the base is quantised, what each rank holds of it
    (`held_by_rank`: every rank's `QuantizedBase.held`), and what the adapters train."""
    base = quantized_base(model)
    # ds_numel: a ZeRO-3 parameter's own numel is its (empty) gathered-to-nothing placeholder's.
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    shares = " / ".join(f"{100 * h / max(1, base.packed):.1f}%" for h in held_by_rank)
    ranks = " / ".join(str(r) for r in range(len(held_by_rank)))
    return (
        f"base model: {base.layers} linear layers in {lora.quantize} (bitsandbytes), {base.packed / 2**20:,.2f} MiB "
        f"packed, held {shares} by ranks {ranks} (on {base.device}), quantisation state "
        f"{base.state / 2**20:,.2f} MiB whole on each; embeddings and output layer 16-bit; "
        f"{trainable:,} trainable adapter parameters"
    )


# ------------------------------------------------------------ workarounds (listed in compat.WORKAROUNDS)


def keep_training_layout(model: torch.nn.Module) -> None:
    """Stop bitsandbytes' CPU backend from repacking 4-bit weights in place for inference.

    On CPUs with AVX512-BF16, bitsandbytes 0.50's `Linear4bit.forward` in eval mode without gradients
    converts its weight to a layout for its CPU GEMV kernel and keeps it converted. After that, a
    training forward takes the inference kernel (no gradient flows to the layer's input, so every
    adapter below it stops learning) and dequantising the weight for the merged export reads
    garbage (seen on this project's CPU test machine: logits off by more than the model's scale).
    An evaluation during training, and the export's reference forward, are exactly that case.
    GPUs never repack; this only switches the CPU path off.
    """
    for module in model.modules():
        if is_quantized_linear(module) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


@contextlib.contextmanager
def quantizing_on(staging: Staging) -> Iterator[None]:
    """While a 4-bit base loads onto the host (device_map cpu): each weight quantised on `staging.device`.

    A patch of transformers 5.24's quantizer registry (unchanged in 5.25), for the time of the load only (its
    quantize op: runtime/model/quantized_base.py `staged_quantizer`, which refuses in one line a transformers whose
    op takes other parameters than the ones it was verified with: `check_quantize_op`).

    transformers' loader (core_model_loading.py `convert_and_load_state_dict_in_model`, 5.24) reads the
    checkpoint one tensor at a time, and with on-the-fly quantisation it reads them in the main thread, one
    after the other ("sync loading to avoid worker threads loading full-precision tensors ... faster than the
    main thread can quantize them"); each weight of a `Linear4bit` goes through its quantizer's quantize op
    (`Bnb4BitHfQuantizer.get_quantize_ops` -> `Bnb4bitQuantize.convert`, which makes the `Params4bit` and
    moves it to the tensor's device, quantising it there). The hook is that op, and only its device: for the
    time of the load transformers' registry of quantizers (quantizers/auto.py `AUTO_QUANTIZER_MAPPING`, the
    dict its `register_quantizer` writes) maps bitsandbytes 4-bit to a subclass whose op stages the weight,
    runs transformers' own op on it, and moves the packed codes back to the host. transformers has no
    setting for "quantise on this device, keep on that one" (device_map places a tensor where it is
    quantised, and on a GPU its allocator warm-up would reserve the whole base there first:
    modeling_utils `caching_allocator_warmup`), so this much is ours.

    On the GPU at a time: the weight being quantised (16-bit), its packed codes and bitsandbytes' fp32
    absmax temporaries, plus the quantisation state of the weights before it, which stays there (the run
    keeps it on the GPU: `place_quantization_state`). With the CPU as staging device every step is today's
    CPU load, bit for bit (`stage` and the moves back are no-ops).
    """
    from transformers.quantizers import auto
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    key = "bitsandbytes_4bit"
    installed = auto.AUTO_QUANTIZER_MAPPING.get(key)
    if installed is not Bnb4BitHfQuantizer:
        # Another transformers (or another hook) behind the key: this hook would change what it does.
        raise RuntimeError(
            f"transformers' quantizer for {key} is {installed!r}, not Bnb4BitHfQuantizer: quantizing_on was "
            "written against transformers 5.24's"
        )
    auto.AUTO_QUANTIZER_MAPPING[key] = staged_quantizer(staging)
    try:
        yield
    finally:
        auto.AUTO_QUANTIZER_MAPPING[key] = installed
