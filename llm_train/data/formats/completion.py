"""`format: completion`: TRL's prompt-completion rows (`{prompt, completion}`); loss only on the completion.

Text rows train like an instruction without its template: the prompt (in `prompt_template`, with the
tokenizer's special tokens), then the completion and eos. Conversational rows (TRL's form: both
fields lists of {role, content} messages) are rendered with the chat template: the prompt with the
generation prompt, the completion as the text the template adds for its messages (every completion
message is trained on, as TRL's completion-only loss does). A row whose completion is empty is dropped.
"""

from __future__ import annotations

from llm_train.config.source_schema import CompletionSource
from llm_train.data.formats.base import Batch, as_text, column
from llm_train.data.formats.messages import ChatMapping
from llm_train.data.formats.prompted import (
    ChatRenderer,
    Prompted,
    PromptedFormat,
    prompt_messages,
    response_messages,
)
from llm_train.errors import UserError


class Completion(PromptedFormat[CompletionSource]):
    source_class = CompletionSource
    uses_chat_template = "when_available"
    looks_like = frozenset({"prompt", "completion"})
    field_keys = "prompt_field / completion_field"

    def required_fields(self, source: CompletionSource) -> list[str]:
        return [source.prompt_field, source.completion_field]

    def sample(
        self, source: CompletionSource, renderer: ChatRenderer, batch: Batch, n: int, row: int, key: str
    ) -> Prompted | None:
        """One row as prompt and completion text; None when the completion is empty (nothing to train on)."""
        where = f"{key}: row {row + 1}"
        prompt, completion = column(batch, source.prompt_field, n), column(batch, source.completion_field, n)
        if prompt is None:
            raise UserError(f"{where}: no '{source.prompt_field}' (the prompt); fill it in or remove the row")
        if not isinstance(prompt, list) and not isinstance(completion, list):
            if not as_text(completion).strip():
                return None
            return Prompted(
                source.prompt_template.format(prompt=as_text(prompt)), True, (as_text(completion),)
            )
        if completion == []:
            return None
        context = prompt_messages(prompt, row, key, ChatMapping(messages_field=source.prompt_field))
        messages = response_messages(
            completion, row, key, ChatMapping(messages_field=source.completion_field)
        )
        if not any(as_text(m.get("content")).strip() or m.get("tool_calls") for m in messages):
            return None
        prompt_text = renderer(context, generation_prompt=True)
        return Prompted(
            prompt_text, False, (renderer.after_prompt(prompt_text, [*context, *messages], where),)
        )


COMPLETION = Completion()
