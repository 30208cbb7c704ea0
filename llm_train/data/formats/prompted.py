"""A prompt, then responses trained on: the steps the instruction, completion and preference formats share.

A `PromptedFormat` says how one row splits (`sample`); tokenising is then the same four steps for
all: split every row, encode prompts and responses, let the format refuse what it cannot train
(`check_encoded`), store the rows. Each row becomes a `Prompted`: the prompt's text and the text of each
response after it. Text rows:
the prompt is encoded with the tokenizer's special tokens (bos) and each response ends with eos.
Message rows are rendered with the chat template (`ChatRenderer`): the prompt with the generation
prompt, each response as the text the template adds after it (its end-of-turn token included).
Prompts and responses are encoded apart, as TRL does, so every response of a row follows the same
prompt tokens and no token merges across the boundary; each response becomes one stored row,
prompt + response, with the loss mask on the response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llm_train.data.formats.base import Batch, Encode, Format, S, TokenizeFn, as_text, make_encoder
from llm_train.data.formats.messages import OPENAI, ChatMapping, chat_template_for, map_messages, render
from llm_train.data.rows import as_row, mask_row, width
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompted:
    """One row as text: its prompt and the responses that follow it."""

    prompt: str
    text_row: bool  # the prompt takes the tokenizer's special tokens and each response ends with eos
    responses: tuple[str, ...]


# Per sample: its prompt row and its response rows (int32 bytes), None for a dropped sample.
Encoded = list[tuple[bytes, list[bytes]] | None]


class ChatRenderer:
    """Message rows through the chat template, looked up on first use (text rows never need one)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None, key: str) -> None:
        self.tokenizer, self.template, self.key = tokenizer, chat_template, key

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        if self.template is None:  # raises the one-line "no chat template" error of chat sources
            self.template = chat_template_for(self.tokenizer, None, self.key)
        return render(self.tokenizer, self.template, messages, generation_prompt)

    def after_prompt(self, prompt_text: str, conversation: list[dict[str, Any]], where: str) -> str:
        """The text the template adds after `prompt_text` (the context with its generation prompt) for the
        rest of `conversation`: a response, located exactly or refused in one line."""
        full = self(conversation, generation_prompt=False)
        if not full.startswith(prompt_text):
            raise UserError(
                f"{where}: the chat template does not render the prompt as a prefix of the conversation, so "
                "the response cannot be located; use another data.chat_template"
            )
        return full[len(prompt_text) :]


def prompt_messages(value: Any, row: int, key: str, mapping: ChatMapping = OPENAI) -> list[dict[str, Any]]:
    """A prompt as messages: a list mapped as the template reads it, a text as one user message."""
    if isinstance(value, list):
        return map_messages(value, row, key, mapping)
    return [{"role": "user", "content": as_text(value)}]


def response_messages(value: Any, row: int, key: str, mapping: ChatMapping = OPENAI) -> list[dict[str, Any]]:
    """A response as messages: a list mapped as the template reads it, a text (after a message prompt) as one
    assistant message."""
    if isinstance(value, list):
        return map_messages(value, row, key, mapping)
    return [{"role": "assistant", "content": as_text(value)}]


def encode_prompted(samples: Sequence[Prompted | None], encode: Encode) -> Encoded:
    """Each sample's prompt row and response rows (None for a dropped sample): a batched call per kind."""
    prompts: dict[int, bytes] = {}
    for special in (True, False):
        group = [(n, s) for n, s in enumerate(samples) if s is not None and s.text_row == special]
        if group:
            rows = encode([s.prompt for _, s in group], special)
            prompts.update(zip([n for n, _ in group], rows, strict=True))
    texts = [text for s in samples if s is not None for text in s.responses]
    responses = iter(encode(texts, False) if texts else [])
    return [
        None if s is None else (prompts[n], [next(responses) for _ in s.responses])
        for n, s in enumerate(samples)
    ]


def stored_rows(samples: Sequence[Prompted | None], encoded: Encoded, eos: bytes) -> Batch:
    """Prompt + response per response, the mask on the response (and the eos that ends a text row's); one
    empty row for a dropped sample."""
    ids, masks = [], []
    for sample, rows in zip(samples, encoded, strict=True):
        if sample is None or rows is None:
            ids.append(b"")
            masks.append(b"")
            continue
        prompt, responses = rows
        end = eos if sample.text_row else b""  # templates end the turn themselves
        for response in responses:
            ids.append(prompt + response + end)
            masks.append(mask_row(width(prompt), width(response + end)))
    return {"input_ids": ids, "loss_mask": masks}


class PromptedFormat(Format[S]):
    """A format whose row is a prompt followed by responses trained on: it says how a row splits."""

    def sample(
        self, source: S, renderer: ChatRenderer, batch: Batch, n: int, row: int, key: str
    ) -> Prompted | None:
        """Row n of the batch (row `row` of the source) as text; None drops it (nothing to train on)."""
        raise NotImplementedError

    def check_encoded(self, encoded: Encoded, indices: list[int], key: str) -> None:
        """Refuse, in one line, an encoded row this format cannot train (none by default)."""

    def tokenize_fn(
        self,
        source: S,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        encode, eos = make_encoder(tokenizer, memo_words), as_row([tokenizer.eos_token_id])
        renderer = ChatRenderer(tokenizer, chat_template, key)

        def tokenize(batch: Batch, indices: list[int]) -> Batch:
            samples = [self.sample(source, renderer, batch, n, row, key) for n, row in enumerate(indices)]
            encoded = encode_prompted(samples, encode)
            self.check_encoded(encoded, indices, key)
            return stored_rows(samples, encoded, eos)

        return tokenize
