"""`format: prompt`: prompts for online RL (objective grpo), rendered when the run starts, never tokenised ahead.

A prompt is text (wrapped in the source's `prompt_template`, tokenised with the tokenizer's special
tokens, as generation is prompted) or a list of {role, content} messages (rendered with the chat
template and its generation prompt). data/prompts.py reads the rows and deals them; `render_prompt`
is this format's tokenisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llm_train.config.source_schema import PromptSource
from llm_train.data.formats.base import Format, TokenizeFn
from llm_train.data.formats.messages import render
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Prompt(Format[PromptSource]):
    source_class = PromptSource
    field_keys = "prompt_field"

    def required_fields(self, source: PromptSource) -> list[str]:
        return [source.prompt_field]

    def tokenize_fn(
        self,
        source: PromptSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        raise UserError(
            f"{key} is format prompt: its prompts are read by objective grpo, not tokenised ahead"
        )


PROMPT = Prompt()


def render_prompt(
    value: Any,
    source: PromptSource,
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    key: str,
    row: int,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: text in its template with special tokens, or messages through the chat template."""
    if isinstance(value, list):
        if not template:
            raise UserError(
                f"{key}: row {row}'s prompt is a list of messages but the tokenizer has no chat template; set "
                "data.chat_template"
            )
        text = render(tokenizer, template, value, generation_prompt=True, template_kwargs=template_kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(value, str):
        raise UserError(
            f"{key}: row {row}'s {source.prompt_field} is a {type(value).__name__}; give text or a list of messages"
        )
    return list(tokenizer(source.prompt_template.format(prompt=value))["input_ids"])
