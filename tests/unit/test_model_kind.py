"""config/model_kind.py: image-text or text, read from transformers' own mappings without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llm_train.config.model_kind import (
    causal_lm_types,
    changed_shape_keys,
    image_text_class,
    image_text_types,
    is_image_text,
    text_fields,
    untrainable_reason,
)


def test_the_mappings_match_transformers_own() -> None:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    assert image_text_types() == set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    assert causal_lm_types() == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for model_type, name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        expected = name if isinstance(name, str) else name[0]
        assert image_text_class({"model_type": model_type}) == expected


def test_reading_them_imports_no_torch() -> None:
    code = (
        "import sys; from llm_train.config.model_kind import is_image_text; "
        "assert is_image_text({'model_type': 'qwen2_5_vl'}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, False),
        ({"model_type": "gemma3_text"}, False),  # Gemma 3 1B: the text model alone
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, True),
        ({"model_type": "gemma3"}, True),  # a recipe's model.config for init=random names no class
        ({"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]}, True),
        ({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}, True),
        ({"model_type": "llama4", "architectures": ["Llama4ForCausalLM"]}, False),  # text half of llama4
        ({"model_type": "mllama", "architectures": ["MllamaForCausalLM"]}, False),
        ({"model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"]}, True),  # remote code: by type
        ({}, False),
    ],
)
def test_is_image_text(config: dict, expected: bool) -> None:
    assert is_image_text(config) is expected


def test_text_fields_are_the_text_config_where_there_is_one() -> None:
    vlm = {
        "model_type": "qwen2_5_vl",
        "text_config": {"hidden_size": 64, "vocab_size": 300},
        "vision_config": {},
    }
    assert text_fields(vlm) == {"hidden_size": 64, "vocab_size": 300}
    llama = {"model_type": "llama", "hidden_size": 32}
    assert text_fields(llama) == llama
    text_fields(vlm)["hidden_size"] = 1  # a copy: the caller's dict is never changed through it
    assert vlm["text_config"]["hidden_size"] == 64


def test_a_recipe_may_not_reshape_or_untie_a_checkpoint() -> None:
    gemma3 = {
        "model_type": "gemma3",
        "tie_word_embeddings": True,
        "text_config": {"hidden_size": 64, "vocab_size": 300},
    }
    # tiny-cpu's Llama fields over a Gemma 3 checkpoint: the type, a text field and the tying all change.
    assert changed_shape_keys(
        gemma3, {"model_type": "llama", "hidden_size": 128, "tie_word_embeddings": False}
    ) == [
        "model_type",
        "hidden_size",
        "tie_word_embeddings",
    ]
    # The checkpoint's own values, and fields that do not shape the weights, pass.
    assert changed_shape_keys(gemma3, {"hidden_size": 64, "attention_dropout": 0.1, "use_cache": False}) == []


@pytest.mark.parametrize(
    ("config", "trainable"),
    [
        ({"model_type": "llama"}, True),
        ({"model_type": "paligemma"}, True),
        (
            {"model_type": "clip"},
            False,
        ),  # an image-text encoder pair: no causal-LM or image-text-to-text class
        ({"model_type": "florence2", "is_encoder_decoder": True}, False),
        ({"model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "modeling_my_lm.MyLM"}}, True),
    ],
)
def test_what_llm_train_cannot_train_is_named(config: dict, trainable: bool) -> None:
    reason = untrainable_reason(config)
    assert (reason is None) is trainable
    if reason is not None:
        assert config["model_type"] in reason
