"""config/model_kind.py: image-text or text, read from transformers' own mappings without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llm_train.config.model_kind import (
    causal_lm_types,
    image_text_class,
    image_text_types,
    is_image_text,
    text_fields,
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
