"""`format: tokenized`: rows that already hold token ids, and optionally labels (-100 where not trained on)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_train.config.source_schema import TokenizedSource
from llm_train.data.formats.base import Batch, Format, TokenizeFn
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenized(Format[TokenizedSource]):
    source_class = TokenizedSource
    looks_like = frozenset({"input_ids"})
    field_keys = "input_ids_field"

    def required_fields(self, source: TokenizedSource) -> list[str]:
        return [source.input_ids_field]

    def optional_fields(self, source: TokenizedSource) -> list[str]:
        return [source.labels_field]

    def tokenize_fn(
        self,
        source: TokenizedSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        return _tokenized_fn(source, tokenizer, key)


TOKENIZED = Tokenized()


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
