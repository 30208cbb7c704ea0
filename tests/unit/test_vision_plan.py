"""The planner's image-text models: parameter counts against tiny real models, image tokens against the
processors, and the estimate's vision terms (planning/model/vision_shapes.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.model_split import model_split
from llm_train.planning.model.shapes import ModelConfigError, shape_from_config, shape_of
from llm_train.planning.model.vision_shapes import (
    LANGUAGE_MODEL,
    PROJECTOR,
    VISION_TOWER,
    ImageGeometry,
    VisionInputs,
    processor_pixels,
)
from tests.optional import import_or_skip

GEMMA3: dict[str, Any] = {
    "model_type": "gemma3",
    "architectures": ["Gemma3ForConditionalGeneration"],
    "mm_tokens_per_image": 4,
    "image_token_index": 299,
    "boi_token_index": 297,
    "eoi_token_index": 298,
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 256,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
QWEN25_VL: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "image_token_id": 299,
    "video_token_id": 298,
    "vision_start_token_id": 297,
    "vision_end_token_id": 296,
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "fullatt_block_indexes": [1],
        "window_size": 56,
    },
}
ASSETS = Path(__file__).resolve().parents[2] / "llm_train" / "assets" / "tiny_vlm"


def _tiny_cpu_vlm_config() -> dict[str, Any]:
    """tiny-cpu-vlm's model.config (LLaVA: CLIP tower, projector, Llama), as the recipe gives it."""
    import yaml

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu-vlm.yaml"
    if recipe.is_file():
        return dict(yaml.safe_load(recipe.read_text())["model"]["config"])
    return {  # the same fields, until the recipe is on this branch
        "model_type": "llava",
        "image_token_id": 4096,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 56,
            "patch_size": 14,
        },
        "text_config": {
            "model_type": "llama",
            "vocab_size": 4097,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
    }


LLAVA = _tiny_cpu_vlm_config()
# Where each model keeps model.freeze's parts (transformers 5.25's module names).
PARTS = {
    "gemma3": {VISION_TOWER: "model.vision_tower.", PROJECTOR: "model.multi_modal_projector."},
    "qwen2_5_vl": {VISION_TOWER: "model.visual.", PROJECTOR: "model.visual.merger."},
    "llava": {VISION_TOWER: "model.vision_tower.", PROJECTOR: "model.multi_modal_projector."},
}


def _model(cfg: dict[str, Any]) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    return transformers.AutoModelForImageTextToText.from_config(config)


def _part_of(family: str, name: str) -> str:
    parts = PARTS[family]
    if name.startswith(parts[PROJECTOR]):  # Qwen's merger sits inside its vision module
        return PROJECTOR
    if name.startswith(parts[VISION_TOWER]):
        return VISION_TOWER
    return LANGUAGE_MODEL


@pytest.mark.parametrize("cfg", [GEMMA3, QWEN25_VL, LLAVA], ids=["gemma3", "qwen2_5_vl", "llava"])
def test_parameter_counts_equal_a_tiny_models_numel_part_by_part(cfg: dict[str, Any], tmp_path: Path) -> None:
    model = _model(cfg)
    model.config.save_pretrained(
        tmp_path
    )  # the config.json transformers writes, as a local checkpoint has it
    shape = shape_of(str(tmp_path))
    assert shape == shape_from_config(cfg)
    assert shape.vision is not None
    family = shape.vision.family
    numel = {VISION_TOWER: 0, PROJECTOR: 0, LANGUAGE_MODEL: 0}
    for name, param in model.named_parameters():  # named_parameters lists a tied head once
        numel[_part_of(family, name)] += param.numel()
    assert shape.num_params == sum(numel.values())
    assert (shape.vision.tower_params, shape.vision.projector_params) == (
        numel[VISION_TOWER],
        numel[PROJECTOR],
    )
    assert shape.language_model_params == numel[LANGUAGE_MODEL]
    # What a full fine-tune trains under each model.freeze: the estimate's trainable elements equal the
    # numel of the parameters outside the frozen parts.
    for freeze in [(VISION_TOWER, PROJECTOR), (VISION_TOWER,), (), (LANGUAGE_MODEL,)]:
        inp = MemoryInputs.of(shape, world_size=1, vision=VisionInputs(freeze=freeze))
        trained = sum(n for part, n in numel.items() if part not in freeze)
        assert model_split(inp).trainable == trained, freeze
        assert model_split(inp).base == shape.num_params  # frozen parts keep their weights


@pytest.mark.parametrize(
    "cfg",
    [
        {**GEMMA3, "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1}},
        {k: v for k, v in GEMMA3.items() if k != "mm_tokens_per_image"},
        {**QWEN25_VL, "vision_config": {"depth": 1, "out_hidden_size": 64}},
        {k: v for k, v in LLAVA.items() if k != "vision_config"},
    ],
    ids=["gemma3-siglip-defaults", "gemma3-tokens-default", "qwen2_5_vl-defaults", "llava-default-tower"],
)
def test_a_partial_config_is_sized_with_transformers_defaults(cfg: dict[str, Any]) -> None:
    """The hub's config.json files leave keys to the config classes' defaults: the planner fills the same ones
    (counted on the meta device: no memory, the default towers are full-size)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**cfg))
    shape = shape_from_config(cfg)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.vision is not None and shape.language_model_params < shape.num_params


def test_qlora_leaves_the_vision_part_in_16_bits_and_lora_targets_the_language_model() -> None:
    from llm_train.planning.memory.quantized_bytes import base_weight_bytes, quantized_weight_params

    shape = shape_from_config(QWEN25_VL)
    text = shape_from_config({**QWEN25_VL["text_config"], "model_type": "qwen2"})
    assert quantized_weight_params(shape) == quantized_weight_params(text)
    vision = shape.vision
    assert vision is not None
    assert base_weight_bytes(shape, "nf4", 2) == base_weight_bytes(text, "nf4", 2) + 2 * vision.num_params
    assert shape.lora_params(8) == text.lora_params(8)


def _png(path: Path, width: int, height: int) -> Path:
    from PIL import Image

    Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(path)
    return path


# Sizes around every branch of smart_resize: too small (enlarged to min_pixels), in range (rounded to 28),
# too large (shrunk within max_pixels), extreme aspect ratios.
IMAGE_SIZES = [(20, 20), (28, 28), (100, 60), (333, 517), (640, 480), (1024, 768), (1500, 300), (90, 900)]


# (data.image_min_pixels, data.image_max_pixels, the processor's min_pixels, max_pixels): the run's bounds
# first (data/formats/images.py), then the processor's own; every branch of both.
QWEN_LIMITS = [
    (None, None, 4 * 28 * 28, 256 * 28 * 28),
    (None, 120_000, 3136, 1_003_520),
    (20_000, 60_000, 3136, 12_845_056),
]


@pytest.mark.parametrize("limits", QWEN_LIMITS, ids=["processor", "run-max", "run-min-max"])
def test_qwen_image_tokens_equal_the_processors_on_real_images(
    limits: tuple[int | None, int | None, int, int], tmp_path: Path
) -> None:
    """Each image goes the run's way (ImageSizing, then Qwen2VLImageProcessor with the checkpoint's own
    limits): the planner's patches and tokens per image equal the processor's grid, and never exceed the
    planner's bound for the largest image."""
    import transformers
    from PIL import Image

    from llm_train.data.formats.images import ImageSizing

    bound_min, bound_max, low, high = limits
    processor = transformers.Qwen2VLImageProcessor(
        min_pixels=low, max_pixels=high, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    sizing = ImageSizing(max_pixels=bound_max, min_pixels=bound_min)
    shape = shape_from_config(QWEN25_VL)
    assert shape.vision is not None
    inputs = VisionInputs(
        min_pixels=bound_min, max_pixels=bound_max, processor_min_pixels=low, processor_max_pixels=high
    )
    geometry = inputs.geometry(shape.vision)
    for width, height in IMAGE_SIZES:
        image = sizing.apply(Image.open(_png(tmp_path / f"{width}x{height}.png", width, height)))
        t, h, w = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert t == 1
        assert geometry.patches(height, width) == h * w, (width, height)
        assert geometry.tokens(height, width) == h * w // 4, (width, height)
        assert geometry.tokens(height, width) <= geometry.max_tokens
    # The bound is the largest over every aspect the processor accepts: reached by some image at the bound.
    largest = geometry.largest_pixels
    assert largest is not None
    reached = max(geometry.tokens(h, largest // h) for h in range(1, largest + 1) if largest // h >= 1
                  and max(h, largest // h) <= 200 * min(h, largest // h))  # fmt: skip
    assert reached == geometry.max_tokens


def test_gemma3_image_tokens_equal_the_models_own_count(tmp_path: Path) -> None:
    """Gemma 3 resizes every image to image_size and pools the tower's patches to mm_tokens_per_image: the
    image features the model puts into the sequence, counted on real images through its processor."""
    import torch
    import transformers
    from PIL import Image

    model = _model(GEMMA3).eval()
    processor = transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    shape = shape_from_config(GEMMA3)
    assert shape.vision is not None
    geometry = shape.vision.geometry
    for width, height in IMAGE_SIZES[:4]:
        image = Image.open(_png(tmp_path / f"{width}x{height}.png", width, height))
        pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
        assert tuple(pixels.shape[-2:]) == geometry.resized(height, width)
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=pixels)
        tokens = getattr(features, "pooler_output", features)
        assert tokens.shape[-2] == geometry.tokens(height, width) == 4
    assert geometry.max_patches == (56 // 14) ** 2


def test_image_tokens_equal_the_bundled_processors_on_the_bundled_images() -> None:
    """tiny-cpu-vlm's processor (LLaVA: CLIP resize and centre crop to 56 px) on every bundled drawing: the image
    tokens it puts into input_ids are the planner's count; and the Qwen-VL processor's on the same files."""
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(ASSETS / "processor")
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    llava = shape_from_config(LLAVA).vision
    qwen = shape_from_config(QWEN25_VL).vision
    assert llava is not None and qwen is not None
    qwen_processor = transformers.Qwen2VLImageProcessor(min_pixels=3136, max_pixels=1003520)
    files = sorted((ASSETS / "images").glob("*.png"))
    assert len(files) >= 12
    for path in files:
        image = Image.open(path).convert("RGB")
        ids = processor(text=[f"{processor.image_token} what is this?"], images=[image], return_tensors="pt")
        count = int((ids["input_ids"] == image_id).sum())
        assert count == llava.geometry.tokens(image.height, image.width) == 16, path.name
        t, h, w = qwen_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert qwen.geometry.tokens(image.height, image.width) == t * h * w // 4, path.name


def test_known_checkpoints_image_tokens() -> None:
    qwen = shape_of("Qwen/Qwen2.5-VL-7B-Instruct").vision
    gemma = shape_of("google/gemma-3-12b-it").vision
    assert qwen is not None and gemma is not None
    # Qwen2.5-VL: one token per 28 x 28 pixels, bounded by max_pixels (the class's 1280 x 28^2 by default).
    assert qwen.geometry.max_tokens == 1280
    # data.image_max_pixels = 512 x 28 x 28 before the processor: a square image at the bound is 633 x 633 and
    # rounds to 644 x 644 (529 tokens); a long thin one rounds further (the bound, over every accepted aspect).
    bounded = VisionInputs(max_pixels=512 * 28 * 28).geometry(qwen)
    assert (bounded.square_tokens, bounded.max_tokens) == (529, 638)
    # Gemma 3: 256 tokens per image whatever its size, 4096 SigLIP patches at 896 x 896; the knobs change nothing.
    assert (gemma.geometry.max_tokens, gemma.geometry.max_patches) == (256, 4096)
    assert VisionInputs(max_pixels=10_000).geometry(gemma) == gemma.geometry


def test_processor_pixels_reads_both_spellings() -> None:
    assert processor_pixels({"min_pixels": 3136, "max_pixels": 12845056}) == (3136, 12845056)
    assert processor_pixels({"size": {"shortest_edge": 3136, "longest_edge": 1003520}}) == (3136, 1003520)
    assert processor_pixels({"size": {"height": 896, "width": 896}}) == (None, None)


def test_vision_activations_frozen_against_trained() -> None:
    shape = shape_of("Qwen/Qwen2.5-VL-7B-Instruct")
    vision = shape.vision
    assert vision is not None
    images = VisionInputs(images_per_sample=1, max_pixels=512 * 28 * 28)
    base = MemoryInputs.of(
        shape, world_size=1, seq_len=2048, lora_rank=16, activation_checkpointing=True, vision=images
    )
    frozen = estimate_memory(base).gpu_terms["vision_activations"]
    patches = 638 * 4
    # A frozen tower keeps nothing for backward: one layer's working set.
    assert frozen == vision.layer_activation_bytes(patches) == patches * (18 * 1280 + 2 * 4 * 3420)
    trained = estimate_memory(
        dataclasses.replace(base, vision=dataclasses.replace(images, freeze=(PROJECTOR,)))
    ).gpu_terms["vision_activations"]
    assert trained == vision.num_layers * 2 * patches * 1280 + frozen  # checkpointed: inputs + one layer
    # Text rows on an image-text checkpoint: no vision term; a text model: the same terms as before.
    assert (
        "vision_activations"
        not in estimate_memory(dataclasses.replace(base, vision=VisionInputs())).gpu_terms
    )


def test_a_trained_vision_tower_adds_its_gradients_and_optimizer_states() -> None:
    shape = shape_of("google/gemma-3-12b-it")
    vision = shape.vision
    assert vision is not None
    frozen = MemoryInputs.of(shape, world_size=8, zero_stage=3)
    trained = dataclasses.replace(frozen, vision=VisionInputs(freeze=()))
    assert model_split(trained).trainable - model_split(frozen).trainable == vision.num_params
    a, b = estimate_memory(frozen).gpu_terms, estimate_memory(trained).gpu_terms
    # ZeRO-3 over 8: 16-bit gradients and 12 bytes of fp32 optimizer state per trained parameter, partitioned.
    assert b["gradients"] - a["gradients"] == pytest.approx(vision.num_params * 2 / 8, rel=1e-9)
    assert b["optimizer_states"] - a["optimizer_states"] == pytest.approx(
        vision.num_params * 12 / 8, rel=1e-9
    )
    assert b["parameters"] == a["parameters"]


def test_an_image_text_type_the_planner_cannot_size_is_one_line() -> None:
    cfg = {
        "model_type": "paligemma",
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "text_config": {},
    }
    with pytest.raises(
        ModelConfigError, match="model_type 'paligemma' is an image-text model the planner cannot size"
    ):
        shape_from_config(cfg)


def test_geometry_fixed_size_ignores_the_input() -> None:
    fixed = ImageGeometry(patch_size=14, fixed_size=896, fixed_tokens=256)
    assert fixed.resized(10, 5000) == (896, 896) and fixed.tokens(10, 5000) == 256


def test_plan_of_an_image_text_recipe_names_the_vision_part_and_the_image_tokens() -> None:
    from llm_train.planning.report.verdict import plan_recipe

    report = plan_recipe("8b-vlm-lora-rtx4090", [], detect=False)
    rows = dict(report.evaluation.estimate.table())
    assert rows["GPU vision tower activations"] == "0.24 GiB"
    (note,) = [n for n in report.notes if n.startswith("image-text (Qwen2.5-VL)")]
    assert "vision tower 0.63B + projector 44.6M parameters" in note
    assert "frozen by model.freeze: vision_tower, projector" in note
    assert (
        "up to 638 per image (one per 28 x 28 pixels within data.image_max_pixels 401408; 529 for a square"
        in note
    )
    # Without image rows the vision part is loaded but not run: no activation term, and the note says so.
    text = plan_recipe(
        "8b-vlm-lora-rtx4090", ["data.train=[{path: /data/x.jsonl, format: chat}]"], detect=False
    )
    assert "GPU vision tower activations" not in dict(text.evaluation.estimate.table())
    assert any("no image rows in data.train" in n for n in text.notes)


def test_recipe_auto_plans_an_image_text_model_and_writes_what_it_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train import cli

    path = tmp_path / "vlm.yaml"
    images = ["data.train=[{path: /data/vqa.jsonl, format: image_chat}]", "data.packing=padded"]
    argv = ["plan", "--recipe", "auto", "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--gpu", "RTX 4090"]
    assert (
        cli.main([*argv, "--host-ram", "32", "--write", str(path), *images, "data.image_max_pixels=200704"])
        == 0
    )
    auto_out = capsys.readouterr().out
    vision = next(line for line in auto_out.splitlines() if line.startswith("vision:"))
    assert (
        "up to 342 per image (one per 28 x 28 pixels within data.image_max_pixels 200704; 256 for a square"
        in vision
    )
    assert cli.main(["plan", "--recipe", str(path), "--gpu", "RTX 4090", "--host-ram", "32"]) == 0
    plan_out = capsys.readouterr().out
    assert vision.removeprefix("vision:").strip() in plan_out  # the written recipe plans the same vision part
    needs = next(line for line in auto_out.splitlines() if line.startswith("needs:")).removeprefix("needs:")
    assert f"verdict: {needs.strip()}" in plan_out


def test_the_speed_model_counts_the_language_model_per_token_and_the_vision_part_per_image() -> None:
    from llm_train.planning.speed.flops import training_flops_per_token
    from llm_train.planning.speed.step_time import flops_per_token

    shape = shape_of("Qwen/Qwen2.5-VL-7B-Instruct")
    vision = shape.vision
    assert vision is not None
    text_rows = MemoryInputs.of(shape, world_size=1, seq_len=2048, lora_rank=16)
    language = training_flops_per_token(
        shape.lora_params(16),
        shape.num_layers,
        shape.num_heads,
        shape.head_dim,
        2048,
        frozen=shape.language_model_params,
    )
    assert flops_per_token(text_rows) == pytest.approx(language)
    images = dataclasses.replace(
        text_rows, vision=VisionInputs(images_per_sample=1, max_pixels=512 * 28 * 28)
    )
    # The frozen tower and projector: one forward (2 FLOPs per weight) over 2552 patches and 638 tokens a row.
    per_row = 2 * vision.tower_params * 2552 + 2 * vision.projector_params * 638
    assert flops_per_token(images) == pytest.approx(language + per_row / 2048)


@pytest.mark.parametrize("cfg", [GEMMA3, QWEN25_VL, LLAVA], ids=["gemma3", "qwen2_5_vl", "llava"])
def test_lora_trains_what_the_run_trains_under_each_freeze(cfg: dict[str, Any]) -> None:
    """The run's own freeze and adapters (runtime/model/parts.py, runtime/model/lora.py) on a tiny model: the
    estimate's trainable elements under LoRA equal the parameters left with requires_grad, for each
    model.freeze: the adapters go on the target-named linears of every part not frozen, the base trains nowhere."""
    import_or_skip("peft")
    from llm_train.config.recipe_sections import LoraSection
    from llm_train.runtime.model.lora import apply_lora
    from llm_train.runtime.model.parts import freeze, linear_paths

    shape = shape_from_config(cfg)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for frozen in [(VISION_TOWER, PROJECTOR), (PROJECTOR,), (LANGUAGE_MODEL,)]:
        model = _model(cfg)
        freeze(model, frozen)
        lora = LoraSection(rank=4, target_modules=list(targets))
        peft_model = apply_lora(model, lora, exclude=linear_paths(model, frozen))
        trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        inp = MemoryInputs.of(
            shape, world_size=1, lora_rank=4, lora_targets=targets, vision=VisionInputs(frozen)
        )
        assert model_split(inp).trainable == trained, (cfg["model_type"], frozen)
