"""`format: chat`: conversations rendered with the chat template; loss only on the assistant turns.

The template's own `{% generation %}` block marks the assistant tokens when it has one; otherwise
each assistant turn is located by rendering the conversation prefix by prefix (`_mask_by_prefixes`).
Rows in other shapes (ShareGPT, custom keys and roles) are mapped first (messages.py `map_messages`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from llm_train.config.source_schema import ChatSource
from llm_train.data.formats.base import Batch, Format, TokenizeFn
from llm_train.data.formats.messages import ChatMapping, chat_template_for, map_messages, render, uses_tools
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Chat(Format[ChatSource]):
    source_class = ChatSource
    uses_chat_template = "always"
    looks_like = frozenset({"messages"})
    field_keys = "messages_field"

    def required_fields(self, source: ChatSource) -> list[str]:
        return [source.messages_field]

    def optional_fields(self, source: ChatSource) -> list[str]:
        return [source.system_field] if source.system_field else []

    def column_hint(self, source: ChatSource, columns: list[str]) -> str | None:
        if "conversations" in columns and source.preset != "sharegpt":
            return "; a 'conversations' column is ShareGPT's shape: set preset: sharegpt on this source"
        return None

    def tokenize_fn(
        self,
        source: ChatSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        return _chat_fn(source, tokenizer, chat_template, key)

    def mapping_lines(
        self, source: ChatSource, key: str, first_row: Callable[[], tuple[dict[str, Any], str]]
    ) -> list[str]:
        """The mapping, and the first row as the messages the chat template receives: `[role] content`, tool
        calls as `name(arguments)`."""
        first, where = first_row()
        system = first.get(source.system_field) if source.system_field else None
        mapping = ChatMapping.of(source)
        messages = map_messages(first[source.messages_field], 0, f"{key}: {where}", mapping, system)
        renamed = ", ".join(f"{k}->{v}" for k, v in mapping.roles.items() if k != v) or "none"
        lines = [
            f"{key} {source.path} (chat, preset {source.preset}): {source.messages_field}[]."
            f"{source.role_field} -> role, .{source.content_field} -> content; roles renamed: {renamed}",
            f"  row 1 as the chat template receives it ({len(messages)} messages):",
        ]
        for message in messages:
            text = message.get("content") or ", ".join(
                f"{c['function']['name']}({c['function'].get('arguments')})"
                for c in message.get("tool_calls", [])
            )
            line = " ".join(str(text).split())
            lines.append(f"    [{message['role']}] {line[:100]}{'...' if len(line) > 100 else ''}")
        return lines


CHAT = Chat()


def _chat_fn(
    source: ChatSource, tokenizer: PreTrainedTokenizerBase, chat_template: str | None, key: str
) -> TokenizeFn:
    template = chat_template_for(tokenizer, chat_template, key)
    marked = bool(_GENERATION_BLOCK.search(template))

    def render(conversations: list[list[dict[str, Any]]]) -> tuple[list[list[int]], list[list[int]]]:
        if marked:
            # return_dict=True: a BatchEncoding (the annotation is the union over every option).
            out = cast(
                "BatchEncoding",
                tokenizer.apply_chat_template(
                    conversations,
                    chat_template=template,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                ),
            )
            return [list(x) for x in out["input_ids"]], [list(m) for m in out["assistant_masks"]]
        pairs = [_mask_by_prefixes(tokenizer, template, conv) for conv in conversations]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    mapping = ChatMapping.of(source)
    # Templates that render tools mention them (HF's tool-use templates test `tool_calls` and the `tool`
    # role); one that does not would drop them or fail on the row, so it is refused by name instead.
    renders_tools = "tool" in template

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        systems = batch.get(source.system_field) if source.system_field else None
        conversations = [
            map_messages(c, row, key, mapping, systems[n] if systems is not None else None)
            for n, (c, row) in enumerate(zip(batch[source.messages_field], indices, strict=True))
        ]
        if not renders_tools:
            for conversation, row in zip(conversations, indices, strict=True):
                if uses_tools(conversation):
                    raise UserError(
                        f"{key}: row {row + 1}: the conversation has tool messages (role tool or tool_calls) and "
                        "the chat template does not render tools; set data.chat_template to one that does, or "
                        "map those roles to user/assistant (roles on this source)"
                    )
        try:
            ids, masks = render(conversations)
        except UserError:
            raise
        except Exception:
            for conversation, row in zip(conversations, indices, strict=True):  # name the row that fails
                try:
                    render([conversation])
                except Exception as exc:
                    raise UserError(f"{key}: row {row + 1}: the chat template failed ({exc})") from None
            raise
        return {"input_ids": ids, "loss_mask": masks}

    return tokenize


def _mask_by_prefixes(
    tokenizer: PreTrainedTokenizerBase, template: str, conversation: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """Assistant-token mask for templates without a {% generation %} block.

    Each assistant turn is the text between the rendering of the conversation before it (with
    the generation prompt) and the rendering up to and including it; tokens whose first
    character falls in such a span are trained on. Templates that rewrite earlier turns
    (so a prefix does not render as a prefix) are refused rather than guessed.
    """

    def text(messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return render(tokenizer, template, messages, prompt)

    full = text(conversation)
    spans = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before, upto = text(conversation[:i], prompt=True) if i else "", text(conversation[: i + 1])
        if not (full.startswith(before) and full.startswith(upto) and len(upto) >= len(before)):
            raise UserError(
                "the chat template does not render conversations prefix by prefix, so assistant turns cannot "
                "be located; use a template with a {% generation %} block (data.chat_template)"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask
