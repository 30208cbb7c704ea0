"""What a data format's behaviour answers (`Format`), and what the formats share: batches, encoders, text.

The rest of the package asks a source's `Format` (formats/__init__.py `of(source)`) instead of
testing its class: which columns it reads, how a batch of rows becomes token ids and a loss mask,
whether a sample is one stored row or a pair of them, whether it reads the chat template, and what
`llm-train data inspect` shows of its mapping. Each format's module subclasses `Format` for its
source class (config/source_schema.py) and overrides what differs from the defaults here.

A tokenise function is a batched `datasets.map` function: rows in, `input_ids` (and `loss_mask`,
1 on the tokens the model is trained to predict) out, one entry per stored row. Rows may be
int32 / uint8 bytes (rows.py) or lists of ints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from llm_train.config.source_schema import Source
from llm_train.data.rows import as_row
from llm_train.data.tokenize_memo import TokenizeMemo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Batch = dict[str, list[Any]]
TokenizeFn = Callable[[Batch, list[int]], Batch]
# encode(texts, add_special_tokens): each text's ids as an int32 row.
Encode = Callable[[list[str], bool], list[bytes]]

S = TypeVar("S", bound=Source)


class Format(Generic[S]):
    """One data format's behaviour, for sources of `source_class` (its `format:` value is the name)."""

    source_class: type[S]
    pairs: bool = False
    """A sample is two stored rows (chosen, then rejected) that are carved, packed and dealt together."""
    loss_mask: bool = True
    """False: every token is trained on and no mask is stored (a pre-training cache a fifth smaller)."""
    uses_chat_template: Literal["never", "always", "when_available"] = "never"
    """Whether its rows are rendered with the chat template: never, always (refused without one), or when
    the recipe or the tokenizer has one (message rows need it; text rows do without)."""
    arrays: bool = False
    """Its tokenise function also returns `arrays`: per row, the model's other inputs (pixel values ...) as
    one `np.savez` blob, stored beside the tokens (store.py) and batched with them (model_inputs.py)."""
    overlong_fix: tuple[str, ...] = ()
    """What an over-long row's refusal tells the user to do, when it differs from packing.py's default."""
    looks_like: frozenset[str] = frozenset()
    """Columns that suggest this format, named when another format's field is missing."""
    field_keys: str = ""
    """The source keys that name its fields, said when one is missing (e.g. 'messages_field')."""

    @property
    def name(self) -> str:
        return str(self.source_class.model_fields["format"].default)

    @property
    def unit(self) -> str:
        """What a sample is called in progress lines."""
        return "pairs" if self.pairs else "rows"

    def required_fields(self, source: S) -> list[str]:
        raise NotImplementedError

    def optional_fields(self, source: S) -> list[str]:
        """Fields read when the data has them."""
        return []

    def fields_read(self, source: S, columns: list[str]) -> list[str]:
        """The columns tokenisation reads: the required fields and the optional ones present."""
        return self.required_fields(source) + [c for c in self.optional_fields(source) if c in columns]

    def column_hint(self, source: S, columns: list[str]) -> str | None:
        """A hint of this format's own for a missing field (instead of 'these columns look like ...')."""
        return None

    def tokenize_fn(
        self,
        source: S,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        """The batched tokenise function; `memo_words`: data.tokenize_memo (make_encoder)."""
        raise NotImplementedError

    def cache_key(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        """What else than the tokenizer and the source's fields decides its tokens (part of the cache key)."""
        return None

    def filler(
        self, source: S, tokenizer: PreTrainedTokenizerBase, chat_template: str | None, key: str
    ) -> bytes | None:
        """Formats with `arrays`: a row that carries one blank image and trains nothing (np.savez blob with its
        `input_ids` and arrays), added to a micro-batch that has no image (model_inputs.py); None: never."""
        return None

    def needs_chat_template(self, configured: str | None, tokenizer: PreTrainedTokenizerBase) -> bool:
        """Whether preparing this source looks up the chat template (data.chat_template or the tokenizer's)."""
        if self.uses_chat_template == "when_available":
            return bool(configured or tokenizer.chat_template)
        return self.uses_chat_template == "always"

    def mapping_lines(
        self, source: S, key: str, first_row: Callable[[], tuple[dict[str, Any], str]]
    ) -> list[str]:
        """What `llm-train data inspect` shows of how the source's rows map onto the format (none by default);
        `first_row()` reads the source's first row and says where from."""
        return []


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


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def column(batch: Batch, name: str, n: int) -> Any:
    """Row n's value of a column, None when the batch has no such column."""
    values = batch.get(name)
    return values[n] if values is not None else None
