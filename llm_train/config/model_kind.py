"""Is a checkpoint's config.json an image-text model, and where are its text model's fields?

transformers 5.25 registers 14 model types both as causal LMs and as image-text-to-text models
(gemma3, llama4, mllama, qwen3_5, ...) and 89 more only as image-text-to-text (qwen2_vl, qwen2_5_vl,
qwen3_vl, mistral3, llava, idefics3, smolvlm, paligemma, ...). An image-text config keeps its language
model's fields (vocab_size, hidden_size, num_hidden_layers, heads, ...) in `text_config`, so every read
of a text-model field goes through `text_fields` (on a built `PretrainedConfig`: `get_text_config()`).

The two mappings are read from the installed transformers' `models/auto/modeling_auto.py` as literals,
without executing it: importing that module imports torch through `configuration_utils` (~4 s on a
loaded 2-core machine), and this layer runs in the CLI before any worker exists. Reading the installed
file keeps the answer in step with whatever transformers version is installed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_IMAGE_TEXT = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
_CAUSAL_LM = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


@functools.cache
def _mappings() -> dict[str, dict[str, tuple[str, ...]]]:
    """{mapping name: {model_type: (class name, ...)}} for the two mappings, from the installed source."""
    spec = importlib.util.find_spec("transformers")
    assert spec is not None and spec.origin is not None, "transformers is a dependency of llm_train"
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    tree = ast.parse(source.read_text(), filename=str(source))
    found: dict[str, dict[str, tuple[str, ...]]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Name) and target.id in (_IMAGE_TEXT, _CAUSAL_LM)):
            continue
        # `NAME = OrderedDict([("type", "Class") or ("type", ("ClassA", "ClassB")), ...])`
        assert isinstance(node.value, ast.Call) and node.value.args, f"{source}: {target.id} changed shape"
        pairs = ast.literal_eval(node.value.args[0])
        found[target.id] = {t: (c,) if isinstance(c, str) else tuple(c) for t, c in pairs}
    assert set(found) == {_IMAGE_TEXT, _CAUSAL_LM}, f"{source}: the auto mappings were not found"
    return found


def image_text_types() -> frozenset[str]:
    """Every model_type transformers can build with AutoModelForImageTextToText."""
    return frozenset(_mappings()[_IMAGE_TEXT])


def causal_lm_types() -> frozenset[str]:
    """Every model_type transformers can build with AutoModelForCausalLM."""
    return frozenset(_mappings()[_CAUSAL_LM])


def _class_names(mapping: str) -> frozenset[str]:
    return frozenset(name for names in _mappings()[mapping].values() for name in names)


def is_image_text(config: Mapping[str, Any]) -> bool:
    """Whether a config.json dict describes an image-text model (load it with AutoModelForImageTextToText).

    The architectures the config names decide where they are known: a `llama4` config that names
    `Llama4ForCausalLM` is the text model alone, one that names `Llama4ForConditionalGeneration` (or none,
    as a recipe's `model.config` for `init=random` may) has its vision tower. Otherwise the model_type does.
    """
    model_type = config.get("model_type")
    if model_type not in _mappings()[_IMAGE_TEXT]:
        return False
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if any(a in _class_names(_IMAGE_TEXT) for a in architectures):
        return True
    # A class only the causal-LM mapping names is the text model alone; an unknown one (remote code): by type.
    return not any(a in _class_names(_CAUSAL_LM) for a in architectures)


def image_text_class(config: Mapping[str, Any]) -> str | None:
    """The class transformers' AutoModelForImageTextToText builds for this config, or None if not image-text."""
    if not is_image_text(config):
        return None
    return _mappings()[_IMAGE_TEXT][config["model_type"]][0]


def text_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's fields: the `text_config` dict where the config has one, else the config itself."""
    text = config.get("text_config")
    return dict(text) if isinstance(text, Mapping) else dict(config)


# Fields that set a text model's weight shapes or whether its output layer is the embedding: a recipe's
# `model.config` may not change them under a pretrained checkpoint (its weights would not fit the model, or a
# head the checkpoint ties would be drawn at random, as tiny-cpu's `tie_word_embeddings: false` did to Gemma 3).
SHAPE_KEYS = (
    "model_type",
    "architectures",
    "text_config",
    "vision_config",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_local_experts",
    "num_experts",
    "moe_intermediate_size",
)


def changed_shape_keys(checkpoint: Mapping[str, Any], overrides: Mapping[str, Any]) -> list[str]:
    """The keys of `overrides` (a recipe's model.config) that would change the checkpoint's shapes or tying.

    A key is compared with the checkpoint's own value, at the top level or, for a field of the text model,
    in its text config: an override that repeats the checkpoint's value changes nothing and passes.
    """
    text = text_fields(checkpoint)
    changed = []
    for key, value in overrides.items():
        if key not in SHAPE_KEYS:
            continue
        own = checkpoint[key] if key in checkpoint else text.get(key)
        if own != value:
            changed.append(key)
    return changed


def untrainable_reason(config: Mapping[str, Any]) -> str | None:
    """Why llm_train cannot train this config.json (None: it can), in words for a one-line error.

    llm_train trains a causal LM's next-token loss: the model must be one transformers builds with
    AutoModelForCausalLM or AutoModelForImageTextToText (or a remote-code model that says it is one), and
    not an encoder-decoder (T5-style image-text models such as Florence-2 or Pix2Struct score a decoder
    against an encoder's input, not the next token of one sequence).
    """
    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    remote = any(k in auto_map for k in ("AutoModelForCausalLM", "AutoModelForImageTextToText"))
    if model_type is None:
        return None if remote else "its config names no model_type"
    if config.get("is_encoder_decoder") or text_fields(config).get("is_encoder_decoder"):
        return f"model_type '{model_type}' is an encoder-decoder model; llm_train trains decoder-only LMs"
    if model_type in causal_lm_types() or model_type in image_text_types() or remote:
        return None
    return (
        f"model_type '{model_type}' is neither a causal LM nor an image-text-to-text model in transformers "
        "(AutoModelForCausalLM / AutoModelForImageTextToText)"
    )
