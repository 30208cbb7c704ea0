"""Build the tokenizer and the Hugging Face causal LM a recipe names (or, for a reward model, that LM's
family with a one-output sequence-classification head instead of its LM head).

This module knows nothing of DeepSpeed. Under ZeRO-3 the caller registers an
`HfDeepSpeedConfig` first; transformers then creates the weights inside `zero.Init`
(partitioned as they are made), so no rank ever holds the full model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llm_train.config.attention_kernel import choose_attention
from llm_train.config.hardware import Device
from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.config.model_kind import is_image_text
from llm_train.config.recipe_sections import LoraSection, MemorySection, ModelSection
from llm_train.errors import UserError, first_line
from llm_train.planning.model.shapes import to_hf_config
from llm_train.runtime.loss.chunked import enable_tiled_loss
from llm_train.runtime.model.document_attention import NAME as SDPA_FLEX
from llm_train.runtime.model.document_attention import register_sdpa_flex
from llm_train.runtime.model.lora import apply_lora
from llm_train.runtime.model.parts import QUANTIZATION_KEEP, freeze, linear_paths
from llm_train.runtime.model.quantized_base import keep_training_layout, quantization_config, quantized
from llm_train.runtime.model.tiling import enable_checkpoint_offload, enable_tiled_mlp

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from llm_train.config.resolution import Resolved

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# "lm": the causal LM; "score": a reward model, AutoModelForSequenceClassification with num_labels=1 (one score
# per row, read at its last non-pad token, so the config must name the pad id the data pads with).
Head = Literal["lm", "score"]


def load_tokenizer(model: ModelSection) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    source = model.tokenizer or model.name_or_path
    assert source is not None  # the recipe validator guarantees one of them
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except OSError as exc:
        raise UserError(f"model.tokenizer: cannot load tokenizer '{source}' ({first_line(exc)})") from None
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; the eos token is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(model: ModelSection) -> PretrainedConfig:
    """The HF config of the model to build: from name_or_path (local dir, hub, or the offline table) + overrides."""
    from transformers import AutoConfig

    if model.name_or_path:
        local = Path(model.name_or_path)
        if local.is_dir() or not _known_offline(model.name_or_path):
            try:
                config = AutoConfig.from_pretrained(
                    model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code
                )
            except OSError as exc:
                raise UserError(
                    f"model.name_or_path: cannot load config of '{model.name_or_path}' ({first_line(exc)})"
                ) from None
        else:
            known = dict(to_hf_config(model.name_or_path))
            config = AutoConfig.for_model(known.pop("model_type"), **known)
        for key, value in model.config.items():
            setattr(config, key, value)
        return config
    fields = dict(model.config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def model_class(config: PretrainedConfig, head: Head = "lm") -> Any:
    """The transformers Auto class that builds this config whole.

    An image-text checkpoint (config/model_kind.py) loads through AutoModelForImageTextToText, which builds
    the class its config names: AutoModelForCausalLM refuses most of them ("Unrecognized configuration
    class") and builds llama4's text model alone, dropping the vision tower (transformers 5.25).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    if head == "score":
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if is_image_text(config.to_dict()) else AutoModelForCausalLM


def _known_offline(name: str) -> bool:
    return name in KNOWN_CONFIGS


def loss_tokens(run: Resolved) -> int:
    """The most tokens one forward of a run scores on a rank: micro-batch rows x data.seq_len / sp."""
    recipe, layout = run.recipe, run.layout
    return layout.micro_batch_size * recipe.sequences_per_sample * recipe.data.seq_len // layout.sp


def build_model(
    model: ModelSection,
    memory: MemorySection,
    precision: str,
    seed: int,
    lora: LoraSection | None = None,
    device: str | None = None,
    loss_tokens: int | None = None,
    head: Head = "lm",
    pad_token_id: int | None = None,
) -> torch.nn.Module:
    """The causal LM, ready for training: weights loaded or randomly initialised, checkpointing set.

    `head="score"`: the same family with a one-output score head (a reward model; `pad_token_id` is required,
    as the head finds each row's last token by it). A pretrained causal LM's body loads into it, and the head,
    which the checkpoint lacks, is drawn from the seed.

    `loss_tokens`: the most tokens one forward scores (micro-batch rows x data.seq_len / sp), which
    sets memory.tiled_loss's chunk count on every rank alike (runtime/loss/chunked.py).

    `device` (e.g. "cuda:0"): pretrained weights are read from the checkpoint straight onto it,
    one tensor at a time, so the host never holds the whole model (transformers' device_map), and
    random weights are drawn there; the caller leaves it None where weights are created
    partitioned instead, under ZeRO-3's zero.Init.
    With `lora.quantize` the base layers are quantised by bitsandbytes as they load (quantized_base.py).
    """
    import torch

    # The ALST loss tiling and LoRA's causal-LM task both assume the LM head; recipe.py refuses them for a
    # reward model, so reaching here with them is a bug, not a user error.
    assert head == "lm" or (pad_token_id is not None and not memory.tiled_loss and lora is None)
    config = model_config(model)
    auto = model_class(config, head)
    image_text = is_image_text(config.to_dict())
    scored: dict[str, Any] = {} if head == "lm" else {"num_labels": 1, "pad_token_id": pad_token_id}
    dtype = getattr(torch, _DTYPES[precision])
    if memory.attention == "auto":
        # A resolved run never gets here with "auto" (config/resolution.py picks the kernel for its layout);
        # a caller that builds a model on its own (tests, tools) gets what auto picks for one process here
        # (the head size assumed, as for a model not known offline).
        memory = memory.model_copy(update={"attention": choose_attention("auto", Device.detect()).kernel})
    if memory.attention == SDPA_FLEX:
        register_sdpa_flex()  # transformers looks the kernel up by name while building the model
    import_part_modules(config)
    if model.init == "pretrained":
        assert model.name_or_path is not None
        placement: dict[str, Any] = {"device_map": {"": device}} if device else {}
        if quantized(lora):
            assert lora is not None
            # Quantised one tensor at a time as it loads, never a full 16-bit copy, onto `device` (the
            # host, for a base ZeRO-3 partitions: quantized_base.py) or, without one, the current CUDA device.
            # An image-text model's vision tower and projector stay 16-bit, as the peers keep them (parts.py).
            placement["quantization_config"] = quantization_config(
                lora, dtype, keep=QUANTIZATION_KEEP if image_text else ()
            )
        if scored:
            torch.manual_seed(seed)  # the new score head's weights
        try:
            lm = auto.from_pretrained(
                model.name_or_path,
                revision=model.revision,
                trust_remote_code=model.trust_remote_code,
                dtype=dtype,
                attn_implementation=memory.attention,
                **placement,
                **({"config": _with_fields(config, scored)} if model.config else scored),
            )
        except OSError as exc:
            raise UserError(
                f"model.name_or_path: cannot load '{model.name_or_path}' ({first_line(exc)})"
            ) from None
    else:
        # Same seed, same initial weights on every rank and in every parity run (on one kind of device:
        # a GPU draws other numbers than the CPU from the same seed).
        torch.manual_seed(seed)
        for key, value in scored.items():
            setattr(config, key, value)
        # Drawn where they train: on the CPU a 1B shape took ~50 s per launch on the first H200 run
        # (bench/results/gpu_check-h200-20261130-1904.log: set-up 64.8 s under ZeRO-2, 13.0 s under
        # ZeRO-3, whose zero.Init builds on the GPU), on the GPU about a second; DeepSpeed would move
        # them there anyway.
        with torch.device(device) if device else contextlib.nullcontext():
            lm = auto.from_config(
                config,
                dtype=dtype,
                attn_implementation=memory.attention,
                trust_remote_code=model.trust_remote_code,
            )
    if scored:
        # Checkpoints save the config alone (checkpointing/run_state.py), which leaves architectures unset;
        # `llm-train export` builds from it and must know this is a sequence classifier, not the causal LM.
        lm.config.architectures = [type(lm).__name__]
    if quantized(lora):
        keep_training_layout(lm)
    if image_text:
        # requires_grad False: no gradient, no optimizer state, so weight decay cannot move them either, and
        # the export holds them bit for bit as loaded. A text-only model has no such parts: model.freeze is
        # ignored for it.
        freeze(lm, model.freeze)
    if memory.activation_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and ZeRO-3 partitioned params.
        # transformers 5.25 renamed the switch activation_checkpointing_enable (the old name warns and goes
        # in v6); older releases inside pyproject's window (the GPU image's 5.17) have only the old one.
        if hasattr(lm, "activation_checkpointing_enable"):
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.config.use_cache = False
    # The ALST switches patch this instance; LoRA then wraps it (its adapters land inside the
    # patched MLPs, whose tiles look their submodules up at call time).
    if memory.tiled_mlp:
        enable_tiled_mlp(lm)
    if memory.tiled_loss:
        enable_tiled_loss(lm, max_tokens=loss_tokens, liger=memory.liger_kernels)
    if memory.offload_checkpoints:
        enable_checkpoint_offload(lm, pin_memory=torch.cuda.is_available())
    if lora is not None:
        # PEFT draws the adapters' A matrices from torch's global RNG: seeded here, a pretrained base
        # gets the same adapters in every run, like a random one gets the same weights.
        torch.manual_seed(seed)
        # Adapters go where training goes: not into the frozen parts (by default the language model alone).
        return apply_lora(lm, lora, exclude=linear_paths(lm, model.freeze) if image_text else ())
    return lm


def _with_fields(config: PretrainedConfig, scored: dict[str, Any]) -> PretrainedConfig:
    for key, value in scored.items():
        setattr(config, key, value)
    return config


def import_part_modules(config: PretrainedConfig) -> None:
    """Import the modeling module of every part of `config` (an image-text model's language model and vision
    tower) before transformers builds the model.

    Under ZeRO-3 transformers builds inside DeepSpeed's zero.Init, which wraps the `__init__` of every
    nn.Module class created while it is active (its `__init_subclass__` hook) and, at exit, puts back the
    `__init__` it saw at class creation. transformers' kernel decorator (`use_kernelized_func`, on
    LlamaAttention and others) replaces `__init__` and `forward` just after the class is created, so a
    modeling module first imported inside zero.Init ends with the decorator's forward and the plain
    `__init__`: the forward then raises "'LlamaAttention' object has no attribute '_kernel_funcs'". An
    image-text model imports its language model's module there (LLaVA's LlamaModel is built by
    AutoModel.from_config inside LlavaModel.__init__); `python llm_train/train.py --recipe tiny-cpu-vlm`
    failed so at its export check. Importing first creates every class outside the context.
    """
    from transformers import MODEL_MAPPING, PretrainedConfig

    for name in getattr(config, "sub_configs", None) or {}:
        part = getattr(config, name, None)
        if isinstance(part, PretrainedConfig):
            with contextlib.suppress(KeyError, ValueError):  # a part with no model class of its own
                MODEL_MAPPING[type(part)]  # the lazy mapping imports the part's modeling module
            import_part_modules(part)
