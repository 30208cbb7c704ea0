"""`format: preference`: a prompt with a chosen and a rejected response (objectives dpo, simpo, reward).

A row becomes two stored rows, chosen then rejected, each the pair's prompt tokens followed by that
response's, the loss mask on the response: rows 2k and 2k + 1 of the store are pair k (packing.py
keeps them together). Text pairs: the prompt goes through `prompt_template` with the tokenizer's
special tokens (bos), each response ends with eos. Message pairs (any of the three fields a list of
messages) are rendered with the chat template (prompted.py); when `chosen` and `rejected` are whole
conversations (HuggingFaceH4/ultrafeedback_binarized's train_prefs) the prompt is what they share
before their last (assistant) message.
"""

from __future__ import annotations

from typing import Any

from llm_train.config.source_schema import PreferenceSource
from llm_train.data.formats.base import Batch, as_text, column
from llm_train.data.formats.prompted import (
    ChatRenderer,
    Encoded,
    Prompted,
    PromptedFormat,
    prompt_messages,
    response_messages,
)
from llm_train.data.rows import width
from llm_train.errors import UserError

SIDES = ("chosen", "rejected")


class Preference(PromptedFormat[PreferenceSource]):
    source_class = PreferenceSource
    pairs = True
    uses_chat_template = "when_available"
    looks_like = frozenset({"chosen", "rejected"})
    field_keys = "chosen_field / rejected_field"

    def required_fields(self, source: PreferenceSource) -> list[str]:
        return [source.chosen_field, source.rejected_field]

    def optional_fields(self, source: PreferenceSource) -> list[str]:
        return [source.prompt_field]

    def sample(
        self, source: PreferenceSource, renderer: ChatRenderer, batch: Batch, n: int, row: int, key: str
    ) -> Prompted:
        """One row as its prompt and its (chosen, rejected) responses: text, or rendered messages."""
        where = f"{key}: row {row + 1}"
        prompt = column(batch, source.prompt_field, n)
        sides = _sides(source, batch, n, where)
        if not isinstance(sides["chosen"], list) and not isinstance(prompt, list):
            return _text_pair(source, prompt, sides, where)
        return _message_pair(source, renderer, prompt, sides, row, key)

    def check_encoded(self, encoded: Encoded, indices: list[int], key: str) -> None:
        for rows, row in zip(encoded, indices, strict=True):
            if rows is not None and width(rows[0]) == 0:
                raise UserError(
                    f"{key}: row {row + 1}: the prompt is empty (0 tokens); the responses are scored given a "
                    "prompt: fill it in or remove the pair"
                )


PREFERENCE = Preference()


def _sides(source: PreferenceSource, batch: Batch, n: int, where: str) -> dict[str, Any]:
    """The chosen and rejected values, both present and both text or both messages."""
    fields = {"chosen": source.chosen_field, "rejected": source.rejected_field}
    sides = {side: column(batch, fields[side], n) for side in SIDES}
    for side, value in sides.items():
        if value is None:
            raise UserError(
                f"{where}: no '{fields[side]}' (the {side} response); every pair needs {source.chosen_field} "
                f"and {source.rejected_field}: fill it in or remove the row"
            )
    if isinstance(sides["chosen"], list) != isinstance(sides["rejected"], list):
        raise UserError(
            f"{where}: {source.chosen_field} and {source.rejected_field} must both be text or both be message "
            "lists"
        )
    return sides


def _text_pair(source: PreferenceSource, prompt: Any, sides: dict[str, Any], where: str) -> Prompted:
    if prompt is None:
        raise UserError(
            f"{where}: no '{source.prompt_field}' (the prompt); text pairs need one (set prompt_field)"
        )
    for side, value in sides.items():
        if not as_text(value).strip():
            raise UserError(f"{where}: the {side} response is empty; fill it in or remove the pair")
    text = source.prompt_template.format(prompt=as_text(prompt))
    return Prompted(text, True, tuple(as_text(sides[side]) for side in SIDES))


def _message_pair(
    source: PreferenceSource, renderer: ChatRenderer, prompt: Any, sides: dict[str, Any], row: int, key: str
) -> Prompted:
    """The responses are each conversation's last (assistant) message; the prompt is what comes before."""
    where = f"{key}: row {row + 1}"
    turns = {side: response_messages(value, row, key) for side, value in sides.items()}
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
        context = prompt_messages(prompt, row, key)
    prompt_text = renderer(context, generation_prompt=True)
    responses = []
    for side, messages in turns.items():
        last = messages[-1]
        if last["role"] != "assistant":
            raise UserError(
                f"{where}: the {side} conversation ends with a '{last['role']}' message; its last message "
                "must be the assistant's response"
            )
        if not as_text(last["content"]).strip():
            raise UserError(f"{where}: the {side} response is empty; fill it in or remove the pair")
        responses.append(renderer.after_prompt(prompt_text, [*context, last], where))
    return Prompted(prompt_text, False, tuple(responses))
