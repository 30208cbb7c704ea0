"""An image-text model's parts, what model.freeze and LoRA do with them, and what resolution refuses for it.

The tiny families of tests/image_text_models.py, built from their configs (no weights read): every family's
vision tower, projector and language model are found by runtime/model/parts.py's table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train.config.recipe_sections import FREEZE_DEFAULT, ModelSection
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from llm_train.runtime.model.lora import apply_lora
from llm_train.runtime.model.parts import QUANTIZATION_KEEP, freeze, linear_paths, part_of, parts
from tests.devices import CPU
from tests.helpers import REPO
from tests.image_text_models import family_configs
from tests.optional import import_or_skip

TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"


def tiny(model_type: str):  # -> PreTrainedModel
    from transformers import AutoConfig, AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(model_type, **family_configs()[model_type])
    )


@pytest.mark.parametrize("model_type", sorted(family_configs()))
def test_every_family_has_its_three_parts_and_the_default_freeze_trains_the_language_model(
    model_type: str,
) -> None:
    model = tiny(model_type)
    found = parts(model)
    assert sorted(found) == ["language_model", "projector", "vision_tower"]
    freeze(model, FREEZE_DEFAULT)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == found["language_model"]
    assert (
        model.get_input_embeddings().weight.requires_grad
        and model.get_output_embeddings().weight.requires_grad
    )


def test_lora_adapts_the_language_model_alone() -> None:
    from llm_train.config.recipe_sections import LoraSection

    model = tiny("gemma3")  # SigLIP's attention is q_proj/k_proj/v_proj too: the names alone would adapt it
    lora = LoraSection(target_modules=["q_proj", "v_proj"])
    wrapped = apply_lora(model, lora, exclude=linear_paths(model, ["vision_tower", "projector"]))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert adapted and all(part_of(f"{n}.weight") == "language_model" for n in adapted)
    assert any("vision_tower" in n for n, _ in model.named_modules() if n.endswith("q_proj"))


def test_qlora_keeps_vision_tower_and_projector_in_16_bits() -> None:
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = tiny("qwen2_5_vl")  # its projector (merger) sits inside its vision tower (visual)
    linear = [n for n, m in model.named_modules() if type(m).__name__ == "Linear"]
    quantised = {n for n in linear if should_convert_module(n, [*QUANTIZATION_KEEP, "lm_head"])}
    assert quantised == {n for n in linear if part_of(f"{n}.weight") == "language_model" and n != "lm_head"}


def test_a_freeze_naming_a_part_the_model_lacks_is_one_line() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    text_only = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
        )
    )
    with pytest.raises(
        UserError, match=r"^model.freeze: LlamaForCausalLM has no vision_tower .*leave vision_tower out"
    ):
        freeze(text_only, ["vision_tower"])


def test_freezing_every_part_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing would train"):
        ModelSection(
            name_or_path="google/gemma-3-4b-it",
            freeze=["vision_tower", "projector", "language_model"],
        )


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("gemma3")
    config = AutoConfig.for_model("gemma3", **family_configs()["gemma3"])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(out)
    return out


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(UserError) as caught:
        resolve_run("tiny-cpu", overrides, world_size=2, device=CPU)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_tiny_cpus_llama_fields_over_a_checkpoint_are_refused_not_merged(gemma3_dir: Path) -> None:
    message = _refusal(["model.init=pretrained", f"model.name_or_path={gemma3_dir}"])
    assert message.startswith(
        f"model.config.model_type=llama would change checkpoint {gemma3_dir}'s model_type"
    )
    run = resolve_run(
        "tiny-cpu",
        ["model.init=pretrained", f"model.name_or_path={gemma3_dir}", "model.config={}"],
        world_size=2,
        device=CPU,
    )
    assert run.hidden_size == 32  # the text model's, read through text_config
    assert (
        json.loads((gemma3_dir / "config.json").read_text())["model_type"] == run.model_fields["model_type"]
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["deepspeed.sequence_parallel=2"],
        ["deepspeed.pipeline_stages=2", "deepspeed.config=zero1"],
        ["deepspeed.config=zero1_tp"],
    ],
)
def test_parallel_layouts_other_than_zero_are_refused_for_image_text(
    gemma3_dir: Path, overrides: list[str]
) -> None:
    message = _refusal(
        ["model.init=pretrained", f"model.name_or_path={gemma3_dir}", "model.config={}", *overrides]
    )
    assert "is an image-text model" in message and "use deepspeed.config=zero3" in message


def test_a_type_llm_train_cannot_train_is_named_before_any_worker(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]}))
    message = _refusal(["model.init=pretrained", f"model.name_or_path={tmp_path}", "model.config={}"])
    assert "model_type 'clip' is neither a causal LM nor an image-text-to-text model" in message


def test_a_4bit_load_quantises_the_language_model_alone(tmp_path: Path) -> None:
    """The real bitsandbytes load (its CPU path): Linear4bit in the language model, plain Linear elsewhere."""
    import_or_skip("bitsandbytes")
    import torch
    from transformers import AutoModelForImageTextToText

    from llm_train.config.recipe_sections import LoraSection
    from llm_train.runtime.model.quantized_base import quantization_config
    from tests.image_text_models import build_checkpoint

    source = build_checkpoint("qwen2_5_vl", tmp_path / "qwen2_5_vl", TOKENIZER)
    config = quantization_config(LoraSection(quantize="nf4"), torch.bfloat16, keep=QUANTIZATION_KEEP)
    model = AutoModelForImageTextToText.from_pretrained(
        source, quantization_config=config, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    kinds: dict[tuple[str, str], int] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in ("Linear", "Linear4bit"):
            key = (part_of(f"{name}.weight"), type(module).__name__)
            kinds[key] = kinds.get(key, 0) + 1
    # 7 projections of the one decoder layer in 4 bits; the head, the merger's 2 and the tower's 5 in 16.
    assert kinds == {
        ("language_model", "Linear4bit"): 7,
        ("language_model", "Linear"): 1,
        ("projector", "Linear"): 2,
        ("vision_tower", "Linear"): 5,
    }


def test_init_random_builds_the_image_text_class_with_its_parts_frozen() -> None:
    from llm_train.config.recipe_sections import MemorySection
    from llm_train.runtime.model.model import build_model

    fields = {"model_type": "qwen2_5_vl", **family_configs()["qwen2_5_vl"]}
    section = ModelSection(init="random", config=fields, tokenizer=str(TOKENIZER))
    model = build_model(section, MemorySection(attention="sdpa"), "fp32", 7)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"  # AutoModelForCausalLM refuses it
    trainable = {part_of(n) for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"language_model"}
    assert model.config.get_text_config().hidden_size == 32


def test_a_pretrained_llama4_keeps_its_vision_tower(tmp_path: Path) -> None:
    from llm_train.config.recipe_sections import MemorySection
    from llm_train.runtime.model.model import build_model
    from tests.image_text_models import build_checkpoint

    source = build_checkpoint("llama4", tmp_path / "llama4", TOKENIZER)
    model = build_model(ModelSection(name_or_path=str(source)), MemorySection(attention="sdpa"), "fp32", 7)
    # AutoModelForCausalLM builds Llama4ForCausalLM from this config and drops the vision tower.
    assert type(model).__name__ == "Llama4ForConditionalGeneration"
    assert set(parts(model)) == {"vision_tower", "projector", "language_model"}


@pytest.mark.parametrize("original_format", [True, False])
def test_the_keys_check_takes_gemma3_in_the_hub_layout_and_in_memory_and_names_a_missing_tensor(
    original_format: bool, tmp_path: Path
) -> None:
    """The issue's failure: a Gemma 3 directory that transformers loads whole was refused by the keys-only
    check. Saved as the hub has it (`language_model.model.*`) or under the in-memory names, it passes; with a
    tensor dropped it fails in one line."""
    from safetensors.torch import load_file, save_file

    from llm_train.errors import ExportError
    from llm_train.runtime.export.verify import check_keys, saved_shapes

    model = tiny("gemma3")
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(tmp_path, save_original_format=original_format)
    names = set(saved_shapes(tmp_path))
    assert any(
        n.startswith("language_model.model." if original_format else "model.language_model.") for n in names
    )
    check_keys(tmp_path, saved_shapes(tmp_path))

    weights = load_file(str(tmp_path / "model.safetensors"))
    dropped = next(n for n in weights if "layers.0.mlp.up_proj" in n)
    del weights[dropped]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"1 tensors missing, e.g. \S*layers\.0\.mlp\.up_proj\.weight"):
        check_keys(tmp_path, saved_shapes(tmp_path))
