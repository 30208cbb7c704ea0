"""The recipe: a strict, typed description of *what* is trained.

A recipe is one YAML file in `recipes/` (or any path). It is loaded, overridden with
`key.sub=value` arguments that use the recipe's own names, and validated here; nothing
downstream ever sees an unknown key or a missing value read as None. *How* the run is
distributed lives in the DeepSpeed JSON the recipe names (see ds_json.py).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llm_train import RECIPES_DIR
from llm_train.config.credentials import is_secret_key
from llm_train.errors import UserError


class Section(BaseModel):
    # extra="forbid": a misspelled key is an error, not a silently ignored default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class HardwareSection(Section):
    """The hardware the recipe is written for; `--dry-run` assumes it when no --world-size is given."""

    device: Literal["cuda", "cpu"] = Field("cuda", description="Accelerator type the recipe targets.")
    nodes: int = Field(1, ge=1, description="Number of machines.")
    processes_per_node: int = Field(1, ge=1, description="Processes per machine (GPUs per node on CUDA).")
    gpu_name: str | None = Field(None, description="GPU model the recipe was sized for, e.g. 'A100-80GB'.")
    gpu_mem_gib: float | None = Field(None, gt=0, description="GPU memory per device the recipe needs, GiB.")
    host_ram_gib: float | None = Field(None, gt=0, description="Host RAM per node the recipe needs, GiB.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


class ModelSection(Section):
    """Which causal LM is trained and how it is created."""

    name_or_path: str | None = Field(
        None, description="Hugging Face hub id or local directory of a causal LM (from_pretrained)."
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="'pretrained' loads weights; 'random' builds the architecture only."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="HF config fields; for init=random with no name_or_path it must hold model_type.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or directory; defaults to name_or_path.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = Field(
        False, description="Run model code from the hub; off unless you trust it."
    )

    @model_validator(mode="after")
    def _no_credentials(self) -> ModelSection:

        for key in self.config:
            if is_secret_key(key):
                # model.config is copied into the exported config.json and the run's recipe.yaml.
                raise ValueError(
                    f"model.config.{key} looks like a credential; recipes are saved with every run, "
                    "so pass secrets through the environment (HF_TOKEN, WANDB_API_KEY) instead"
                )
        return self

    @model_validator(mode="after")
    def _source_is_known(self) -> ModelSection:
        if self.init == "pretrained" and not self.name_or_path:
            raise ValueError("model.init=pretrained needs model.name_or_path (a hub id or a local directory)")
        if self.init == "random" and not self.name_or_path and "model_type" not in self.config:
            raise ValueError("model.init=random needs model.name_or_path or model.config.model_type")
        if not self.tokenizer and not self.name_or_path:
            raise ValueError("model.tokenizer is required when model.name_or_path is not set")
        return self


Overlong = Literal["truncate", "drop", "error", "split"]


class _SourceFields(Section):
    """Fields every data source has; the format-specific classes below add their own."""

    path: str = Field(
        description="A file, a glob, a folder (save_to_disk output or data files) or a hub dataset id."
    )
    weight: float = Field(
        1.0,
        description="Passes over this source per epoch: 1 = each sample once, 2 = twice, "
        "0.5 = a different half each epoch. Must be > 0.",
    )
    split: str = Field("train", description="Split to read from a hub dataset or a save_to_disk DatasetDict.")
    subset: str | None = Field(None, description="Hub dataset configuration name (load_dataset's `name`).")
    revision: str | None = Field(
        None,
        description="Hub dataset revision to read (branch, tag or commit sha; default: the default branch). "
        "The commit read is recorded in checkpoints; a resume that resolves to another one is refused.",
    )
    streaming: bool = Field(
        False,
        description="Read through datasets' streaming mode and tokenise + pack on the fly (corpora too large to "
        "tokenise up front); train sources only, all or none of them; needs optim.max_steps.",
    )

    @model_validator(mode="after")
    def _weight_is_positive(self) -> _SourceFields:
        if not self.weight > 0:
            raise ValueError(
                f"weight must be > 0 (got {self.weight}); remove the source instead of weighting it 0"
            )
        return self


class TextSource(_SourceFields):
    """Raw text for (continued) pre-training: every token is trained on."""

    format: Literal["text"] = "text"
    text_field: str | None = Field(None, description="Field with the text; default data.text_field.")
    sample_by: Literal["paragraph", "line", "document"] = Field(
        "paragraph", description="How .txt files split into samples."
    )
    overlong: Overlong = Field(
        "split",
        description="Samples longer than seq_len: split into seq_len pieces, truncate, drop or error.",
    )


class InstructionSource(_SourceFields):
    """Prompt/response rows (alpaca-style by default); loss only on the response."""

    format: Literal["instruction"] = "instruction"
    prompt_field: str = Field("instruction", description="Field with the instruction / prompt.")
    input_field: str | None = Field(
        "input", description="Optional field appended to the prompt when present and non-empty."
    )
    response_field: str = Field("output", description="Field with the response (trained on).")
    prompt_template: str = Field(
        "### Instruction:\n{prompt}\n\n### Response:\n",
        description="Wraps the prompt; '{prompt}' is replaced by the instruction (+ blank line + input).",
    )
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )

    @model_validator(mode="after")
    def _template_has_prompt(self) -> InstructionSource:
        _check_prompt_template(self.prompt_template)
        return self


# The roles a conversation's messages may have once mapped (what chat templates are written for), and
# `tool_call`: an assistant message whose content is a function call (JSON {name, arguments}).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython")
TOOL_CALL = "tool_call"
# What each named shape sets; a source's own keys override these, its `roles` extend the preset's.
# ShareGPT as axolotl and LLaMA-Factory read it (`conversations: [{from: human|gpt|system, value}]`,
# LLaMA-Factory's function_call / observation turns for tools, a `system` column).
CHAT_PRESETS: dict[str, dict[str, Any]] = {
    "openai": {"messages_field": "messages", "role_field": "role", "content_field": "content", "roles": {}},
    "sharegpt": {
        "messages_field": "conversations",
        "role_field": "from",
        "content_field": "value",
        "system_field": "system",
        "roles": {
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "system": "system",
            "function_call": TOOL_CALL,
            "observation": "tool",
            "tool": "tool",
        },
    },
}


class ChatSource(_SourceFields):
    """Conversations rendered with the chat template; loss only on assistant turns.

    OpenAI-style `messages: [{role, content}]` by default; other shapes through the field names and a
    mapping of role values (`preset: sharegpt` sets them for ShareGPT). Tool messages (role `tool`,
    `tool_calls`) pass through to the template.
    """

    format: Literal["chat"] = "chat"
    preset: Literal["openai", "sharegpt"] = Field(
        "openai",
        description="A named shape: 'openai' (messages[].role/content) or 'sharegpt' (conversations[].from/value, "
        "human->user, gpt->assistant, system->system, function_call->tool call, observation->tool, a 'system' "
        "column). The keys below override it.",
    )
    messages_field: str = Field(
        "messages", description="Field with the list of messages (default: the preset's)."
    )
    role_field: str = Field("role", description="Key of a message's role (default: the preset's).")
    content_field: str = Field("content", description="Key of a message's text (default: the preset's).")
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="Role values -> system, user, assistant, tool, developer, ipython or tool_call (an assistant "
        "function call, content JSON {name, arguments}); added to the preset's, e.g. {bot: assistant}.",
    )
    system_field: str | None = Field(
        None,
        description="Field with a system prompt put before the conversation when non-empty (sharegpt: system).",
    )
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults(cls, data: Any) -> Any:
        """The preset's values for the keys the source leaves out; its roles under the source's own."""
        if not isinstance(data, dict):
            return data
        preset = CHAT_PRESETS.get(data.get("preset", "openai"))
        if preset is None:
            return data  # the Literal check names the valid presets
        data = dict(data)
        for key, value in preset.items():
            if key == "roles":
                data["roles"] = {**value, **(data.get("roles") or {})}
            else:
                data.setdefault(key, value)
        return data

    @field_validator("roles")
    @classmethod
    def _roles_are_known(cls, roles: dict[str, str]) -> dict[str, str]:
        for value, role in roles.items():
            if role not in (*CHAT_ROLES, TOOL_CALL):
                raise ValueError(
                    f"roles.{value}: '{role}' is not a role chat templates know; map it to one of "
                    f"{', '.join((*CHAT_ROLES, TOOL_CALL))}"
                )
        return roles


class TokenizedSource(_SourceFields):
    """Rows that already hold token ids (and optionally labels, -100 where not trained on)."""

    format: Literal["tokenized"] = "tokenized"
    input_ids_field: str = Field("input_ids", description="Field with the token ids.")
    labels_field: str = Field(
        "labels", description="Field with labels, used when present; else all tokens train."
    )
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )


class PreferenceSource(_SourceFields):
    """Preference pairs: a prompt with a chosen and a rejected response (objective dpo or simpo).

    Each of the three fields holds text or a list of {role, content} messages. Message lists
    are rendered with the chat template; when `chosen` and `rejected` are whole conversations
    (HuggingFaceH4/ultrafeedback_binarized's train_prefs), the prompt is what they share before
    their last (assistant) message. Both sequences start with the same prompt tokens; the loss
    mask covers the response only.
    """

    format: Literal["preference"] = "preference"
    prompt_field: str = Field(
        "prompt",
        description="Field with the prompt (text or messages); not needed when chosen/rejected are "
        "conversations that contain it.",
    )
    chosen_field: str = Field("chosen", description="Field with the preferred response (text or messages).")
    rejected_field: str = Field(
        "rejected", description="Field with the dispreferred response (text or messages)."
    )
    prompt_template: str = Field(
        "{prompt}",
        description="Wraps a text prompt ('{prompt}' is replaced by it); message prompts use the chat template.",
    )
    overlong: Literal["truncate", "drop", "error"] = Field(
        "truncate",
        description="Pairs whose prompt + longer response exceed seq_len: truncate (the prompt loses its "
        "beginning first, down to half of seq_len, then the responses their ends), drop or error.",
    )

    @model_validator(mode="after")
    def _template_has_prompt(self) -> PreferenceSource:
        _check_prompt_template(self.prompt_template)
        return self


def _check_prompt_template(template: str) -> None:
    import string

    names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if names != {"prompt"}:
        raise ValueError(
            f"prompt_template must contain '{{prompt}}' and no other {{fields}} (found {sorted(names)}); "
            "write literal braces as {{ and }}"
        )


class PromptSource(_SourceFields):
    """Prompts for online RL (objective grpo): the model writes the completions, rewards score them.

    The prompt is text (wrapped in `prompt_template`) or a list of {role, content} messages, rendered with
    the chat template and its generation prompt. Every other field of the row (e.g. `answer`) is handed to
    the reward functions by name.
    """

    format: Literal["prompt"] = "prompt"
    prompt_field: str = Field("prompt", description="Field with the prompt (text or messages).")
    prompt_template: str = Field(
        "{prompt}",
        description="Wraps a text prompt ('{prompt}' is replaced by it); message prompts use the chat template.",
    )
    overlong: Literal["drop", "error"] = Field(
        "drop",
        description="Prompts longer than data.seq_len - grpo.max_completion_length tokens: drop them, or error.",
    )

    @model_validator(mode="after")
    def _template_has_prompt(self) -> PromptSource:
        _check_prompt_template(self.prompt_template)
        return self


Source = TextSource | InstructionSource | ChatSource | TokenizedSource | PreferenceSource | PromptSource
SOURCE_CLASSES: dict[str, type[Section]] = {
    "text": TextSource,
    "instruction": InstructionSource,
    "chat": ChatSource,
    "tokenized": TokenizedSource,
    "preference": PreferenceSource,
    "prompt": PromptSource,
}


def _parse_source(item: Any, where: str) -> Any:
    """One entry of data.train / data.eval: a path string stays a string; a mapping becomes its format's class.

    Done by hand (not by a pydantic union) so that a mistake names `data.train[1].key` and the keys valid
    for that format, in one line.
    """
    if isinstance(item, (str, *SOURCE_CLASSES.values())):
        return item
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a path or a mapping with 'path' and 'format' (got {item!r})")
    fmt = item.get("format", "text")
    cls = SOURCE_CLASSES.get(fmt) if isinstance(fmt, str) else None
    if cls is None:
        raise ValueError(f"{where}.format: unknown format {fmt!r}; use one of {', '.join(SOURCE_CLASSES)}")
    return _validate_entry(cls, item, where, f"format {fmt}")


def _validate_entry(cls: type[Section], item: dict[str, Any], where: str, what: str) -> Section:
    """`item` as `cls` (one entry of a list of tagged mappings: a data source, a reward), or one line naming
    `where`'s key: an unknown key with the valid ones ("did you mean"), or the first invalid value."""
    valid = sorted(cls.model_fields)
    for key in item:
        if key not in cls.model_fields:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"{where}: unknown key '{key}' for {what}; {hint}valid keys: {', '.join(valid)}")
    try:
        return cls.model_validate(item)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if loc and not isinstance(err.get("input"), dict) else ""
        raise ValueError(f"{where}{'.' + loc if loc else ''}: {message}{got}") from None


class DataSection(Section):
    """Where the training data comes from and how it becomes packed sequences (see llm_train/data/)."""

    train: list[
        str | TextSource | InstructionSource | ChatSource | TokenizedSource | PreferenceSource | PromptSource
    ] = Field(
        min_length=1,
        description="Sources: paths/globs of text (.txt, .jsonl/.json/.parquet/.csv with data.text_field), or "
        "mappings {path, format: text|instruction|chat|tokenized|preference|prompt, weight, ...}.",
    )
    eval: list[
        str | TextSource | InstructionSource | ChatSource | TokenizedSource | PreferenceSource | PromptSource
    ] = Field(
        default_factory=list,
        description="Held-out sources (same forms as train); empty = carve eval_fraction.",
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=0.5, description="Share of each train source's samples held out for eval."
    )
    text_field: str = Field("text", description="Field that holds the text in rows of text sources.")
    seq_len: int = Field(1024, ge=8, description="Tokens per training sequence (packed or padded).")
    packing: Literal["packed", "padded"] = Field(
        "packed",
        description="'packed': several samples per sequence, position ids restart per sample and no "
        "attention crosses samples; 'padded': one sample per sequence, padded.",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (or a path to a .jinja file) for chat sources; default the tokenizer's.",
    )
    cache_dir: str = Field(
        "~/.cache/llm_train/data",
        description="Where tokenised and packed data are cached (keyed by content).",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        description="Processes for tokenisation; default: one per 16 MB of source, up to the CPU count (capped at 8).",
    )
    loader_workers: int | None = Field(
        None,
        ge=0,
        description="DataLoader worker processes; default 2 on CUDA (pinned memory), 0 on CPU and "
        "0 with the optimizer offloaded (forked workers would copy its host-RAM state).",
    )
    tokenize_memo: bool = Field(
        True,
        description="Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2) tokenise word by word through a memo "
        "(data/tokenize_memo.py): the tokenizer's exact ids for less CPU (bench/data.py's tokenise lines); "
        "false: every text through the tokenizer itself.",
    )
    max_epochs: float = Field(
        3.0,
        gt=0,
        description="Refuse a run whose optim.max_steps (or optim.epochs) means more passes than this over "
        "the training data; a guard against a large run on a small corpus.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sources(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("train", "eval"):
                items = values.get(key)
                if isinstance(items, (str, dict)):
                    items = [items]
                if isinstance(items, list):
                    values = {
                        **values,
                        key: [_parse_source(v, f"data.{key}[{i}]") for i, v in enumerate(items)],
                    }
        return values

    @model_validator(mode="after")
    def _streaming_is_all_or_none(self) -> DataSection:
        # A stream has no length: it cannot share an epoch with counted sources or have eval carved from it.
        flags = [not isinstance(s, str) and s.streaming for s in self.train]
        if any(flags) and not all(flags):
            raise ValueError(
                f"data.train[{flags.index(False)}] is not streamed while data.train[{flags.index(True)}] is; "
                "set streaming: true on every data.train source or on none"
            )
        for i, source in enumerate(self.eval):
            if not isinstance(source, str) and source.streaming:
                raise ValueError(
                    f"data.eval[{i}].streaming=true: eval sets are read whole; remove streaming from data.eval"
                )
        if any(flags) and not self.eval and self.eval_fraction > 0:
            raise ValueError(
                "data.train is streamed, so data.eval_fraction cannot be carved from it; give data.eval sources "
                "or set data.eval_fraction=0"
            )
        return self

    def sources(self, split: Literal["train", "eval"]) -> list[Source]:
        """The sources of one split, path strings turned into text sources that read data.text_field."""
        items = self.train if split == "train" else self.eval
        out: list[Source] = []
        for item in items:
            if isinstance(item, str):
                item = TextSource(path=item)
            if isinstance(item, TextSource) and item.text_field is None:
                item = item.model_copy(update={"text_field": self.text_field})
            out.append(item)
        return out


class OptimSection(Section):
    """Optimiser, schedule and batch arithmetic."""

    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine/linear).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables.")
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Sequences per process per forward pass (preference pairs, two sequences each, under "
        "objective dpo or simpo).",
    )
    grad_accum: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; derived from global_batch_size if unset."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences (preference pairs under objective dpo or simpo) per optimizer step over all "
        "data-parallel ranks.",
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to train.")
    epochs: float | None = Field(
        None, gt=0, description="Passes over the training data (if max_steps unset)."
    )
    seed: int = Field(42, description="Seed for model init, data order and dropout.")
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw",
        description="The optimizer: torch's AdamW (fp32 moments), or bitsandbytes' AdamW8bit / PagedAdamW8bit "
        "(8-bit blockwise moments: 2 instead of 8 bytes per trained parameter; paged: they move to host RAM "
        "when the GPU runs short, CUDA only). 8-bit needs the optimizer on the GPU (no offload_optimizer) "
        "and ZeRO 0-2; pip install 'llm_train[qlora]'.",
    )
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Master weights, gradients and Adam states: fp32, or bf16 to halve their host RAM "
        "(DeepSpeed bf16_master_weights_and_grads + bf16_optimizer_states; needs precision bf16 and "
        "optimizer CPU offload).",
    )

    @model_validator(mode="after")
    def _length_is_known(self) -> OptimSection:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set optim.max_steps or optim.epochs")
        return self


class MemorySection(Section):
    """Memory techniques that trade compute for memory."""

    activation_checkpointing: bool = Field(False, description="Recompute layer activations in backward.")
    attention: Literal["auto", "sdpa", "sdpa_flex", "flex_attention", "flash_attention_2", "eager"] = Field(
        "auto",
        description="Attention kernel. 'auto': the fastest exact one installed that is known to train on the card "
        "(flash_attention_2, else sdpa_flex where flex_attention's backward fits the GPU's shared memory at the "
        "model's head_dim, else sdpa; sdpa on CPU; the dry run says which). 'sdpa_flex': sdpa with is_causal for batches without "
        "sample boundaries or padding, flex_attention with a block mask per document for the others (GPU, "
        "torch >= 2.5). flash_attention_2 needs the flash-attn package and a GPU.",
    )
    liger_kernels: bool = Field(
        False,
        description="Liger Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); needs liger-kernel and a GPU.",
    )
    torch_compile: Literal["off", "model", "layers"] = Field(
        "off",
        description="torch.compile: 'layers' compiles each decoder layer in place (one compile, reused by every "
        "layer), 'model' the whole model through DeepSpeed's engine.compile(); the first steps compile. "
        "true/false mean 'model'/'off'.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder MLP over the sequence in tiles (DeepSpeed ALST TiledMLP): its "
        "intermediate activations exist for one tile at a time. Long sequences only.",
    )
    tiled_loss: bool = Field(
        False,
        description="Compute the output layer and the loss in chunks of tokens (at most 64 MiB of fp32 logits "
        "each), recomputed in backward: the [tokens x vocabulary] logits are never materialised. Exact; every "
        "objective and engine; Liger's fused linear cross-entropy with memory.liger_kernels where it can run.",
    )
    offload_checkpoints: bool = Field(
        False,
        description="Keep the activation-checkpoint inputs (one hidden state per layer) in host RAM "
        "between forward and backward; needs memory.activation_checkpointing=true.",
    )

    @field_validator("torch_compile", mode="before")
    @classmethod
    def _compile_bool(cls, value: Any) -> Any:
        # The switch was a bool before regional compilation existed: true meant the whole model.
        if isinstance(value, bool):
            return "model" if value else "off"
        return value

    @model_validator(mode="after")
    def _compile_not_with_alst(self) -> MemorySection:
        # The ALST switches patch forwards with their own autograd functions and saved-tensor hooks;
        # torch.compile over them is not verified, so it is refused rather than trusted.
        tiled = [n for n in ("tiled_mlp", "tiled_loss", "offload_checkpoints") if getattr(self, n)]
        if self.torch_compile != "off" and tiled:
            raise ValueError(
                f"memory.torch_compile={self.torch_compile} is not verified with memory.{tiled[0]}=true; "
                f"set memory.torch_compile=off or memory.{tiled[0]}=false"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpoints(self) -> MemorySection:
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise ValueError(
                "memory.offload_checkpoints=true offloads the activation checkpoints, but "
                "memory.activation_checkpointing is false; set memory.activation_checkpointing=true"
            )
        return self


class LoraSection(Section):
    """LoRA through PEFT: the base model is frozen and low-rank adapters are trained."""

    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Adapter updates are scaled by alpha / rank.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear modules that get adapters (all attention and MLP projections).",
    )
    export: Literal["merged", "adapter"] = Field(
        "merged", description="'merged': a plain HF model with the adapters folded in; 'adapter': PEFT files."
    )
    quantize: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="Load the frozen base through bitsandbytes (QLoRA): 'nf4' = 4-bit NormalFloat with double "
        "quantisation, 'int8' = LLM.int8(); embeddings and output layer stay 16-bit. Needs "
        "pip install 'llm_train[qlora]'.",
    )


Objective = Literal["lm", "dpo", "simpo", "grpo", "reward"]
# The beta each preference objective is usually run with: DPO's paper and TRL use 0.1; SimPO's paper
# (Meng et al. 2024, section 4) tunes it in [2.0, 2.5] because its rewards are per-token averages.
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0}


class PreferenceSection(Section):
    """Preference tuning on `format: preference` pairs (objective dpo or simpo; runtime/objectives.py)."""

    beta: float | None = Field(
        None,
        gt=0,
        description="Reward scale: how far the policy may move from the reference (dpo) or the per-token "
        "reward scale (simpo); default 0.1 for dpo, 2.0 for simpo.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Probability that a pair's preference is flipped (conservative DPO, Mitchell 2023): "
        "the loss is (1-e) of the sigmoid loss plus e of the reversed one; 0 = plain sigmoid loss.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="SimPO's target reward margin gamma (objective simpo only; TRL's simpo_gamma).",
    )
    reference: Literal["cached", "live"] = Field(
        "cached",
        description="dpo only. 'cached': the reference model's log-probs of every pair are computed in one "
        "pass before training and cached beside the data (training holds one model); 'live': computed "
        "every step, by the base model with the adapters disabled under LoRA, else by a frozen copy of "
        "the model (sharded like the policy under ZeRO-3; the planner counts its memory).",
    )


class RewardSection(Section):
    """Reward-model training on `format: preference` pairs (objective reward; runtime/objectives.py)."""

    margin: float = Field(
        0.0,
        description="Margin m in -log sigmoid(r_chosen - r_rejected - m): how much higher the chosen answer must "
        "score before a pair stops contributing; one constant for every pair (the preference format has no "
        "per-pair margin column).",
    )
    center_rewards_coefficient: float | None = Field(
        None,
        gt=0,
        description="Adds this times mean((r_chosen + r_rejected)^2) to the loss, which keeps the rewards centred "
        "on 0 (the pairwise loss only fixes their differences); Eisenstein et al. 2023 use 0.01. None = off.",
    )


class _RewardFields(Section):
    weight: float = Field(
        1.0, description="This reward's weight in the sum the advantages are computed from."
    )
    name: str | None = Field(
        None,
        description="Its name in metrics.jsonl (reward_<name>_mean); default the kind or the function's name.",
    )


class FormatReward(_RewardFields):
    """1.0 when the completion matches `pattern`, else 0.0: a verifiable format reward."""

    kind: Literal["format"] = "format"
    pattern: str = Field(description="A Python regular expression the completion must match.")
    match: Literal["full", "search"] = Field(
        "full",
        description="'full': the whole completion (outer whitespace stripped) matches; 'search': a part does.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        return _compiled(pattern)


class ExactMatchReward(_RewardFields):
    """1.0 when the completion's final answer equals the row's `column`, else 0.0 (numbers compared as numbers)."""

    kind: Literal["exact_match"] = "exact_match"
    column: str = Field("answer", description="The prompt row's field that holds the right answer.")
    pattern: str | None = Field(
        None,
        description="A regular expression that finds the final answer in the completion (its first group if it "
        "has one; the last match counts; no match scores 0); default: the whole completion, stripped.",
    )

    column_pattern: str | None = Field(
        None,
        description="A regular expression that finds the right answer in the column's value, as `pattern` does in "
        "the completion (e.g. GSM8K's '#### (.*)'); default: the whole value, stripped.",
    )

    @field_validator("pattern", "column_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        return None if pattern is None else _compiled(pattern)


class OverlongReward(_RewardFields):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), by completion tokens: 0 up to
    max_completion_length - buffer, then falling linearly to -1 at max_completion_length."""

    kind: Literal["overlong"] = "overlong"
    buffer: int = Field(
        gt=0, description="Tokens before grpo.max_completion_length over which the penalty grows."
    )


class FunctionReward(_RewardFields):
    """A reward function of yours: `module:function`, called as function(prompts=..., completions=...,
    completion_ids=..., **columns) with one list entry per completion, returning a float or None for each."""

    kind: Literal["function"] = "function"
    function: str = Field(
        description="'module:function' importable from the working directory or PYTHONPATH (e.g. my_rewards:correct)."
    )

    @field_validator("function")
    @classmethod
    def _is_a_path(cls, path: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", path):
            raise ValueError(f"'{path}' is not 'module:function' (e.g. my_rewards:correct)")
        return path


class RewardModelReward(_RewardFields):
    """The score a trained reward model (an objective reward run's final/) gives prompt + completion."""

    kind: Literal["reward_model"] = "reward_model"
    path: str = Field(
        description="A directory AutoModelForSequenceClassification loads with num_labels=1 and a pad id, e.g. "
        "runs/tiny-cpu-reward/final; it scores each prompt text followed by its completion, on the CPU of "
        "every rank."
    )


def _compiled(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression ({exc}): {pattern!r}") from None
    return pattern


Reward = FormatReward | ExactMatchReward | OverlongReward | FunctionReward | RewardModelReward
REWARD_CLASSES: dict[str, type[Section]] = {
    "format": FormatReward,
    "exact_match": ExactMatchReward,
    "overlong": OverlongReward,
    "function": FunctionReward,
    "reward_model": RewardModelReward,
}


def _parse_reward(item: Any, where: str) -> Any:
    """One entry of grpo.rewards, parsed by its `kind` so that a mistake names `grpo.rewards[i].key` in one line."""
    if isinstance(item, tuple(REWARD_CLASSES.values())):
        return item
    if not isinstance(item, dict):
        raise ValueError(
            f"{where}: expected a mapping with 'kind' ({', '.join(REWARD_CLASSES)}), got {item!r}"
        )
    kind = item.get("kind")
    cls = REWARD_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{where}.kind: {kind!r} is not one of {', '.join(REWARD_CLASSES)}")
    return _validate_entry(cls, item, where, f"kind {kind}")


class GrpoSection(Section):
    """Online RL with GRPO (objective grpo; runtime/grpo.py): each step the model writes num_generations
    completions per prompt, the rewards score them, and the loss is TRL's GRPO loss (runtime/grpo_loss.py).
    optim.micro_batch_size counts completions; each rank's completions per step form whole groups."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group G).")
    max_completion_length: int = Field(256, ge=1, description="Most tokens a completion may have.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature (the log-probs are taken at it too)."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens of this mass."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens; 0 = no limit.")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="How token losses are averaged: grpo (per completion, then over completions), bnpo (per "
        "micro-batch token), dr_grpo (sum / (completions x max_completion_length)), dapo (per token of the step).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="'token': a ratio per token (GRPO); 'sequence': one per completion (GSPO)."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip of the ratio: 1 - epsilon.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip: 1 + epsilon_high (DAPO's clip-higher uses 0.28); default epsilon.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the k3 KL to the initial model; 0 = no reference model (TRL's default).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps per generated batch; above 1 the log-probs at generation are kept for the ratio.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length (no EOS) out of the loss."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the group's reward std (group), the batch's (batch), or not (none: Dr. GRPO).",
    )
    rewards: list[FormatReward | ExactMatchReward | OverlongReward | FunctionReward | RewardModelReward] = (
        Field(
            default_factory=list,
            description="Reward functions, each {kind: format|exact_match|overlong|function|reward_model, weight, ...}; "
            "see docs/rl.md.",
        )
    )

    @model_validator(mode="before")
    @classmethod
    def _reward_kinds(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("rewards"), list):
            values = {
                **values,
                "rewards": [_parse_reward(r, f"grpo.rewards[{i}]") for i, r in enumerate(values["rewards"])],
            }
        return values


class DeepSpeedSection(Section):
    config: str = Field(description="A name in ds_configs/ (e.g. 'zero3') or a path to a DeepSpeed JSON.")
    pipeline_stages: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree: the model is cut into this many stages (ZeRO-0/1 only).",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ulysses sequence-parallel degree (DeepSpeed ALST through Accelerate): each sequence "
        "is split over this many consecutive ranks, which see the same samples (world = dp x tp x pp x sp).",
    )
    nvme_path: str | None = Field(
        None,
        description="Directory on a fast local NVMe drive for ZeRO-Infinity offload (DS JSON device 'nvme'); "
        "checked for existence, write access and free space before the run starts.",
    )
    pinning: Literal["torch", "native", "off", "auto"] = Field(
        "torch",
        description="How the offload buffers the DS JSON pins (pin_memory) are allocated: 'torch' "
        "(DeepSpeed's default: torch's pinned allocator rounds each up to a power of two), 'native' (exact "
        "size, mlocked: DS_PIN_MEMORY_BACKEND=native; needs a memlock limit (ulimit -l) that large, checked "
        "before start), 'off' (pin_memory false everywhere: exact, pageable, slower copies), 'auto' ('native' "
        "when the memlock limit allows it, else 'torch' when its rounded total fits the host RAM, else 'off'; "
        "with a notice).",
    )

    @field_validator("pinning", mode="before")
    @classmethod
    def _yaml_off_is_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` (also from `deepspeed.pinning=off` on the command line) as false.
        return "off" if value is False else value

    # 30 minutes: the longest wait inside a collective in the largest shipped recipe (70b-zero3, 32
    # ranks) is one rank writing its ~25 GiB checkpoint share or a ~1 min step, minutes at worst on a
    # busy shared filesystem; hashing and conversion never wait inside one (runtime/checkpointing/file_sync.py).
    # `llm-train plan` and --dry-run print the checkpoint's expected times against it.
    timeout_minutes: float = Field(
        30.0,
        gt=0,
        description="Process-group timeout (NCCL/gloo), given to Accelerate and DeepSpeed: a collective fails "
        "after waiting this long for a rank; ranks waiting for checkpoint work through files use it too.",
    )

    @model_validator(mode="after")
    def _nvme_path_is_a_path(self) -> DeepSpeedSection:
        # The DS JSON spells "let the recipe decide" as "auto"; in the recipe itself that would
        # reach DeepSpeed as a directory literally named "auto".
        if self.nvme_path is not None and self.nvme_path.strip() in ("", "auto"):
            raise ValueError(
                f"deepspeed.nvme_path={self.nvme_path!r} is not a directory; give a path on a local NVMe "
                "drive (e.g. deepspeed.nvme_path=/mnt/nvme) or remove the key"
            )
        return self


class EvalSection(Section):
    every: int = Field(0, ge=0, description="Evaluate every N optimizer steps; 0 = only at the end.")
    batches: int = Field(8, ge=1, description="Micro-batches per evaluation (per data-parallel rank).")
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks run on the live model during training (needs llm_train[eval]), "
        "e.g. [llm_train_tiny] (bundled, offline) or [hellaswag, arc_easy]; results logged as bench/TASK/METRIC.",
    )
    tasks_every: int = Field(
        0,
        ge=0,
        description="Run eval.tasks every N optimizer steps (and at the end); 0 = at eval.every's steps.",
    )
    tasks_limit: float | None = Field(
        None, gt=0, description="Documents per task for eval.tasks (a fraction below 1); default: all."
    )
    tasks_batch_size: int = Field(8, ge=1, description="Requests per forward pass for eval.tasks.")
    tasks_include_path: list[str] = Field(
        default_factory=list,
        description="Folders of lm-eval YAML tasks for eval.tasks, beside the bundled ones.",
    )


class OutputSection(Section):
    dir: str = Field("runs/{name}", description="Run directory; '{name}' is replaced by the recipe name.")
    log_every: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")
    sample_prompt: str | None = Field(
        None, description="Text the exported model continues at the end of the run (printed)."
    )


class CheckpointSection(Section):
    """Periodic checkpoints, retention, preemption and fault handling."""

    every_steps: int = Field(0, ge=0, description="Save every N optimizer steps; 0 = not by steps.")
    every_minutes: float = Field(0.0, ge=0, description="Save every M minutes of training; 0 = not by time.")
    at_end: bool = Field(True, description="Save a checkpoint after the last step.")
    keep_last_n: int = Field(
        3, ge=2, description="Committed checkpoints kept (at least 2: one may be mid-write)."
    )
    grace_s: float = Field(
        25.0, gt=0, description="Budget to finish the step and save after SIGTERM/SIGUSR1."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="Non-finite loss: 'stop' names the step and exits; 'skip' drops the step and counts it.",
    )


class TrackingSection(Section):
    """Experiment tracking. metrics.jsonl is always written; W&B is optional."""

    mode: Literal["disabled", "offline", "online"] = Field("disabled", description="W&B mode.")
    project: str = Field("llm-train", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    run_name: str | None = Field(None, description="W&B run name; defaults to the run directory name.")
    tags: list[str] = Field(default_factory=list, description="W&B tags.")
    group: str | None = Field(None, description="W&B group.")
    tensorboard: bool = Field(
        False, description="Also write TensorBoard event files to RUN_DIR/tensorboard/."
    )


class Recipe(Section):
    """One training recipe: what is trained, on which data, with which optimiser and precision."""

    name: str = Field(description="Recipe name (defaults to the YAML file's stem).")
    description: str = Field("", description="One line: what this recipe trains.")
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    model: ModelSection
    data: DataSection
    optim: OptimSection
    precision: Literal["bf16", "fp16", "fp32", "auto"] = Field(
        "auto", description="'auto' = bf16 where supported, fp16 on older GPUs, fp32 on CPU."
    )
    memory: MemorySection = Field(default_factory=MemorySection)
    lora: LoraSection | None = Field(
        None, description="Train LoRA adapters instead of all weights (needs peft)."
    )
    objective: Objective = Field(
        "lm",
        description="'lm': next-token cross-entropy on the loss mask (pre-training, SFT); 'dpo': DPO's "
        "sigmoid loss against a reference model; 'simpo': SimPO, reference-free (both need "
        "format: preference data); 'grpo': online RL, the model's own completions scored by rewards "
        "(format: prompt data); 'reward': a reward model (a one-output sequence-classification head on the "
        "model) trained on format: preference pairs with the Bradley-Terry loss, exported as "
        "AutoModelForSequenceClassification.",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection, description="DPO / SimPO settings (objective dpo or simpo)."
    )
    grpo: GrpoSection = Field(
        default_factory=GrpoSection, description="GRPO settings (objective grpo): generation, loss, rewards."
    )
    reward: RewardSection = Field(
        default_factory=RewardSection,
        description="Reward-model settings (objective reward): margin, centring.",
    )
    deepspeed: DeepSpeedSection
    eval: EvalSection = Field(default_factory=EvalSection)
    output: OutputSection = Field(default_factory=OutputSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        if self.memory.attention == "flash_attention_2" and self.hardware.device == "cpu":
            raise ValueError(
                "memory.attention=flash_attention_2 needs a CUDA GPU; use sdpa on hardware.device=cpu"
            )
        if self.memory.attention in ("flex_attention", "sdpa_flex") and self.hardware.device == "cpu":
            raise ValueError(
                f"memory.attention={self.memory.attention} cannot train on CPU (torch has no flex_attention "
                "backward there); use sdpa or auto on hardware.device=cpu"
            )
        if self.lora is not None and self.lora.quantize != "none" and self.model.init == "random":
            # bitsandbytes quantises weights as transformers loads them from a checkpoint.
            raise ValueError(
                f"lora.quantize={self.lora.quantize} quantises a pretrained base as it loads; it needs "
                "model.init=pretrained (save a randomly initialised model with save_pretrained first, and point "
                "model.name_or_path at that directory)"
            )
        if self.optim.max_steps is None and any(
            not isinstance(s, str) and s.streaming for s in self.data.train
        ):
            raise ValueError(
                "data.train is streamed (streaming: true), so its length is unknown and optim.epochs cannot be "
                "counted; set optim.max_steps"
            )
        self._check_objective()
        return self

    def _check_objective(self) -> None:
        """Preference data and preference objectives come together; what pairs cannot use is refused."""
        objective, preference = self.objective, self.preference
        sources = [
            (f"data.{split}[{i}]", source)
            for split in ("train", "eval")
            for i, source in enumerate(getattr(self.data, split))
        ]
        if objective != "grpo":
            prompts = next((key for key, s in sources if isinstance(s, PromptSource)), None)
            if prompts:
                raise ValueError(
                    f"{prompts} is format prompt, which trains with online RL; set objective: grpo, or use another "
                    "format"
                )
            changed = [k for k, v in GrpoSection().model_dump().items() if getattr(self.grpo, k) != v]
            if changed:
                raise ValueError(
                    f"grpo.{changed[0]} is set but objective is {objective}; set objective: grpo, or remove the "
                    "grpo section"
                )
        else:
            self._check_grpo()
            return
        if objective != "reward":
            changed = [k for k, v in RewardSection().model_dump().items() if getattr(self.reward, k) != v]
            if changed:
                raise ValueError(
                    f"reward.{changed[0]} is set but objective is {objective}; set objective: reward, or remove "
                    "the reward section"
                )
        if objective == "lm":
            pairs = next((key for key, s in sources if isinstance(s, PreferenceSource)), None)
            if pairs:
                raise ValueError(
                    f"{pairs} is format preference, which trains with a preference objective; set objective: dpo "
                    "(or simpo), or use another format"
                )
            # Compared with the defaults, not with what was written: a dumped recipe lists every field.
            changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(preference, k) != v]
            if changed:
                raise ValueError(
                    f"preference.{changed[0]} is set but objective is lm; set objective: dpo (or simpo), or "
                    "remove the preference section"
                )
            return
        for key, source in sources:
            if not isinstance(source, PreferenceSource):
                fmt = source.format if not isinstance(source, str) else "text"
                raise ValueError(
                    f"{key} is format {fmt}, but objective={objective} trains on pairs; give every data.train "
                    "and data.eval source format: preference (prompt, chosen, rejected)"
                )
            if source.streaming:
                raise ValueError(
                    f"{key}.streaming=true: preference pairs are tokenised up front (the reference pass reads "
                    "them all before training); remove streaming"
                )
        if self.data.packing == "packed":
            raise ValueError(
                f"objective={objective} trains each pair as two padded rows (chosen and rejected); set "
                "data.packing=padded"
            )
        if objective == "reward":
            self._check_reward()
            return
        defaults = PreferenceSection()
        if objective == "simpo" and preference.reference != defaults.reference:
            raise ValueError(
                "preference.reference=live applies to objective dpo; simpo is reference-free: remove "
                "preference.reference"
            )
        if objective == "dpo" and preference.simpo_gamma != defaults.simpo_gamma:
            raise ValueError(
                "preference.simpo_gamma applies to objective simpo; remove it or set objective: simpo"
            )
        if preference.beta is None:
            # Filled in here so the resolved recipe (config/recipe.yaml, W&B) shows the beta that trains.
            preference.beta = DEFAULT_BETA[objective]

    def _check_reward(self) -> None:
        """A reward model reads the pairs DPO reads, but has a score head instead of an LM head."""
        changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(self.preference, k) != v]
        if changed:
            raise ValueError(
                f"preference.{changed[0]} applies to objective dpo or simpo; remove it (objective reward is set "
                "in the reward section: margin, center_rewards_coefficient)"
            )
        if self.lora is not None:
            raise ValueError(
                "lora: objective reward trains the whole model and its new score head (LoRA on a reward model is "
                "not supported yet); remove the lora section"
            )
        if self.memory.tiled_loss:
            raise ValueError("memory.tiled_loss applies to the token loss; remove it with objective reward")

    def _check_grpo(self) -> None:
        """Prompts in, completions generated: every source is a prompt source, and a completion fits seq_len."""
        grpo = self.grpo
        changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(self.preference, k) != v]
        if changed:
            raise ValueError(
                f"preference.{changed[0]} is set but objective is grpo; remove the preference section (grpo.beta "
                "weighs the KL to the initial model)"
            )
        for split in ("train", "eval"):
            for i, source in enumerate(getattr(self.data, split)):
                if split == "eval":
                    raise ValueError(
                        f"data.eval[{i}]: objective grpo has no evaluation set (its metrics are the rewards of "
                        "each step); remove data.eval and set data.eval_fraction=0"
                    )
                if not isinstance(source, PromptSource):
                    fmt = source.format if not isinstance(source, str) else "text"
                    raise ValueError(
                        f"data.train[{i}] is format {fmt}, but objective=grpo generates from prompts; give every "
                        "data.train source format: prompt (a prompt field and the fields your rewards read)"
                    )
                if source.streaming:
                    raise ValueError(
                        f"data.train[{i}].streaming=true: prompts are read whole; remove streaming"
                    )
        if self.data.eval_fraction > 0:
            raise ValueError(
                f"data.eval_fraction={self.data.eval_fraction}: objective grpo has no evaluation set (its metrics "
                "are the rewards of each step); set data.eval_fraction=0"
            )
        if not grpo.rewards:
            raise ValueError(
                "grpo.rewards is empty; give at least one reward, e.g. [{kind: format, pattern: '...'}]"
            )
        if grpo.max_completion_length >= self.data.seq_len:
            raise ValueError(
                f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for a prompt in "
                f"data.seq_len={self.data.seq_len} (prompt + completion); raise data.seq_len or lower it"
            )
        if self.memory.tiled_loss:
            raise ValueError("memory.tiled_loss applies to the token loss; remove it with objective grpo")

    @property
    def sequences_per_sample(self) -> int:
        """Sequences one sample trains: two for a preference pair (chosen and rejected), else one."""
        return 2 if self.objective in ("dpo", "simpo", "reward") else 1

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir.replace("{name}", self.name))


# ---------------------------------------------------------------- loading


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    """A recipe name from recipes/ or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"--recipe {name_or_path}: file not found")
        return path
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = available_recipes()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise UserError(
        f"unknown recipe '{name_or_path}'{hint}; available: {', '.join(names)}; or pass a path to a YAML file"
    )


class _Loader(yaml.SafeLoader):
    """YAML as users write numbers: `1e-5` is a float (PyYAML follows YAML 1.1, where it is a string).

    Typed fields coerce strings anyway, but `model.config` passes values straight to
    transformers, whose configs refuse a string epsilon.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 3e-4). Values are parsed as YAML (numbers, lists, null)."""
    if "=" not in text:
        raise UserError(f"override '{text}' is not key.sub=value (e.g. optim.lr=3e-4)")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise UserError(f"override '{text}' has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override '{text}': {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


# Fields that hold paths; relative paths in a YAML file are taken relative to that file
# (so recipes work from any working directory), those from overrides relative to the cwd.
_PATH_FIELDS = (("model", "tokenizer"), ("model", "name_or_path"), ("deepspeed", "config"))
# Fields that can only be local paths, so a bare relative name ('nvme') is anchored too; workers may
# start in another directory, and DeepSpeed receives the absolute path.
_LOCAL_PATH_FIELDS = (("deepspeed", "nvme_path"),)
_PATH_LIST_FIELDS = (("data", "train"), ("data", "eval"), ("eval", "tasks_include_path"))


def _anchor_path(value: str, base: Path) -> str:
    looks_local = value.startswith((".", "/", "~")) or any(ch in value for ch in "*?")
    if not looks_local:
        return value  # a hub id ('meta-llama/Llama-2-7b-hf') or a ds_configs name ('zero3')
    return str((base / Path(value).expanduser()).resolve()) if not Path(value).is_absolute() else value


def _anchor_paths(data: dict[str, Any], base: Path) -> None:
    for section, key in _PATH_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str):
            data[section][key] = _anchor_path(value, base)
    for section, key in _LOCAL_PATH_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and value.strip() not in ("", "auto"):  # those two: the schema explains
            # abspath, not resolve(): keep the user's spelling of a symlinked mount in every message.
            data[section][key] = os.path.abspath(base / Path(value).expanduser())
    for section, key in _PATH_LIST_FIELDS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, dict):  # data.train: {path: ..., format: ...} (one source, no list)
            value = [value]
        if isinstance(value, list):
            data[section][key] = [_anchor_source(v, base) for v in value]


def _anchor_source(value: Any, base: Path) -> Any:
    """A path string, or a data source mapping whose 'path' is anchored the same way."""
    if isinstance(value, str):
        return _anchor_path(value, base)
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": _anchor_path(value["path"], base)}
    return value


def _describe(error: ValidationError, model: type[BaseModel], source: str) -> str:
    """The first validation problem as one line: the key, what is wrong, how to fix it."""
    err = error.errors()[0]
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        owner: Any = model
        for part in loc[:-1]:
            annotation = owner.model_fields[part].annotation if part in owner.model_fields else None
            # An optional section (`lora: LoraSection | None`): look inside the union.
            annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
            owner = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if owner is None:
                break
        valid = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{source}: unknown key '{key}'; {hint}valid keys here: {', '.join(valid)}"
    if err["type"] == "missing":
        return f"{source}: missing required key '{key}'; add it to the recipe or pass {key}=VALUE"
    got = err.get("input")
    got_text = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        return f"{source}: {message}"
    return f"{source}: {key}: {message}{got_text}"


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe; every problem is a one-line UserError."""
    path = find_recipe(name_or_path)
    try:
        data = yaml_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"recipe {path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: expected a mapping of sections at the top level")
    data.setdefault("name", path.stem)
    _anchor_paths(data, path.parent)
    return recipe_from_data(data, overrides, f"recipe {path.name}")


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """`data` (a recipe's mapping, paths anchored) with `key.sub=value` overrides applied in place; paths
    in overrides are taken relative to the working directory."""
    for text in overrides or []:
        parts, value = parse_override(text)
        single: dict[str, Any] = {parts[0]: {}} if len(parts) > 1 else {}
        _apply_override(single, parts, value, text)
        _anchor_paths(single, Path.cwd())
        _apply_override(data, parts, _dig(single, parts), text)
    return data


def recipe_from_data(data: dict[str, Any], overrides: list[str] | None, source: str) -> Recipe:
    """A recipe from its mapping (paths anchored) and overrides, validated; `source` names it in errors."""
    apply_overrides(data, overrides)
    source = source if not overrides else f"{source} (with overrides)"
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(_describe(exc, Recipe, source)) from None


def _dig(data: dict[str, Any], parts: list[str]) -> Any:
    for part in parts:
        data = data[part]
    return data


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
