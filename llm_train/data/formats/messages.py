"""Messages, the shape chat templates read: the template a source uses, and a row's messages mapped onto it.

Shared by the formats whose rows hold conversations (chat; preference, completion and prompt rows
written as message lists). `map_messages` turns a row's list of messages, in whatever shape the
source's mapping names (OpenAI's `{role, content}` by default, ShareGPT's through a preset), into
`{role, content, ...}` dicts with the template's roles; tool calls and tool results pass through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from llm_train.config.source_schema import CHAT_ROLES, TOOL_CALL, ConversationSource
from llm_train.data.formats.base import as_text
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_template_for(tokenizer: PreTrainedTokenizerBase, override: str | None, key: str) -> str:
    """The Jinja template chat sources use: data.chat_template (text or a .jinja path), else the tokenizer's."""
    if override:
        from pathlib import Path

        path = Path(override).expanduser()
        if "{" not in override and path.suffix in (".jinja", ".j2", ".txt"):
            if not path.is_file():
                raise UserError(f"data.chat_template: file not found: {override}")
            return path.read_text(encoding="utf-8")
        return override
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # tokenizers with several named templates
        template = template.get("default")
    if not template:
        raise UserError(
            f"{key}: format chat needs a chat template and tokenizer '{tokenizer.name_or_path}' has none; "
            "set data.chat_template to a Jinja template or a .jinja file"
        )
    return template


@dataclass(frozen=True)
class ChatMapping:
    """How a row's messages read: the keys of role and text, and role values -> the template's roles."""

    role_field: str = "role"
    content_field: str = "content"
    roles: dict[str, str] = field(default_factory=dict)
    messages_field: str = "messages"

    @classmethod
    def of(cls, source: ConversationSource) -> ChatMapping:
        return cls(source.role_field, source.content_field, dict(source.roles), source.messages_field)


OPENAI = ChatMapping()
# Keys a message keeps as they are once role and text are mapped (OpenAI's tool-calling shape).
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def map_messages(
    conversation: Any, row: int, key: str, mapping: ChatMapping = OPENAI, system: Any = None
) -> list[dict[str, Any]]:
    """A row's messages as the chat template reads them: `{role, content, ...}` with the template's roles.

    Every refusal is one line naming the row, the message, the field and the source key to set.
    """
    if not isinstance(conversation, list) or not conversation:
        raise UserError(
            f"{key}: row {row + 1}: '{mapping.messages_field}' must be a non-empty list of messages "
            f"({{{mapping.role_field}, {mapping.content_field}}} objects)"
        )
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": as_text(system)}] if as_text(system).strip() else []
    )
    for i, message in enumerate(conversation):
        # Arrow gives every message every key seen in the file (None where absent); templates test
        # for presence, so absent keys must stay absent.
        present = {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else None
        calls = present is not None and bool(present.get("tool_calls"))
        needed = [mapping.role_field] + ([] if calls else [mapping.content_field])
        if present is None or any(name not in present for name in needed):
            has = ", ".join(present) if present is not None else type(message).__name__
            missing = (
                mapping.role_field
                if present is None or mapping.role_field not in present
                else mapping.content_field
            )
            hint = (
                "set preset: sharegpt on this source"
                if present is not None and {"from", "value"} <= set(present)
                else "set role_field / content_field on this source"
            )
            raise UserError(f"{key}: row {row + 1}: message {i} has no '{missing}' (has: {has}); {hint}")
        value = as_text(present.pop(mapping.role_field))
        role = mapping.roles.get(value, value)
        content = present.pop(mapping.content_field, None)
        if role == TOOL_CALL:
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [_tool_call(content, row, i, key)]}
            )
            continue
        if role not in CHAT_ROLES:
            raise UserError(
                f"{key}: row {row + 1}: message {i}: role '{value}' (field '{mapping.role_field}') is not one of "
                f"{', '.join(CHAT_ROLES)}; map it on this source, e.g. roles: {{{value}: assistant}}"
            )
        out = {"role": role, "content": content if content is not None or not calls else ""}
        out.update({k: present[k] for k in _TOOL_KEYS if k in present})
        messages.append(out)
    return messages


def _tool_call(content: Any, row: int, i: int, key: str) -> dict[str, Any]:
    """A ShareGPT function_call turn (JSON {name, arguments}) as an OpenAI tool call."""
    import json

    try:
        call = json.loads(content) if isinstance(content, str) else content
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise UserError(
            f"{key}: row {row + 1}: message {i} is a tool call (role tool_call) but its text is not JSON "
            '{"name": ..., "arguments": ...}; fix the row or map its role to assistant (roles on this source)'
        )
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def render(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Messages as the chat template writes them (with the assistant's generation prompt after them, or not);
    `template_kwargs`: extra variables the template reads (GRPO's chat_template_kwargs, e.g. enable_thinking)."""
    rendered = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **(template_kwargs or {}),
    )
    return cast(str, rendered)  # tokenize=False: the text (the annotation is the union over every option)
