"""Every decoder family whose quirks llm_train knows, one row each by config.json's `model_type`.

The one table the places that treat families differently read, torch-free so that config/ (the pipeline refusal)
and planning/ (the parameter count) ask it before anything loads:

    model_type   pipeline stages (HF prefix)  attention bias              MLP bias   extra norms        sliding window
    llama        Llama                        config's attention_bias     config's   -                  per layer_types
    mistral      Mistral                      none                        none       -                  every layer
    qwen2        Qwen2                        q, k, v always; o never     none       -                  per layer_types
    gemma3_text  - (refused)                  config's attention_bias     none       q/k, feed-forward  -

Who reads which column: runtime/engines/pipeline_model.py cuts a model into pipeline layers from the classes
`{pipeline}DecoderLayer`, `{pipeline}RotaryEmbedding` and `{pipeline}RMSNorm` of
`transformers.models.<model_type>.modeling_<model_type>`, and asks `window_every_layer`; config/parallel.py refuses
`deepspeed.pipeline_stages > 1` for a family without `pipeline`; planning/model/shapes.py sizes every family here (and
refuses the others in one line), with each row's biases and norms, and maps `text_aliases` (the names an image-text
checkpoint gives its language model) to the family. tests/unit/test_model_families.py fails while a family is
spelled out anywhere else, a row's pipeline classes are missing from transformers, or the planner's count of a row
differs from the model transformers builds (docs/development.md, "Adding a model family's quirk").

What is not here: liger-kernel's patches come from liger's own table (runtime/model/fast.py asks it), and an
image-text checkpoint's vision tower is sized by planning/model/vision_shapes.py's families.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    # The HF class-name prefix pipeline_model.py builds stages from (LlamaDecoderLayer, ...); None: pipeline
    # parallelism is refused for the family (config/parallel.py).
    pipeline: str | None
    # Where config.json's `attention_bias` applies: q, k, v and o ("config", Llama's flag), q, k and v always and
    # o never ("qkv": Qwen2 ignores the flag, hard-coded in transformers), or nowhere ("none").
    attention_bias: Literal["config", "qkv", "none"]
    mlp_bias: bool = False  # config.json's `mlp_bias` puts a bias on the MLP's projections (Llama)
    # Gemma 3's decoder layer: an RMSNorm of head_dim on queries and keys, two more RMSNorms around the MLP.
    qk_norm: bool = False
    feedforward_norms: bool = False
    # `sliding_window` windows every layer (Mistral); otherwise the layers `layer_types` marks sliding_attention.
    window_every_layer: bool = False
    # Other model_type names of this family's language model inside an image-text checkpoint, or of the checkpoint
    # itself when its text config names none (planning/model/shapes.py sizes the language model as this family).
    text_aliases: tuple[str, ...] = ()
    # The planner's values for keys the family's hub config.json files may leave out (its config class's defaults).
    config_defaults: Mapping[str, Any] = field(default_factory=dict)


MODEL_FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("llama", "Llama", "config", mlp_bias=True),
        ModelFamily("mistral", "Mistral", "none", window_every_layer=True),
        # Qwen2.5-VL's language model is Qwen2's decoder (transformers' Qwen2_5_VLTextModel) under its own names:
        # the hub's flat config.json says "qwen2_5_vl" at the top, transformers 5 writes a nested "qwen2_5_vl_text".
        ModelFamily("qwen2", "Qwen2", "qkv", text_aliases=("qwen2_5_vl", "qwen2_5_vl_text")),
        ModelFamily(
            "gemma3_text",
            None,
            "config",
            qk_norm=True,
            feedforward_norms=True,
            # A Gemma 3 image-text config whose text_config names no model_type (or names "gemma3").
            text_aliases=("gemma3",),
            # Gemma3TextConfig's defaults (transformers 5.25 models/gemma3/configuration_gemma3.py) for the keys the
            # hub's Gemma 3 config.json files leave out (google/gemma-3-12b-it names neither vocab_size nor head_dim).
            config_defaults={
                "vocab_size": 262_208,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "max_position_embeddings": 131_072,
                "tie_word_embeddings": True,
            },
        ),
    )
}

# The families the pipeline engine can cut into stages, in the table's order (config/parallel.py names them).
PIPELINE_MODEL_TYPES = tuple(name for name, family in MODEL_FAMILIES.items() if family.pipeline)
# Each image-text language model's type name -> its family (planning/model/shapes.py).
TEXT_ALIASES = {alias: name for name, family in MODEL_FAMILIES.items() for alias in family.text_aliases}
