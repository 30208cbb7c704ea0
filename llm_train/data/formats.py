"""Per-format tokenisation: a batch of rows in, token ids and a loss mask per sample out.

Each `make_tokenize_fn` result is a batched `datasets.map` function. A sample's `loss_mask`
marks the tokens the model is trained to predict: every token of a text sample; the
response (and its eos) of an instruction sample; the assistant turns of a chat sample;
the tokens whose label is not -100 in a tokenized sample; the response of each side of a
preference pair. Text sources return no mask (all ones), which keeps pre-training caches a
fifth smaller. Text and instruction samples come as rows (rows.py: int32 / uint8 bytes),
chat and tokenized ones as lists of ints.

A preference row becomes two stored rows, chosen then rejected, each the pair's prompt
tokens followed by that response's: row 2k and 2k + 1 of the store are pair k (packing.py
keeps them together).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from llm_train.config.recipe import (
    CHAT_ROLES,
    TOOL_CALL,
    ChatSource,
    InstructionSource,
    PreferenceSource,
    PromptSource,
    Source,
    TextSource,
    TokenizedSource,
)
from llm_train.data.rows import as_row, mask_row, width
from llm_train.data.tokenize_memo import TokenizeMemo
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase

Batch = dict[str, list[Any]]
TokenizeFn = Callable[[Batch, list[int]], Batch]

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Columns that suggest the user meant another format: named in the missing-field error.
_FORMAT_HINTS = (
    ({"chosen", "rejected"}, "preference"),
    ({"messages"}, "chat"),
    ({"instruction", "output"}, "instruction"),
    ({"input_ids"}, "tokenized"),
    ({"text"}, "text"),
)


def required_fields(source: Source) -> list[str]:
    if isinstance(source, TextSource):
        return [source.text_field or "text"]
    if isinstance(source, InstructionSource):
        return [source.prompt_field, source.response_field]
    if isinstance(source, ChatSource):
        return [source.messages_field]
    if isinstance(source, PreferenceSource):
        return [source.chosen_field, source.rejected_field]
    if isinstance(source, PromptSource):
        return [source.prompt_field]
    return [source.input_ids_field]


def fields_read(source: Source, columns: list[str]) -> list[str]:
    """The columns a source's tokenisation reads: its required fields and the optional ones present."""
    optional = []
    if isinstance(source, InstructionSource) and source.input_field:
        optional.append(source.input_field)
    if isinstance(source, TokenizedSource):
        optional.append(source.labels_field)
    if isinstance(source, PreferenceSource):
        optional.append(source.prompt_field)
    if isinstance(source, ChatSource) and source.system_field:
        optional.append(source.system_field)
    return required_fields(source) + [c for c in optional if c in columns]


def check_fields(columns: list[str], source: Source, key: str, where: str) -> None:
    for name in required_fields(source):
        if name in columns:
            continue
        setting = {
            "text": "text_field (or data.text_field)",
            "instruction": "prompt_field / response_field",
            "chat": "messages_field",
            "tokenized": "input_ids_field",
            "preference": "chosen_field / rejected_field",
            "prompt": "prompt_field",
        }[source.format]
        hint = next(
            (
                f"; these columns look like format: {fmt}"
                for cols, fmt in _FORMAT_HINTS
                if cols <= set(columns)
            ),
            "",
        )
        if hint.endswith(source.format):
            hint = ""
        if isinstance(source, ChatSource) and "conversations" in columns and source.preset != "sharegpt":
            hint = "; a 'conversations' column is ShareGPT's shape: set preset: sharegpt on this source"
        raise UserError(
            f"{key}: {where}: no field '{name}' for format {source.format} (fields: {', '.join(columns)}); "
            f"set {setting}{hint}"
        )


Encode = Callable[[list[str], bool], list[bytes]]


def make_encoder(tokenizer: PreTrainedTokenizerBase, memo_words: bool = True) -> Encode:
    """`encode(texts, add_special_tokens)`: each text's ids as a row (int32 bytes, see `as_row`).

    Byte-level BPE tokenizers get a per-word memo (tokenize_memo.py) unless `memo_words` is False
    (data.tokenize_memo); other fast tokenizers their batch encoder without the offsets and Python
    wrappers a plain call builds; slow ones a plain call.
    """
    memo = TokenizeMemo.for_tokenizer(tokenizer) if memo_words else None
    if memo is not None:
        return memo.encode
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda texts, special: list(
            map(as_row, tokenizer(texts, add_special_tokens=special)["input_ids"])
        )
    batch_encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return lambda texts, special: [as_row(e.ids) for e in batch_encode(texts, add_special_tokens=special)]


def make_tokenize_fn(
    source: Source,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    key: str,
    memo_words: bool = True,
) -> TokenizeFn:
    """`memo_words`: data.tokenize_memo (make_encoder)."""
    if isinstance(source, TextSource):
        return _text_fn(source, tokenizer, make_encoder(tokenizer, memo_words))
    if isinstance(source, InstructionSource):
        return _instruction_fn(source, tokenizer, make_encoder(tokenizer, memo_words))
    if isinstance(source, ChatSource):
        return _chat_fn(source, tokenizer, chat_template, key)
    if isinstance(source, PreferenceSource):
        return _preference_fn(source, tokenizer, chat_template, key, make_encoder(tokenizer, memo_words))
    if isinstance(source, PromptSource):
        # Prompts are rendered when the run starts (data/prompts.py), never tokenised and packed ahead.
        raise UserError(
            f"{key} is format prompt: its prompts are read by objective grpo, not tokenised ahead"
        )
    return _tokenized_fn(source, tokenizer, key)


def has_loss_mask(source: Source) -> bool:
    return not isinstance(source, TextSource)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _text_fn(source: TextSource, tokenizer: PreTrainedTokenizerBase, encode: Encode) -> TokenizeFn:
    field, eos = source.text_field or "text", as_row([tokenizer.eos_token_id])

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        texts = [_as_text(t) for t in batch[field]]
        rows = encode(texts, True)
        # eos ends every document so the model learns where one stops; blank documents are dropped.
        ids = [
            row + eos if text and not text.isspace() else b"" for row, text in zip(rows, texts, strict=True)
        ]
        return {"input_ids": ids}

    return tokenize


def _instruction_fn(
    source: InstructionSource, tokenizer: PreTrainedTokenizerBase, encode: Encode
) -> TokenizeFn:
    eos = as_row([tokenizer.eos_token_id])

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        n = len(indices)
        extra = batch.get(source.input_field) if source.input_field else None
        inputs = [_as_text(v) for v in extra] if extra is not None else [""] * n
        prompts = [
            source.prompt_template.format(prompt=_as_text(p) + (f"\n\n{i}" if i.strip() else ""))
            for p, i in zip(batch[source.prompt_field], inputs, strict=True)
        ]
        responses = [_as_text(r) for r in batch[source.response_field]]
        # Prompt and response are tokenised apart so the boundary is exact (no merge across it).
        prompt_rows = encode(prompts, True)
        response_rows = encode(responses, False)
        ids, masks = [], []
        for p, r, text in zip(prompt_rows, response_rows, responses, strict=True):
            if not text.strip():
                ids.append(b"")
                masks.append(b"")
                continue
            ids.append(p + r + eos)
            masks.append(mask_row(width(p), width(r) + 1))
        return {"input_ids": ids, "loss_mask": masks}

    return tokenize


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
    def of(cls, source: ChatSource) -> ChatMapping:
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
        [{"role": "system", "content": _as_text(system)}] if _as_text(system).strip() else []
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
        value = _as_text(present.pop(mapping.role_field))
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


def _uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


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
                if _uses_tools(conversation):
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
        rendered = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
        )
        return cast(str, rendered)  # tokenize=False: the text (the annotation is the union over every option)

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


def _tokenized_fn(source: TokenizedSource, tokenizer: PreTrainedTokenizerBase, key: str) -> TokenizeFn:
    import numpy as np

    vocab = len(tokenizer)

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        all_labels = batch.get(source.labels_field)
        ids_out, masks = [], []
        for n, row in enumerate(indices):
            ids = np.asarray(batch[source.input_ids_field][n] or [], dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise UserError(
                    f"{key}: row {row + 1}: token id {int(ids.max() if ids.max() >= vocab else ids.min())} "
                    f"is outside the tokenizer's vocabulary (0..{vocab - 1})"
                )
            labels = all_labels[n] if all_labels is not None else None
            if labels is None:
                mask = np.ones_like(ids)
            else:
                lab = np.asarray(labels, dtype=np.int64)
                if lab.shape != ids.shape:
                    raise UserError(
                        f"{key}: row {row + 1}: {len(lab)} labels for {len(ids)} input_ids; they must match"
                    )
                if not ((lab == -100) | (lab == ids)).all():
                    raise UserError(
                        f"{key}: row {row + 1}: labels must equal input_ids or be -100 (the model shifts them)"
                    )
                mask = (lab != -100).astype(np.int64)
            ids_out.append(ids.tolist())
            masks.append(mask.tolist())
        return {"input_ids": ids_out, "loss_mask": masks}

    return tokenize


def _preference_fn(
    source: PreferenceSource,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    key: str,
    encode: Encode,
) -> TokenizeFn:
    """Two rows per pair (chosen, rejected): the shared prompt's tokens, then the response's, trained on.

    Text pairs: the prompt goes through `prompt_template` and is encoded with the tokenizer's
    special tokens (bos); each response is encoded without them and ends with eos. Message pairs
    (any of the three fields a list) are rendered with the chat template: the prompt with the
    generation prompt, each response as the text the template adds for that assistant message
    (its end-of-turn token included). Prompt and response are encoded apart, as TRL does, so the
    two sequences share the prompt's tokens exactly and the boundary never merges across.
    """
    eos = as_row([tokenizer.eos_token_id])
    template = chat_template

    def render(messages: list[dict[str, Any]], prompt: bool) -> str:
        nonlocal template
        if template is None:  # raises the one-line "no chat template" error of chat sources
            template = chat_template_for(tokenizer, None, key)
        rendered = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
        )
        return cast(str, rendered)  # tokenize=False: the text (the annotation is the union over every option)

    def field(batch: Batch, name: str, n: int) -> Any:
        column = batch.get(name)
        return column[n] if column is not None else None

    def split_pair(batch: Batch, n: int, row: int) -> tuple[str, bool, str, str]:
        """(prompt text, prompt carries special tokens, chosen text, rejected text) of one row."""
        where = f"{key}: row {row + 1}"
        prompt = field(batch, source.prompt_field, n)
        sides = {
            "chosen": field(batch, source.chosen_field, n),
            "rejected": field(batch, source.rejected_field, n),
        }
        names = {"chosen": source.chosen_field, "rejected": source.rejected_field}
        for side, value in sides.items():
            if value is None:
                raise UserError(
                    f"{where}: no '{names[side]}' (the {side} response); every pair needs {source.chosen_field} "
                    f"and {source.rejected_field}: fill it in or remove the row"
                )
        chosen, rejected = sides["chosen"], sides["rejected"]
        if isinstance(chosen, list) != isinstance(rejected, list):
            raise UserError(
                f"{where}: {source.chosen_field} and {source.rejected_field} must both be text or both be message "
                "lists"
            )
        if not isinstance(chosen, list) and not isinstance(prompt, list):
            if prompt is None:
                raise UserError(
                    f"{where}: no '{source.prompt_field}' (the prompt); text pairs need one (set prompt_field)"
                )
            for side, value in sides.items():
                if not _as_text(value).strip():
                    raise UserError(f"{where}: the {side} response is empty; fill it in or remove the pair")
            text = source.prompt_template.format(prompt=_as_text(prompt))
            return text, True, _as_text(chosen), _as_text(rejected)
        # Message form: the responses are each conversation's last (assistant) message.
        turns = {side: _side_messages(v, row, key) for side, v in sides.items()}
        context = turns["chosen"][:-1]
        if context != turns["rejected"][:-1]:
            raise UserError(
                f"{where}: the chosen and rejected conversations differ before their last message; a pair "
                "shares one prompt"
            )
        if not context:
            if prompt is None:
                raise UserError(
                    f"{where}: no '{source.prompt_field}' and the responses carry no conversation before them; "
                    "give the prompt"
                )
            context = (
                map_messages(prompt, row, key)
                if isinstance(prompt, list)
                else [{"role": "user", "content": _as_text(prompt)}]
            )
        prompt_text = render(context, prompt=True)
        texts = []
        for side, messages in turns.items():
            last = messages[-1]
            if last["role"] != "assistant":
                raise UserError(
                    f"{where}: the {side} conversation ends with a '{last['role']}' message; its last message "
                    "must be the assistant's response"
                )
            if not _as_text(last["content"]).strip():
                raise UserError(f"{where}: the {side} response is empty; fill it in or remove the pair")
            full = render([*context, last], prompt=False)
            if not full.startswith(prompt_text):
                raise UserError(
                    f"{where}: the chat template does not render the prompt as a prefix of the conversation, so "
                    "the response cannot be located; use another data.chat_template"
                )
            texts.append(full[len(prompt_text) :])
        return prompt_text, False, texts[0], texts[1]

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        pairs = [split_pair(batch, n, row) for n, row in enumerate(indices)]
        with_special = [(n, p) for n, (p, special, _, _) in enumerate(pairs) if special]
        without = [(n, p) for n, (p, special, _, _) in enumerate(pairs) if not special]
        prompts: dict[int, bytes] = {}
        for group, special in ((with_special, True), (without, False)):
            if group:
                prompts.update(
                    zip([n for n, _ in group], encode([p for _, p in group], special), strict=True)
                )
        responses = encode([text for _, _, c, r in pairs for text in (c, r)], False)
        ids, masks = [], []
        for n, row in enumerate(indices):
            prompt = prompts[n]
            if width(prompt) == 0:
                raise UserError(
                    f"{key}: row {row + 1}: the prompt is empty (0 tokens); the responses are scored given a "
                    "prompt: fill it in or remove the pair"
                )
            # Text responses end with eos like instruction responses; templates end the turn themselves.
            end = eos if pairs[n][1] else b""
            for response in responses[2 * n : 2 * n + 2]:
                ids.append(prompt + response + end)
                masks.append(mask_row(width(prompt), width(response + end)))
        return {"input_ids": ids, "loss_mask": masks}

    return tokenize


def _side_messages(value: Any, row: int, key: str) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return map_messages(value, row, key)
    return [{"role": "assistant", "content": _as_text(value)}]  # a text response after a message prompt
