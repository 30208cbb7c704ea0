"""Model shapes: parameter counts equal the published sizes and what transformers builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.errors import UserError
from llm_train.planning.model.shapes import (
    ModelConfigError,
    ModelShape,
    UnknownModelError,
    shape_from_config,
    shape_of,
    to_hf_config,
)
from tests.helpers import TINY_DECODER_FIELDS
from tests.optional import import_or_skip

# Parameter counts as published on the model cards / safetensors metadata.
PUBLISHED_PARAMS = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-13b-hf": 13_015_864_320,
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    # Llama-3.1-8B plus 8 added tokens in the (untied) embedding and output layer: 8.03B on the card.
    "allenai/Llama-3.1-Tulu-3-8B-SFT": 8_030_261_248 + 2 * 8 * 4096,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "Qwen/Qwen2.5-1.5B": 1_543_714_304,
    "Qwen/Qwen2.5-3B": 3_085_938_688,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "Qwen/Qwen2.5-14B": 14_770_033_664,
    "Qwen/Qwen2.5-32B": 32_763_876_352,
    "Qwen/Qwen2.5-72B": 72_706_203_648,
    # Image-text checkpoints: language model, vision tower and projector together (the hub's safetensors totals).
    "Qwen/Qwen2.5-VL-7B-Instruct": 8_292_166_656,
    "google/gemma-3-12b-it": 12_187_325_040,
    "google/gemma-3-27b-it": 27_432_406_640,
}


def test_every_known_config_has_a_published_count() -> None:
    assert set(PUBLISHED_PARAMS) == set(KNOWN_CONFIGS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_num_params_equals_published(name: str) -> None:
    assert shape_of(name).num_params == PUBLISHED_PARAMS[name]


def test_shape_details_of_a_few_models() -> None:
    llama3 = shape_of("meta-llama/Llama-3.1-8B")
    assert (llama3.head_dim, llama3.num_kv_heads, llama3.max_position_embeddings) == (128, 8, 131072)
    # The embedding / lm_head is the largest module: vocab * hidden.
    assert llama3.largest_layer_params == 128256 * 4096
    assert shape_of("meta-llama/Llama-3.2-1B").tie_word_embeddings
    assert shape_of("Qwen/Qwen2.5-0.5B").tie_word_embeddings
    assert not shape_of("Qwen/Qwen2.5-7B").tie_word_embeddings
    assert shape_of("Qwen/Qwen2.5-0.5B").head_dim == 896 // 14 == 64


def test_llama2_7b_by_hand() -> None:
    h, i, v, n_layers = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    assert shape_of("meta-llama/Llama-2-7b-hf").num_params == 2 * v * h + n_layers * per_layer + h


def test_known_configs_build_in_transformers_with_the_same_count() -> None:
    """The known dicts are valid HF configs, and HF allocates exactly num_params (meta device: no memory)."""
    import torch
    import transformers

    for name in ("meta-llama/Llama-3.2-1B", "mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-0.5B"):
        config = transformers.AutoConfig.for_model(**to_hf_config(name))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name], name


TINY_CASES = {
    "llama-untied": {"model_type": "llama", "tie_word_embeddings": False},
    "llama-tied-bias": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "llama-head-dim": {"model_type": "llama", "head_dim": 24, "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_tiny_models_match_transformers_and_deepspeed(case: str) -> None:
    """num_params and largest_layer_params against real modules and DeepSpeed's own walker."""
    import transformers
    from deepspeed.runtime.zero import stage3

    cfg = {**TINY_DECODER_FIELDS, **TINY_CASES[case]}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    shape = shape_from_config(cfg)
    total, largest = stage3.model_to_params(model)  # de-duplicates a tied lm_head
    assert shape.num_params == total == sum(p.numel() for p in model.parameters())
    assert shape.largest_layer_params == largest
    small = sum(p.numel() for p in model.parameters() if p.numel() < 640)
    assert shape.small_tensor_params(640) == small


def test_lora_params_match_peft() -> None:
    peft = import_or_skip("peft")
    import transformers

    cfg = {"model_type": "qwen2", **TINY_DECODER_FIELDS}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert shape_from_config(cfg).lora_params(8) == trainable


def test_local_directory_wins_over_known_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "meta-llama" / "Llama-2-7b-hf"
    local.mkdir(parents=True)
    cfg = {**KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"], "num_hidden_layers": 2, "hidden_size": 256}
    (local / "config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    assert shape_of("meta-llama/Llama-2-7b-hf").num_layers == 2
    assert shape_of(str(local)).hidden_size == 256
    assert to_hf_config(str(local))["num_hidden_layers"] == 2


def test_to_hf_config_returns_a_copy() -> None:
    cfg = to_hf_config("meta-llama/Llama-3.1-8B")
    cfg["rope_scaling"]["factor"] = 1.0
    cfg["hidden_size"] = 1
    assert KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]["rope_scaling"]["factor"] == 8.0
    assert KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]["hidden_size"] == 4096


def test_unknown_id_lists_known_ids_and_suggests_a_directory() -> None:
    with pytest.raises(KeyError) as info:
        shape_of("acme/NotAModel-7B")
    message = str(info.value)
    assert isinstance(info.value, UnknownModelError) and isinstance(info.value, UserError)
    assert message.startswith("unknown model 'acme/NotAModel-7B'")  # no KeyError quoting
    assert "config.json" in message and "meta-llama/Llama-3.1-8B" in message and "Qwen/Qwen2.5-72B" in message


def test_directory_without_config_json_says_so(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="has no config.json"):
        shape_of(str(tmp_path))


def test_missing_key_is_named() -> None:
    cfg = dict(KNOWN_CONFIGS["mistralai/Mistral-7B-v0.1"])
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="'intermediate_size'"):
        shape_from_config(cfg)


def test_missing_key_in_local_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelConfigError, match=r"config\.json: model config is missing required key"):
        shape_of(str(tmp_path))


def test_bad_json_and_unsupported_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        shape_of(str(tmp_path))
    cfg = {**KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B"], "model_type": "gpt2"}
    with pytest.raises(
        ValueError, match="model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"
    ):
        shape_from_config(cfg)


def test_kv_heads_default_to_heads() -> None:
    cfg = {k: v for k, v in KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"].items() if k != "num_key_value_heads"}
    assert shape_from_config(cfg) == shape_of("meta-llama/Llama-2-7b-hf")
    assert isinstance(shape_from_config(cfg), ModelShape)
