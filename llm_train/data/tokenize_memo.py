r"""Byte-level BPE tokenisation memoised per word: the fast tokenizer's exact ids, several times sooner.

A byte-level BPE tokenizer (GPT-2, Llama 3, the bundled tiny one) cuts text with a regex into
pre-tokens and runs BPE on each one alone, so a text's ids are its pre-tokens' ids end to end.
Wherever no pre-token can reach across a position, the text can be cut there and the pieces
tokenised alone. For the regexes in `_CUTS`:

- a space followed by a non-whitespace character always starts a pre-token (the branches that
  take a space take it first, and a whitespace run gives up its last space to the word after
  it). `text.split(" ")` makes these cuts at C speed, and text repeats its words: the 50 MB
  benchmark corpus has 6.3 million such units but only 110 thousand distinct ones.
- a unit seen for the first time is cut further before it goes to the tokenizer. An ASCII
  unit is cut into its pre-tokens by the regex's ASCII form (`_ASCII_PRE_TOKENS`: on ASCII
  text \p{L} is [A-Za-z] and \p{N} [0-9] for both regex engines); code and names repeat as
  pre-tokens far more than as units. Any other unit is cut where a whitespace run starts
  after a character no pre-token ends on whitespace after: any non-whitespace character for
  GPT-2; a letter or digit for Llama 3 and Qwen2, whose punctuation branch also takes the
  newlines after it ("type.\n\nFor" is learnt as "type." and "\n\nFor").

The Rust tokenizer spends ~2 us on each pre-token (regex, byte mapping, a locked cache,
Encoding objects with offsets); a dict lookup costs a fraction of that. Every piece the memo
has not seen is tokenised by the tokenizer itself, so only the cutting is done here.

`TokenizeMemo.for_tokenizer` returns None unless the pipeline is exactly: no normalizer, one
of those regexes in a ByteLevel (or Split then ByteLevel) pre-tokenizer, BPE without dropout,
no truncation or padding, and a post-processor that only puts fixed ids around a text. A text
containing an added token (special tokens, chat markers) is encoded by the tokenizer itself.
tests/unit/test_tokenize_memo.py compares the ids with the tokenizer's on adversarial text and
checks the whitespace classes and ASCII forms below against the tokenizer's own regex engine.
"""

from __future__ import annotations

import json
import re
from itertools import chain, islice
from typing import TYPE_CHECKING, Any

from llm_train.data.rows import as_row

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Python's \s is str.isspace(). The four extra characters are ones some Unicode version called
# whitespace although isspace() does not; the ASCII whitespace set is whitespace for every engine.
# Erring towards "whitespace" only means fewer cuts, which is always safe.
_NOT_SPACE = r"[^\s\u180e\u200b\u2060\ufeff]"
_ASCII_SPACE = r"[\t\n\r\x0b\x0c ]"
_CUT = re.compile(rf" (?={_NOT_SPACE})")
_SPACE_BEFORE_SPACE = re.compile(rf" (?!{_NOT_SPACE})")  # a space followed by whitespace or the end
# Per supported regex: where a learnt unit may be cut again (zero-width: before a whitespace run).
_AFTER_ALNUM = re.compile(rf"(?<=[A-Za-z0-9])(?={_ASCII_SPACE})")
_CUTS = {
    _GPT2: re.compile(rf"(?<={_NOT_SPACE})(?={_ASCII_SPACE})"),
    _LLAMA3: _AFTER_ALNUM,
    _QWEN2: _AFTER_ALNUM,
}
_INNER_SPACE = re.compile(_ASCII_SPACE)
# Per supported regex, its exact equivalent on ASCII text (\p{L} is [A-Za-z] there, \p{N} [0-9], and
# \s the same six characters for both engines): new ASCII units are cut into their pre-tokens,
# which repeat far more than units do in text with many distinct words (code, names, numbers).
_ASCII_PRE_TOKENS = {
    _GPT2: re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII
    ),
    _LLAMA3: re.compile(
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*|"""
        r"""\s*[\r\n]+|\s+(?!\S)|\s+""",
        re.ASCII,
    ),
    _QWEN2: re.compile(
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|"""
        r"""\s*[\r\n]+|\s+(?!\S)|\s+""",
        re.ASCII,
    ),
}
# Distinct units and pieces kept; past this the memo starts over. ~460 bytes each (measured), so
# at most ~240 MB per tokenising process.
_MAX_ENTRIES = 1 << 19


def _pre_token_pattern(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The regex a byte-level pre-tokenizer cuts text with, or None for any other pre-tokenizer."""
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        uses_regex = pre_tokenizer.get("use_regex", True)
        return _GPT2 if uses_regex and not pre_tokenizer.get("add_prefix_space") else None
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return (split.get("pattern") or {}).get("Regex")


def _post_affixes(backend: Tokenizer) -> tuple[bytes, bytes] | None:
    """(prefix, suffix): the ids the post-processor puts around every single text, or None if they vary."""
    found = set()
    for probe in ("a", "Hello world", " 12 !"):
        plain = backend.encode(probe, add_special_tokens=False).ids
        full = backend.encode(probe, add_special_tokens=True).ids
        starts = [k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain]
        if not starts:
            return None
        found.add((as_row(full[: starts[0]]), as_row(full[starts[0] + len(plain) :])))
    return found.pop() if len(found) == 1 else None


# A text whose units are not all memoised yet: (its index in the batch, its units, the row found
# per unit with None where a unit is new).
_Pending = tuple[int, list[str], list[bytes | None]]


def _holes(found: list[bytes | None]) -> list[int]:
    """Positions of the Nones, by list.index (C speed: most of the list is skipped, not looped over)."""
    holes, k = [], -1
    try:
        while True:
            k = found.index(None, k + 1)
            holes.append(k)
    except ValueError:
        return holes


class TokenizeMemo:
    """`encode(texts, special)`: the ids `backend.encode_batch_fast` gives, as rows, from memoised units.

    Ids are kept and returned as int32 bytes (`as_row`): joining a text's units is then one
    memory copy, and the rows go into the cache's arrays without passing through Python ints.
    """

    def __init__(self, backend: Tokenizer, pattern: str, added: list[str], affixes: tuple[bytes, bytes]):
        self._backend = backend
        self._cut_again = _CUTS[pattern]
        self._ascii_pre_tokens = _ASCII_PRE_TOKENS[pattern]
        self._prefix, self._suffix = affixes
        # Longest first, so a token that contains another is found whole.
        self._added = (
            re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None
        )
        self._added_starts = frozenset(token[0] for token in added)
        self._first: dict[str, bytes] = {}  # a text's first unit -> its row
        self._spaced: dict[str, bytes] = {}  # any later unit, without its leading space -> its row
        self._pieces: dict[str, bytes] = {}  # what _cut_again makes of learnt units -> their rows

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenizeMemo | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        spec = json.loads(backend.to_str())
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
            return None
        pattern = _pre_token_pattern(spec.get("pre_tokenizer"))
        affixes = _post_affixes(backend) if pattern in _CUTS else None
        if pattern is None or affixes is None:
            return None
        added = [t["content"] for t in spec.get("added_tokens", []) if t["content"]]
        return cls(backend, pattern, added, affixes)

    def encode(self, texts: list[str], special: bool) -> list[bytes]:
        out: list[bytes] = [b""] * len(texts)
        pending: list[_Pending] = []
        by_tokenizer: list[int] = []
        spaced = self._spaced.get
        for i, text in enumerate(texts):
            if self._has_added_token(text):
                by_tokenizer.append(i)
                continue
            units = _units(text)
            # One lookup per unit; a unit not seen yet leaves a None, which join() refuses.
            found = [self._first.get(units[0]), *map(spaced, islice(units, 1, None))]
            try:
                out[i] = b"".join(found)  # type: ignore[arg-type]
            except TypeError:
                pending.append((i, units, found))
        if pending:
            self._learn(pending)
            for i, _, found in pending:
                out[i] = b"".join(found)  # type: ignore[arg-type]  # holes filled by _learn
        if special and (self._prefix or self._suffix):
            out = [self._prefix + row + self._suffix for row in out]
        if by_tokenizer:
            encoded = self._backend.encode_batch_fast(
                [texts[i] for i in by_tokenizer], add_special_tokens=special
            )
            for i, encoding in zip(by_tokenizer, encoded, strict=True):
                out[i] = as_row(encoding.ids)
        return out

    def _has_added_token(self, text: str) -> bool:
        # A cheap test for the first characters before the regex: most texts have none of them.
        return (
            self._added is not None
            and any(c in text for c in self._added_starts)
            and self._added.search(text) is not None
        )

    def _learn(self, pending: list[_Pending]) -> None:
        """Tokenise every unit the pending texts miss, and fill their holes."""
        if len(self._first) + len(self._spaced) + len(self._pieces) > _MAX_ENTRIES:
            self._first.clear()
            self._spaced.clear()
            self._pieces.clear()
        holes = [_holes(found) for _, _, found in pending]
        first_set: set[str] = set()
        spaced_set: set[str] = set()
        for (_, units, _), where in zip(pending, holes, strict=True):
            spaced_set.update(units[k] for k in where if k)
            if where[0] == 0:
                first_set.add(units[0])
        first, spaced = list(first_set), list(spaced_set)
        rows = self._tokenize([*first, *(" " + unit for unit in spaced)])
        self._first.update(zip(first, rows[: len(first)], strict=True))
        self._spaced.update(zip(spaced, rows[len(first) :], strict=True))
        for (_, units, found), where in zip(pending, holes, strict=True):
            for k in where:
                found[k] = self._spaced[units[k]] if k else self._first[units[0]]

    def _tokenize(self, units: list[str]) -> list[bytes]:
        """Rows of new units, from their pieces; the pieces not seen yet are tokenised in one batch."""
        pieces = [self._pieces_of(unit) for unit in units]
        new = list(set(chain.from_iterable(pieces)).difference(self._pieces))
        encoded = self._backend.encode_batch_fast(new, add_special_tokens=False)
        self._pieces.update(zip(new, (as_row(e.ids) for e in encoded), strict=True))
        return [b"".join(map(self._pieces.__getitem__, cut)) for cut in pieces]

    def _pieces_of(self, unit: str) -> list[str]:
        if unit.isascii():
            pre_tokens = self._ascii_pre_tokens.findall(unit)
            if sum(map(len, pre_tokens)) == len(unit):  # every character matched, as it always is
                return pre_tokens
        # Elsewhere only whitespace runs are cut at; most units are one word and stay whole.
        return self._cut_again.split(unit) if _INNER_SPACE.search(unit, 1) else [unit]


def _units(text: str) -> list[str]:
    """The text cut before every space followed by a non-whitespace character; that space is dropped.

    The first unit is the text up to the first cut; every later one stands for " " + unit.
    """
    # Usually every space is followed by a word: then str.split makes the same cuts, faster.
    return text.split(" ") if _SPACE_BEFORE_SPACE.search(text) is None else _CUT.split(text)
