"""`format: instruction`: prompt/response rows (alpaca-style by default); loss only on the response and its eos."""

from __future__ import annotations

from llm_train.config.source_schema import InstructionSource
from llm_train.data.formats.base import Batch, as_text, column
from llm_train.data.formats.prompted import ChatRenderer, Prompted, PromptedFormat


class Instruction(PromptedFormat[InstructionSource]):
    source_class = InstructionSource
    looks_like = frozenset({"instruction", "output"})
    field_keys = "prompt_field / response_field"

    def required_fields(self, source: InstructionSource) -> list[str]:
        return [source.prompt_field, source.response_field]

    def optional_fields(self, source: InstructionSource) -> list[str]:
        return [source.input_field] if source.input_field else []

    def sample(
        self, source: InstructionSource, renderer: ChatRenderer, batch: Batch, n: int, row: int, key: str
    ) -> Prompted | None:
        """The prompt (+ blank line + input) in its template, and the response; None when it is empty."""
        response = as_text(batch[source.response_field][n])
        if not response.strip():
            return None
        extra = as_text(column(batch, source.input_field, n)) if source.input_field else ""
        prompt = as_text(batch[source.prompt_field][n]) + (f"\n\n{extra}" if extra.strip() else "")
        return Prompted(source.prompt_template.format(prompt=prompt), True, (response,))


INSTRUCTION = Instruction()
