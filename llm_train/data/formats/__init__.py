"""Data formats: the registry, one module per format, keyed by the name a source gives in `format:`.

    base.py         `Format`: what the rest of the package asks a format (fields, tokenise, mask, pairs)
    text.py         text: every token trained on
    instruction.py  instruction: prompt/response rows, loss on the response
    completion.py   completion: TRL's prompt-completion rows (text or messages), loss on the completion
    chat.py         chat: conversations through the chat template, loss on assistant turns
    image_chat.py   image_chat: conversations with images through the model's processor (images.py reads them)
    tokenized.py    tokenized: token ids and optional labels
    preference.py   preference: prompt + chosen + rejected, two rows per pair
    prompt.py       prompt: GRPO's prompts, rendered at start-up
    prompted.py     the steps shared by a prompt followed by trained-on responses
    messages.py     chat templates and rows' messages mapped onto them

A format has two halves, one per layer. The schema half, what a recipe may write for it, is a
pydantic class in config/source_schema.py (config decides without tokenizers, and may not import data).
The behaviour half is a module here: a `Format` subclass bound to that class, answering everything
the package asks about a source (`of(source)`) instead of testing its class. Adding a format: its
class in config/source_schema.py (SOURCE_CLASSES), its module here (FORMATS), one test module, a line in
docs/data.md; tests/unit/test_data_format_registry.py fails while either half is missing.
"""

from __future__ import annotations

from typing import Any

from llm_train.config.source_schema import Source
from llm_train.data.formats.base import Format
from llm_train.data.formats.chat import CHAT
from llm_train.data.formats.completion import COMPLETION
from llm_train.data.formats.image_chat import IMAGE_CHAT
from llm_train.data.formats.instruction import INSTRUCTION
from llm_train.data.formats.preference import PREFERENCE
from llm_train.data.formats.prompt import PROMPT
from llm_train.data.formats.text import TEXT
from llm_train.data.formats.tokenized import TOKENIZED
from llm_train.errors import UserError

# In the order a missing field's hint tries them: the format whose columns say most about a file first.
FORMATS: dict[str, Format[Any]] = {
    f.name: f for f in (PREFERENCE, COMPLETION, IMAGE_CHAT, CHAT, INSTRUCTION, TOKENIZED, TEXT, PROMPT)
}


def of(source: Source) -> Format[Any]:
    """The behaviour of a source's format."""
    return FORMATS[source.format]


def check_fields(columns: list[str], source: Source, key: str, where: str) -> None:
    """Refuse, in one line, a source whose rows lack a field its format needs; name the setting to change and,
    when the columns look like another format, that format."""
    fmt = of(source)
    for name in fmt.required_fields(source):
        if name in columns:
            continue
        looks_like = (f for f in FORMATS.values() if f.looks_like and f.looks_like <= set(columns))
        hint = next((f"; these columns look like format: {f.name}" for f in looks_like), "")
        if hint.endswith(source.format):
            hint = ""
        hint = fmt.column_hint(source, columns) or hint
        raise UserError(
            f"{key}: {where}: no field '{name}' for format {source.format} (fields: {', '.join(columns)}); "
            f"set {fmt.field_keys}{hint}"
        )
