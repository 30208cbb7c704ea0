"""Data sources, the schema half of a data format: the keys a `data.train` / `data.eval` entry may have.

A data format has two halves, one per layer. Here, in config (which decides without torch or
`datasets`), is what a recipe may write for it: one pydantic class per format with its keys, their
defaults and checks, and `objectives`, the objectives that train on it (recipe.py refuses any other).
Its behaviour (which columns it reads, how a batch of rows becomes token ids and a loss mask, whether a
sample is one row or a pair) is one module of `llm_train/data/formats/`, registered there under the
same name; `tests/unit/test_data_format_registry.py` fails when a format has one half without the
other. Config cannot import data (the layers), and data needs tokenizers, so the halves cannot share a
module; they share the name in `format:`.

Adding a format: a class here, listed in SOURCE_CLASSES; a module in data/formats/, listed in its
FORMATS; one test module; a line in docs/data.md (docs/development.md says more).
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import Field, field_validator, model_validator

from llm_train.config.objective_sections import Objective
from llm_train.config.section import Section, validate_entry

Overlong = Literal["truncate", "drop", "error", "split"]


class SourceDefaults(Protocol):
    """What a source may leave to the data section (DataSection has these fields)."""

    text_field: str
    image_max_pixels: int | None
    image_min_pixels: int | None


class Source(Section):
    """Fields every data source has; the format-specific classes below add their own."""

    # Every format's class declares these as fields of its own (Literal) type, after the fields below.
    if TYPE_CHECKING:
        format: str
        overlong: str
    # The objectives that train on this format (recipe.py refuses a source under any other).
    objectives: ClassVar[tuple[Objective, ...]] = ("lm",)

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
    def _weight_is_positive(self) -> Source:
        if not self.weight > 0:
            raise ValueError(
                f"weight must be > 0 (got {self.weight}); remove the source instead of weighting it 0"
            )
        return self

    def filled(self, defaults: SourceDefaults) -> Source:
        """This source with what it leaves to the data section filled in (data.text_field for text, the image
        size bounds for image_chat)."""
        return self


class _PromptTemplated(Source):
    """A source whose prompts go through its `prompt_template` (each class declares it, with its own default)."""

    if TYPE_CHECKING:
        prompt_template: str

    @model_validator(mode="after")
    def _template_has_prompt(self) -> _PromptTemplated:
        check_prompt_template(self.prompt_template)
        return self


class TextSource(Source):
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

    def filled(self, defaults: SourceDefaults) -> Source:
        if self.text_field is not None:
            return self
        return self.model_copy(update={"text_field": defaults.text_field})


class InstructionSource(_PromptTemplated):
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


class CompletionSource(_PromptTemplated):
    """Prompt-completion rows as TRL writes them (`{prompt, completion}`); loss only on the completion.

    Both fields are text, or both lists of {role, content} messages (TRL's conversational form). Text: the
    prompt goes through `prompt_template` and is encoded with the tokenizer's special tokens, the
    completion after it ends with eos. Messages: the prompt is rendered with the chat template and its
    generation prompt, the completion is the text the template adds for its messages. Rows with an empty
    completion are dropped.
    """

    format: Literal["completion"] = "completion"
    prompt_field: str = Field(
        "prompt", description="Field with the prompt (text or messages); not trained on."
    )
    completion_field: str = Field(
        "completion", description="Field with the completion (text or messages); trained on."
    )
    prompt_template: str = Field(
        "{prompt}",
        description="Wraps a text prompt ('{prompt}' is replaced by it); message prompts use the chat template.",
    )
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )


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


class ConversationSource(Source):
    """The keys of sources whose rows hold conversations (chat, image_chat): their shape and role mapping."""

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


class ChatSource(ConversationSource):
    """Conversations rendered with the chat template; loss only on assistant turns.

    OpenAI-style `messages: [{role, content}]` by default; other shapes through the field names and a
    mapping of role values (`preset: sharegpt` sets them for ShareGPT). Tool messages (role `tool`,
    `tool_calls`) pass through to the template.
    """

    format: Literal["chat"] = "chat"
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )


class ImageChatSource(ConversationSource):
    """Conversations with images, for image-text models: the model's processor builds pixel values and image
    tokens; loss only on assistant turns, never on image tokens.

    Three shapes are read: TRL's (`{"type": "image"}` parts in a message's content, the images in the
    `images` column as paths, bytes or the hub's Image feature), LLaMA-Factory's / LLaVA's / ShareGPT's
    (`<image>` in the text, `images` or `image` column; `preset: sharegpt` for `conversations`), and
    OpenAI's (`{"type": "image_url", "image_url": {"url": path or data URI}}` parts). One sample per
    sequence (data.packing=padded).
    """

    format: Literal["image_chat"] = "image_chat"
    images_field: str = Field(
        "images",
        description="Field with the row's images (a list, or one image), in the order the conversation names "
        "them; 'image' is read when the rows have no 'images'. Rows in OpenAI's shape need none.",
    )
    image_placeholder: str = Field(
        "<image>", description="Text that stands for the next image in text content (LLaMA-Factory, LLaVA)."
    )
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="Images larger than this many pixels are shrunk first; default data.image_max_pixels.",
    )
    min_pixels: int | None = Field(
        None,
        ge=1,
        description="Images smaller than this many pixels are enlarged first; default data.image_min_pixels.",
    )
    overlong: Literal["drop", "error"] = Field(
        "error",
        description="Samples longer than seq_len (image tokens included): error, or drop them. They are never "
        "truncated: a cut would split an image's tokens from its pixels.",
    )

    def filled(self, defaults: SourceDefaults) -> Source:
        return self.model_copy(
            update={
                "max_pixels": self.max_pixels if self.max_pixels is not None else defaults.image_max_pixels,
                "min_pixels": self.min_pixels if self.min_pixels is not None else defaults.image_min_pixels,
            }
        )


class TokenizedSource(Source):
    """Rows that already hold token ids (and optionally labels, -100 where not trained on)."""

    format: Literal["tokenized"] = "tokenized"
    input_ids_field: str = Field("input_ids", description="Field with the token ids.")
    labels_field: str = Field(
        "labels", description="Field with labels, used when present; else all tokens train."
    )
    overlong: Overlong = Field(
        "truncate", description="Samples longer than seq_len: truncate, drop, error or split."
    )


class PreferenceSource(_PromptTemplated):
    """Preference pairs: a prompt with a chosen and a rejected response (objective dpo or simpo).

    Each of the three fields holds text or a list of {role, content} messages. Message lists
    are rendered with the chat template; when `chosen` and `rejected` are whole conversations
    (HuggingFaceH4/ultrafeedback_binarized's train_prefs), the prompt is what they share before
    their last (assistant) message. Both sequences start with the same prompt tokens; the loss
    mask covers the response only.
    """

    format: Literal["preference"] = "preference"
    objectives: ClassVar[tuple[Objective, ...]] = ("dpo", "simpo", "reward")
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


def check_prompt_template(template: str) -> None:
    names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if names != {"prompt"}:
        raise ValueError(
            f"prompt_template must contain '{{prompt}}' and no other {{fields}} (found {sorted(names)}); "
            "write literal braces as {{ and }}"
        )


class PromptSource(_PromptTemplated):
    """Prompts for online RL (objective grpo): the model writes the completions, rewards score them.

    The prompt is text (wrapped in `prompt_template`) or a list of {role, content} messages, rendered with
    the chat template and its generation prompt. Every other field of the row (e.g. `answer`) is handed to
    the reward functions by name.
    """

    format: Literal["prompt"] = "prompt"
    objectives: ClassVar[tuple[Objective, ...]] = ("grpo",)
    prompt_field: str = Field("prompt", description="Field with the prompt (text or messages).")
    prompt_template: str = Field(
        "{prompt}",
        description="Wraps a text prompt ('{prompt}' is replaced by it); message prompts use the chat template.",
    )
    overlong: Literal["drop", "error"] = Field(
        "drop",
        description="Prompts longer than data.seq_len - grpo.max_completion_length tokens: drop them, or error.",
    )


SOURCE_CLASSES: dict[str, type[Source]] = {
    cls.model_fields["format"].default: cls
    for cls in (
        TextSource,
        InstructionSource,
        ChatSource,
        TokenizedSource,
        PreferenceSource,
        PromptSource,
        CompletionSource,
        ImageChatSource,
    )
}


def parse_source(item: Any, where: str) -> Any:
    """One entry of data.train / data.eval: a path string stays a string; a mapping becomes its format's class.

    Done by hand (not by a pydantic union) so that a mistake names `data.train[1].key` and the keys valid
    for that format, in one line.
    """
    if isinstance(item, (str, Source)):
        return item
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a path or a mapping with 'path' and 'format' (got {item!r})")
    fmt = item.get("format", "text")
    cls = SOURCE_CLASSES.get(fmt) if isinstance(fmt, str) else None
    if cls is None:
        raise ValueError(f"{where}.format: unknown format {fmt!r}; use one of {', '.join(SOURCE_CLASSES)}")
    return validate_entry(cls, item, where, f"format {fmt}")
