"""QLoRA (lora.quantize): the recipe key, its refusals, the 4-bit base and its merged export, in one process.

The real 2-process runs (ZeRO-2 and ZeRO-3, kill -9 + resume) are tests/e2e/test_qlora.py.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import LoraSection
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from llm_train.runtime.export.verify import logit_tolerance
from llm_train.runtime.model.quantized_base import check_bitsandbytes, quantization_config
from llm_train.units import GiB
from tests.helpers import make_tiny_pretrained
from tests.optional import import_or_skip

import_or_skip("peft")
bnb = import_or_skip("bitsandbytes")

QLORA = ["model.init=pretrained", "model.name_or_path=/models/tiny", "lora.quantize=nf4"]


def test_recipe_key_defaults_to_none_and_names_its_values() -> None:
    assert load_recipe("tiny-cpu-lora").lora.quantize == "none"  # type: ignore[union-attr]
    assert load_recipe("tiny-cpu-lora", QLORA).lora.quantize == "nf4"  # type: ignore[union-attr]
    with pytest.raises(UserError, match=r"lora.quantize: Input should be 'none', 'nf4' or 'int8'"):
        load_recipe("tiny-cpu-lora", ["lora.quantize=fp4"])


def test_a_random_base_is_refused_in_one_line() -> None:
    with pytest.raises(
        UserError, match=r"lora.quantize=nf4 quantises a pretrained base as it loads; it needs model.init"
    ):
        load_recipe("tiny-cpu-lora", ["lora.quantize=nf4"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["deepspeed.config=zero3_offload_nvme"],
            r"lora.quantize=nf4 cannot offload parameters to nvme \(offload_param.device in ",
        ),
        (
            ["lora.quantize=int8", "deepspeed.config=zero3_offload"],
            r"lora.quantize=int8 cannot offload parameters to cpu",
        ),
        (
            ["memory.torch_compile=layers"],
            r"memory.torch_compile=layers is not supported with lora.quantize=nf4",
        ),
        (["memory.liger_kernels=true"], r"memory.liger_kernels=true is not supported with lora.quantize=nf4"),
        (
            ["deepspeed.pipeline_stages=2", "deepspeed.config=zero1"],
            r"lora is not supported with deepspeed.pipeline_stages=2",
        ),
    ],
)
def test_what_bitsandbytes_cannot_do_is_refused_before_anything_loads(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        resolve_run("tiny-cpu-lora", QLORA + overrides, world_size=2)


def test_sequence_parallel_is_refused() -> None:
    overrides = QLORA + ["deepspeed.sequence_parallel=2", "data.packing=padded"]
    with pytest.raises(
        UserError, match=r"lora.quantize=nf4 is not supported with deepspeed.sequence_parallel=2"
    ):
        resolve_run("tiny-cpu-lora", overrides, world_size=2)


def test_the_optimizer_may_go_to_the_cpu() -> None:
    run = resolve_run("tiny-cpu-lora", QLORA + ["deepspeed.config=zero3_offload_optimizer"], world_size=2)
    assert run.layout.offload_optimizer == "cpu" and run.layout.offload_params == "none"


def test_nf4_weights_may_go_to_the_cpu_under_zero3() -> None:
    # ZeRO-3 partitions the packed storage and offloads the partitions like any weight; the quantisation
    # state goes to the GPU whole (runtime/model/quantized_base.py): the 70B two-card recipe's layout.
    run = resolve_run("tiny-cpu-lora", QLORA + ["deepspeed.config=zero3_offload"], world_size=2)
    assert run.layout.offload_params == "cpu" and run.layout.zero_stage == 3


def test_missing_bitsandbytes_is_one_line_that_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(
        UserError, match=r"lora.quantize=nf4 needs bitsandbytes.*pip install 'llm_train\[qlora\]'"
    ):
        check_bitsandbytes(LoraSection(quantize="nf4"))
    check_bitsandbytes(LoraSection())  # 16-bit LoRA needs no bitsandbytes


def test_config_is_nf4_double_quant_with_storage_equal_to_compute() -> None:
    config = quantization_config(LoraSection(quantize="nf4"), torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_quant_storage == torch.bfloat16
    assert quantization_config(LoraSection(quantize="int8"), torch.bfloat16).load_in_8bit


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("qbase") / "tiny", seed=5)


def _qlora(base: Path, dtype: torch.dtype, quantize: str = "nf4") -> torch.nn.Module:
    from llm_train.config.recipe_sections import MemorySection, ModelSection
    from llm_train.runtime.model.model import build_model

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    lora = LoraSection(rank=4, alpha=8, dropout=0.0, quantize=quantize)  # type: ignore[arg-type]
    model = build_model(ModelSection(name_or_path=str(base)), MemorySection(), precision, seed=1, lora=lora)
    with torch.no_grad():  # B starts at zero: give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model.eval()


def test_nf4_mfu_equals_the_16bit_mfu_at_equal_step_time(tiny_base: Path) -> None:
    # A Params4bit holds a fraction of its weights' elements (bf16 storage: a quarter; fp32: an eighth): MFU
    # counts its logical shape, so the same model at the same step time has the same MFU either way.
    from llm_train.observability.metrics import StepMeter, model_token_flops

    quantized = _qlora(tiny_base, torch.float32)
    sixteen = _qlora(tiny_base, torch.float32, quantize="none")
    packed = sum(p.numel() for p in quantized.parameters())
    assert packed < sum(p.numel() for p in sixteen.parameters())  # the storage really is smaller
    rows = []
    for model in (quantized, sixteen):
        meter = StepMeter(tokens_per_step=4096, flops=model_token_flops(model), seq_len=512, peak_tflops=1.0)
        meter.record(0.5)
        rows.append(meter.flush())
    assert rows[0]["mfu"] == pytest.approx(rows[1]["mfu"], rel=1e-12) and rows[0]["mfu"] > 0


def test_the_base_is_4bit_and_only_adapters_train(tiny_base: Path) -> None:
    from llm_train.runtime.model.quantized_base import is_quantized_linear

    model = _qlora(tiny_base, torch.float32)
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert len(layers) == 7 * 4  # every projection of the 4 decoder layers
    assert all(type(m.weight).__name__ == "Params4bit" and m.weight.dtype == torch.float32 for m in layers)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    embedding = model.get_base_model().model.embed_tokens.weight
    assert embedding.dtype == torch.float32 and not embedding.requires_grad  # not quantised, frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_export_gives_the_quantised_models_logits(
    tiny_base: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """The merged model (dequantised base + adapter, in the training dtype) against the 4-bit model with adapters.

    The quantised forward dequantises each weight to the compute dtype exactly as the merge does, so
    the only difference is where the adapter's product is rounded: into the merged weight (one
    rounding per element, in `dtype`) or added to the layer's output. That is the export check's
    own tolerance (export.logit_tolerance: 4 ulps of the coarser dtype times the largest logit).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_train.runtime.export.sharded import no_gather, write_merged

    model = _qlora(tiny_base, dtype)
    ids = torch.tensor([[5, 17, 99, 1000, 7, 3, 250, 11]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    write_merged(model, tmp_path, AutoTokenizer.from_pretrained(tiny_base), no_gather, dtype, write=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()
    assert merged.dtype == dtype and not hasattr(merged.config, "quantization_config")
    with torch.no_grad():
        got = merged(input_ids=ids).logits.float()
    assert (got - expected).abs().max() <= logit_tolerance(expected, dtype)
    # ...and it is not the original 16-bit model: the 4-bit rounding and the adapters are in it.
    original = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=dtype).eval()
    with torch.no_grad():
        assert (original(input_ids=ids).logits.float() - expected).abs().max() > logit_tolerance(
            expected, dtype
        )


def test_int8_base_merges_too(tiny_base: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_train.runtime.export.sharded import no_gather, write_merged

    model = _qlora(tiny_base, torch.float32, quantize="int8")
    ids = torch.tensor([[5, 17, 99, 1000]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    write_merged(
        model, tmp_path, AutoTokenizer.from_pretrained(tiny_base), no_gather, torch.float32, write=True
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits.float()
    # LLM.int8() multiplies int8 inputs by int8 weights (outliers in 16-bit); the merge dequantises the
    # weights and multiplies in fp32, so the two differ by the inputs' int8 rounding: ~1% of the scale.
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_keep_training_layout_stops_cpu_repacking_in_eval(tiny_base: Path) -> None:
    """Without it, an eval forward on an AVX512-BF16 CPU rewrites every 4-bit weight in place."""
    from bitsandbytes.functional import has_avx512bf16

    from llm_train.runtime.model.quantized_base import dequantized_weight, is_quantized_linear

    model = _qlora(tiny_base, torch.float32)
    layer = next(m for m in model.modules() if is_quantized_linear(m))
    before = dequantized_weight(layer, torch.float32).clone()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert torch.equal(dequantized_weight(layer, torch.float32), before)
    if has_avx512bf16():  # the case it guards against, where this CPU can show it
        layer.support_avx512bf16_for_cpu = True
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        assert getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


# --- the staged load: each weight quantised on the staging device (runtime/model/quantized_base.py quantizing_on) ---------


def _staged_load(base: Path, dtype: torch.dtype, staging: object | None) -> torch.nn.Module:
    """The base as a ZeRO-3 QLoRA run loads it (device_map cpu), through `quantizing_on(staging)`, or as the
    loader did before it (transformers' own quantizer, on the CPU) with `staging` None."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from llm_train.runtime.model.quantized_base import Staging, quantizing_on

    assert staging is None or isinstance(staging, Staging)
    with quantizing_on(staging) if staging is not None else contextlib.nullcontext():
        return AutoModelForCausalLM.from_pretrained(
            base,
            dtype=dtype,
            device_map={"": "cpu"},
            quantization_config=quantization_config(LoraSection(quantize="nf4"), dtype),
        )


def _state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = module.weight.quant_state
    return {
        # Packed 4-bit codes stored as floats: compared as bytes (some byte patterns read as NaN).
        "codes": module.weight.data.view(torch.uint8),
        "absmax": state.absmax,
        "code": state.code,
        "offset": state.offset,
        "nested_absmax": state.state2.absmax,
        "nested_code": state.state2.code,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_staging_gives_todays_codes_and_state_bit_for_bit(tiny_base: Path, dtype: torch.dtype) -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from llm_train.runtime.model.quantized_base import Staging, is_quantized_linear

    before, after = _staged_load(tiny_base, dtype, None), _staged_load(tiny_base, dtype, Staging("cpu"))
    today, staged = dict(before.named_modules()), dict(after.named_modules())
    assert (
        AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"] is Bnb4BitHfQuantizer
    )  # the hook is gone after the load
    layers = [name for name, m in today.items() if is_quantized_linear(m)]
    assert len(layers) == 7 * 4
    for name in layers:
        mine, theirs = _state_tensors(staged[name]), _state_tensors(today[name])
        for key, tensor in theirs.items():
            assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), (name, key)
        a, b = staged[name].weight.quant_state, today[name].weight.quant_state
        assert (a.shape, a.dtype, a.blocksize, a.quant_type) == (b.shape, b.dtype, b.blocksize, b.quant_type)
        assert staged[name].quant_state is a  # the module's own reference, which its forward reads
    # Everything not quantised loads as before too.
    mine = dict(after.named_parameters())
    rest = {n: p for n, p in before.named_parameters() if n.rpartition(".")[0] not in layers}
    assert "model.embed_tokens.weight" in rest and len(rest) == len(mine) - len(layers)
    for name, param in rest.items():
        assert param.dtype == mine[name].dtype and torch.equal(mine[name], param), name


def test_the_staged_load_calls_the_quantize_op_it_was_verified_on(tiny_base: Path) -> None:
    # The installed transformers (the tested one) passes the check, before a worker starts and at the load.
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from llm_train.runtime.model.quantized_base import Staging, check_staged_quantizer, staged_quantizer

    check_staged_quantizer(LoraSection(quantize="nf4"), zero_stage=3)
    assert issubclass(staged_quantizer(Staging("cpu")), Bnb4BitHfQuantizer)


def test_a_transformers_whose_quantize_op_differs_is_refused_in_one_line_before_the_registry_is_patched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    from llm_train.runtime.model.quantized_base import Staging, check_staged_quantizer, quantizing_on

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):  # Bnb4bitDeserialize's order
        raise AssertionError("never called")

    monkeypatch.setattr(Bnb4bitQuantize, "convert", convert)
    before = AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"]
    with pytest.raises(UserError) as refused, quantizing_on(Staging("cpu")):
        pass
    assert AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"] is before  # nothing was patched
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "lora.quantize=nf4 under ZeRO-3 loads its base through transformers' Bnb4bitQuantize.convert(input_dict, "
        f"full_layer_name, model, kwargs), but transformers {transformers.__version__} has convert(input_dict, "
        "model, full_layer_name, kwargs); install the transformers llm_train is tested with (5.24 or 5.25)"
    )
    # The first process refuses it too, and only for a base that is staged (nf4 under ZeRO-3).
    with pytest.raises(UserError, match="Bnb4bitQuantize.convert"):
        check_staged_quantizer(LoraSection(quantize="nf4"), zero_stage=3)
    check_staged_quantizer(LoraSection(quantize="nf4"), zero_stage=2)

    # Its constructor, which staged_quantizer calls by keyword too.
    monkeypatch.undo()

    def init(self, quantizer):
        raise AssertionError("never called")

    monkeypatch.setattr(Bnb4bitQuantize, "__init__", init)
    with pytest.raises(
        UserError, match=r"Bnb4bitQuantize.__init__\(hf_quantizer\), but .* has __init__\(quantizer\);"
    ):
        check_staged_quantizer(LoraSection(quantize="nf4"), zero_stage=3)


def test_the_load_stages_one_weight_at_a_time(tiny_base: Path) -> None:
    """A staging area that keeps its own copy of each weight it is given, and looks, each time it is given
    one, at how many of the earlier copies still exist: none may, so at most one 16-bit weight is ever in
    the staging area, and every quantised weight passes through it exactly once, 16-bit and whole."""
    import weakref

    from llm_train.runtime.model.quantized_base import Staging, is_quantized_linear

    class Watched(Staging):
        def __init__(self) -> None:
            super().__init__("cpu")
            self.copies: list[weakref.ref[torch.Tensor]] = []
            self.alive_before: list[int] = []
            self.shapes: list[tuple[int, ...]] = []

        def stage(self, weight: torch.Tensor) -> torch.Tensor:
            self.alive_before.append(sum(ref() is not None for ref in self.copies))
            copy = weight.clone()  # the staging area's own tensor, apart from the loader's
            self.copies.append(weakref.ref(copy))
            self.shapes.append((tuple(copy.shape), copy.dtype))
            return copy

    staging = Watched()
    model = _staged_load(tiny_base, torch.bfloat16, staging)
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert len(staging.copies) == len(layers) == 7 * 4
    assert staging.alive_before == [0] * len(layers)
    assert all(ref() is None for ref in staging.copies)  # none left behind after the last one either
    assert sorted(staging.shapes) == sorted(
        (tuple(m.weight.quant_state.shape), torch.bfloat16) for m in layers
    )
    # ...and what came back is the packed codes, on the host, a quarter of the elements in bf16 storage.
    assert all(
        m.weight.device.type == "cpu" and m.weight.numel() * 4 == m.weight.quant_state.shape.numel()
        for m in layers
    )


# --- the planner's numbers, against arithmetic written out here ---------------------------------------------


def _llama31_8b_arithmetic() -> tuple[int, int]:
    """(quantised projection weights, everything else) of Llama-3.1-8B, from its published config."""
    h, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 8 * 128
    projections = layers * (h * h + 2 * h * kv + h * h + 3 * h * inter)  # q, k, v, o, gate, up, down
    rest = 2 * vocab * h + (2 * layers + 1) * h  # embeddings + untied head, the RMSNorm weights
    return projections, rest


def test_nf4_and_int8_bases_by_hand() -> None:
    from llm_train.planning.memory.quantized_bytes import base_weight_bytes
    from llm_train.planning.model.shapes import shape_of

    shape = shape_of("meta-llama/Llama-3.1-8B")
    projections, rest = _llama31_8b_arithmetic()
    assert projections + rest == shape.num_params
    # NF4: 4-bit codes, an 8-bit absmax per 64 weights, an fp32 absmax per 256 of those.
    nf4 = projections * (0.5 + 1 / 64 + 4 / (64 * 256)) + rest * 2
    assert base_weight_bytes(shape, "nf4", 2) == pytest.approx(nf4, rel=1e-12)
    assert 5.3 * GiB < nf4 < 5.4 * GiB  # vs 14.96 GiB in bf16
    # int8: a byte per weight, an fp32 scale per output row (in_features: h, except o's q_dim and down's inter).
    h, inter, layers, kv = 4096, 14336, 32, 1024
    rows = layers * (h + kv + kv + h + inter + inter + h)
    assert base_weight_bytes(shape, "int8", 2) == pytest.approx(projections + 4 * rows + rest * 2, rel=1e-12)


def test_8b_qlora_plan_by_hand() -> None:
    """8b-qlora-rtx4070's GPU and host terms, each recomputed from its definition."""
    from llm_train.planning.memory.estimate import estimate_memory
    from llm_train.planning.memory.formulas import (
        CHECKPOINT_SHARD_BYTES,
        EXPORT_SHARD_BYTES,
        PROCESS_HOST_BYTES,
    )
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.search.candidate import memory_inputs

    run = resolve_run("8b-qlora-rtx4070", [], world_size=1)
    est = estimate_memory(memory_inputs(run, shape_of("meta-llama/Llama-3.1-8B")))
    projections, rest = _llama31_8b_arithmetic()
    r, h, inter, layers, kv = 16, 4096, 14336, 32, 1024
    adapters = layers * r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))
    nf4, state = projections * 0.5 + rest * 2, projections * (1 / 64 + 4 / (64 * 256))
    gpu = est.gpu_terms
    assert gpu["parameters"] == pytest.approx(nf4 + 2 * adapters, abs=2)  # bf16 adapters on top of the base
    assert gpu["quantization_state"] == pytest.approx(state, abs=2)  # absmax of each block, whole
    assert gpu["optimizer_states"] == pytest.approx(
        12 * adapters, abs=2
    )  # fp32 master, m, v of adapters only
    assert gpu["gradients"] == pytest.approx(2 * adapters, abs=2)
    assert gpu["dequantized_weight"] == h * inter * 2  # the largest projection (gate/up/down) in bf16
    host = est.host_terms
    assert host["model_load_peak"] == CHECKPOINT_SHARD_BYTES  # read onto the GPU, one shard at a time
    assert host["export_peak"] == EXPORT_SHARD_BYTES  # merged export: one 2 GiB shard on the host
    assert est.host_bytes == PROCESS_HOST_BYTES + CHECKPOINT_SHARD_BYTES  # the load phase is the largest
    assert est.host_bytes < 13 * GiB  # a 16 GiB desktop less the OS's 3 GiB
    assert est.gpu_bytes < 0.95 * 12282 / 1024 * GiB  # an RTX 4070, with the planner's 5% headroom


def test_16bit_lora_host_ram_by_hand() -> None:
    """8b-lora-rtx4090 with 16 GiB: no full copy of the model on the host at load, in checkpoints or at export."""
    from llm_train.planning.memory.estimate import estimate_memory
    from llm_train.planning.memory.formulas import (
        CHECKPOINT_SHARD_BYTES,
        EXPORT_SHARD_BYTES,
        PROCESS_HOST_BYTES,
    )
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.search.candidate import memory_inputs

    shape = shape_of("meta-llama/Llama-3.1-8B")
    merged = estimate_memory(memory_inputs(resolve_run("8b-lora-rtx4090", [], world_size=1), shape))
    assert merged.gpu_terms["parameters"] == pytest.approx(
        2 * shape.num_params + 2 * shape.lora_params(16), abs=2
    )
    assert merged.host_bytes == PROCESS_HOST_BYTES + max(CHECKPOINT_SHARD_BYTES, EXPORT_SHARD_BYTES)
    adapter = estimate_memory(
        memory_inputs(resolve_run("8b-lora-rtx4090", ["lora.export=adapter"], world_size=1), shape)
    )
    assert adapter.host_terms["export_peak"] == 2 * shape.lora_params(16)  # the bf16 adapters only


def test_70b_two_card_qlora_plan_by_hand() -> None:
    """70b-qlora-2x4090's terms from their definitions: the 4-bit base staged whole on each rank's host, then
    partitioned by ZeRO-3 onto the host (offload_param), its quantisation state whole on each GPU."""
    from llm_train.planning.memory.estimate import estimate_memory, model_load_gpu_bytes
    from llm_train.planning.memory.formulas import (
        CUDA_CONTEXT_BYTES,
        PROCESS_HOST_BYTES,
        QUANTIZE_RETAINED_BYTES_PER_WEIGHT,
        QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT,
    )
    from llm_train.planning.memory.model_split import model_split
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.search.candidate import memory_inputs

    run = resolve_run("70b-qlora-2x4090", [], world_size=2)
    assert run.layout.zero_stage == 3 and run.layout.offload_params == "cpu" and run.recipe.lora is not None
    shape = shape_of("meta-llama/Llama-3.1-70B")
    est = estimate_memory(memory_inputs(run, shape))
    h, inter, layers, vocab, kv = 8192, 28672, 80, 128256, 8 * 128
    projections = layers * (h * h + 2 * h * kv + h * h + 3 * h * inter)
    rest = 2 * vocab * h + (2 * layers + 1) * h
    assert projections + rest == shape.num_params
    gpu, host = est.gpu_terms, est.host_terms
    # On the GPU: none of the base (offloaded), the state of every block whole, the gathered module working set.
    assert gpu["quantization_state"] == pytest.approx(projections * (1 / 64 + 4 / (64 * 256)), abs=2)
    assert gpu["parameters"] < 0.01 * GiB  # only the norms ZeRO-3 keeps whole (persistence threshold)
    # On the host: each rank's half of the packed codes and of the 16-bit rest (bf16 storage: 4 weights per
    # element, so a packed tensor is numel/4 elements of 2 bytes), exact-size (native pinning), and the bf16
    # adapters twice (their zero.Init blocks and the optimizer's flat buffer: offload_buffers.py).
    offloaded = host["offloaded_parameters"]
    assert run.recipe.deepspeed.pinning == "native"
    adapters = 2 * 2 * shape.lora_params(16)
    # rel 1e-3: ZeRO pads each tensor's partition up to a multiple of the 2 ranks.
    assert offloaded == pytest.approx(projections * 0.5 + rest * 2 + adapters, rel=1e-3)
    # Loading, quantised on the GPU (the run's device): every rank stages the whole base less its
    # quantisation state, which stays on the GPU, plus the largest weight as read (bf16) and its codes, and
    # the loader's freed temporaries (the CPU path's measurement, planning/memory/estimate.py).
    state = projections * (1 / 64 + 4 / (64 * 256))
    codes_and_rest = projections * 0.5 + rest * 2
    retained = QUANTIZE_RETAINED_BYTES_PER_WEIGHT * projections
    assert est_quantize_on(run, shape, "gpu") == est
    assert host["model_load_peak"] == pytest.approx(2 * (codes_and_rest + h * inter * 2.5 + retained), abs=4)
    # Quantised on the CPU (bitsandbytes' CPU backend, a CPU run): the terms the CPU path was measured with,
    # unchanged: the whole staged base, the quantiser's working set for the largest weight, the same freed
    # temporaries; every other term is the GPU path's.
    on_cpu = est_quantize_on(run, shape, "cpu")
    workspace = QUANTIZE_WORKSPACE_BYTES_PER_WEIGHT * h * inter
    expected = 2 * (codes_and_rest + state + workspace + retained)
    assert on_cpu.host_terms["model_load_peak"] == pytest.approx(expected, abs=4)
    assert {k: v for k, v in on_cpu.host_terms.items() if k != "model_load_peak"} == {
        k: v for k, v in host.items() if k != "model_load_peak"
    }
    # The load is the host's largest phase (training holds the offloaded partitions, under half of it),
    # and within the recipe's host RAM less the 3 GiB the planner keeps for the OS.
    assert est.host_bytes == pytest.approx(2 * PROCESS_HOST_BYTES + host["model_load_peak"], rel=1e-6)
    assert est.host_bytes < (run.recipe.hardware.host_ram_gib - 3) * GiB
    assert est.gpu_bytes < 0.95 * 24 * GiB
    # The GPU while it loads: the state of the whole base and the largest weight being quantised (bf16, its
    # codes, two fp32 absmax per block of 64), far under training's peak, which is the card's.
    inp = memory_inputs(run, shape)
    loading = model_load_gpu_bytes(inp, model_split(inp))
    assert loading == pytest.approx(state + h * inter * (2 + 0.5 + 8 / 64) + CUDA_CONTEXT_BYTES, abs=2)
    assert loading < est.gpu_bytes / 4
    assert model_load_gpu_bytes(dataclasses.replace(inp, quantize_on="cpu"), model_split(inp)) == 0


def est_quantize_on(run: Any, shape: Any, where: str) -> Any:
    """The run's estimate with its base quantised on `where` ("gpu": the run's own device; "cpu")."""
    from llm_train.planning.memory.estimate import estimate_memory
    from llm_train.planning.search.candidate import memory_inputs

    return estimate_memory(dataclasses.replace(memory_inputs(run, shape), quantize_on=where))


def test_70b_two_card_start_up_is_the_checkpoint_read_not_the_quantiser() -> None:
    """speed.staged_load from its definition: on the GPU, each rank reads the 16-bit checkpoint and moves each
    weight to its card and the codes back; on the CPU, bitsandbytes' quantiser's measured rate bounds it."""
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.report.verdict import plan_recipe, render
    from llm_train.planning.search.candidate import memory_inputs
    from llm_train.planning.speed.step_time import (
        CPU_QUANTIZE_WEIGHTS_PER_S,
        PAGEABLE_COPY_EFFICIENCY,
        staged_load,
    )

    run = resolve_run("70b-qlora-2x4090", [], world_size=2)
    shape = shape_of("meta-llama/Llama-3.1-70B")
    inp = memory_inputs(run, shape)
    h, inter, layers, kv = 8192, 28672, 80, 8 * 128
    projections = layers * (h * h + 2 * h * kv + h * h + 3 * h * inter)
    drive, link = 6e9, 31.5e9  # the planner's default drive; PCIe 4.0 x16
    on_gpu = staged_load(inp, drive, link)
    assert on_gpu is not None and on_gpu.quantize == 0
    assert on_gpu.read == pytest.approx(2 * 2 * shape.num_params / drive)
    assert on_gpu.copies == pytest.approx(projections * 2.5 / (link * PAGEABLE_COPY_EFFICIENCY))
    assert on_gpu.total < 120  # about a minute, where bitsandbytes' CPU quantiser takes hours:
    on_cpu = staged_load(dataclasses.replace(inp, quantize_on="cpu"), drive, link)
    assert on_cpu is not None and on_cpu.quantize == pytest.approx(projections / CPU_QUANTIZE_WEIGHTS_PER_S)
    assert on_cpu.total > 2 * 3600
    assert staged_load(dataclasses.replace(inp, quantize="none", lora_rank=16), drive, link) is None
    text = render(plan_recipe("70b-qlora-2x4090", [], 2, "RTX 4090", None, 128, detect=False))
    assert f"start-up: the 4-bit base loads in ~{on_gpu.total:.0f} s, at every start and resume" in text, text


def test_the_70b_recipe_header_states_the_planners_host_ram_and_start_up() -> None:
    import re

    from llm_train.config.hardware import NVME_READ_BYTES_PER_S
    from llm_train.planning.memory.estimate import estimate_memory
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.search.candidate import memory_inputs
    from llm_train.planning.speed.step_time import staged_load

    header = " ".join(
        line.lstrip("# ").strip()
        for line in (Path(__file__).parents[2] / "recipes" / "70b-qlora-2x4090.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    run = resolve_run("70b-qlora-2x4090", [], world_size=2)
    inp = memory_inputs(run, shape_of("meta-llama/Llama-3.1-70B"))
    host = re.search(r"host RAM ~([\d.]+) GiB", header)
    assert host and float(host[1]) == round(estimate_memory(inp).host_bytes / GiB, 1), header
    load = staged_load(inp, NVME_READ_BYTES_PER_S, 31.5e9)  # an RTX 4090's PCIe 4.0 x16
    assert load is not None and 30 <= load.total < 90 and "Start-up: ~1 minute" in header
