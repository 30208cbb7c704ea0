"""`format: text`: raw text for (continued) pre-training; every token is trained on, so no mask is stored."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_train.config.source_schema import TextSource
from llm_train.data.formats.base import Batch, Format, TokenizeFn, as_text, make_encoder
from llm_train.data.rows import as_row

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Text(Format[TextSource]):
    source_class = TextSource
    loss_mask = False
    looks_like = frozenset({"text"})
    field_keys = "text_field (or data.text_field)"

    def required_fields(self, source: TextSource) -> list[str]:
        return [source.text_field or "text"]

    def tokenize_fn(
        self,
        source: TextSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        encode = make_encoder(tokenizer, memo_words)
        field, eos = source.text_field or "text", as_row([tokenizer.eos_token_id])

        def tokenize(batch: Batch, indices: list[int]) -> Batch:
            texts = [as_text(t) for t in batch[field]]
            rows = encode(texts, True)
            # eos ends every document so the model learns where one stops; blank documents are dropped.
            ids = [
                row + eos if text and not text.isspace() else b""
                for row, text in zip(rows, texts, strict=True)
            ]
            return {"input_ids": ids}

        return tokenize


TEXT = Text()
