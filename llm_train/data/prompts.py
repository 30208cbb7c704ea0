"""GRPO's prompts (format: prompt): rows -> rendered, tokenised prompts with the fields rewards read.

A prompt is text (wrapped in the source's `prompt_template`, tokenised with the tokenizer's special tokens,
as generation is prompted) or a list of {role, content} messages (rendered with the chat template and its
generation prompt; data/formats/prompt.py). Every other field of the row travels with it to the reward
functions (runtime/rl/rewards.py). Prompts longer than data.seq_len - grpo.max_completion_length tokens are dropped, or refused (`overlong`).

Prompts are few and small, so they are read whole at start-up, not cached; `PromptSequences` hands them to
the one dealer (dealer.py `Batches`), which deals one batch of prompts per step and data-parallel rank in a
seeded order per epoch and resumes at the exact prompt, like any other data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.config.recipe_sections import DataSection
from llm_train.config.source_schema import PromptSource
from llm_train.data import formats
from llm_train.data.dealer import Batches, EpochOrder, Sequences
from llm_train.data.formats.messages import chat_template_for
from llm_train.data.formats.prompt import render_prompt
from llm_train.data.sources import check_revision, load_rows, locate
from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.prepare import PackedSplit


@dataclass(frozen=True)
class Prompt:
    """One prompt as generation and the rewards see it."""

    text: str | list[dict[str, Any]]  # what the user wrote: reward functions receive it as `prompts`
    ids: list[int]
    columns: dict[str, Any]  # the row's other fields, by name


def load_prompts(
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    room: int,
    say: Callable[[str], None],
    template_kwargs: dict[str, Any] | None = None,
) -> list[list[Prompt]]:
    """Every data.train source's prompts of at most `room` tokens (data.seq_len - grpo.max_completion_length)."""
    template = None
    if data.chat_template or tokenizer.chat_template:
        template = chat_template_for(tokenizer, data.chat_template, "data.chat_template")
    out = []
    for i, source in enumerate(data.sources("train")):
        key = f"data.train[{i}]"
        assert isinstance(source, PromptSource)  # recipe.py: objective grpo reads prompt sources only
        located = locate(source.path, key)
        check_revision(located, source, key)
        rows = load_rows(located, source, key, Path(data.cache_dir).expanduser())
        formats.check_fields(rows.column_names, source, key, located.describe())
        prompts, dropped = [], 0
        for r, row in enumerate(rows):
            value = row[source.prompt_field]
            ids = render_prompt(value, source, tokenizer, template, key, r, template_kwargs)
            if len(ids) > room:
                if source.overlong == "error":
                    raise UserError(
                        f"{key}: row {r}'s prompt has {len(ids)} tokens, more than data.seq_len - "
                        f"grpo.max_completion_length = {room}; raise data.seq_len or set {key}.overlong=drop"
                    )
                dropped += 1
                continue
            columns = {k: v for k, v in row.items() if k != source.prompt_field}
            prompts.append(Prompt(value, ids, columns))
        if not prompts:
            raise UserError(
                f"{key}: every prompt of {located.describe()} is longer than {room} tokens; raise data.seq_len"
            )
        say(
            f"data: {len(prompts):,} prompts from {located.describe()}"
            + (f" ({dropped} longer than {room} tokens dropped)" if dropped else "")
        )
        out.append(prompts)
    return out


def _fingerprint(parts: list[list[Prompt]], weights: list[float]) -> str:
    h = hashlib.sha256()
    for prompts, weight in zip(parts, weights, strict=True):
        h.update(json.dumps([weight, [(p.ids, sorted(p.columns)) for p in prompts]], default=str).encode())
    return h.hexdigest()[:16]


class PromptSequences(Sequences):
    """The dealer's `Sequences` over prompts: position -> prompt, a seeded mixture and order per epoch."""

    kind = "packed"  # a known length, positions counted like a packed split's
    revisions: list[str | None] = []
    split: PackedSplit | None = None  # nothing tokenised ahead (nor a DPO reference to score)

    def __init__(self, parts: list[list[Prompt]], weights: list[float], seed: int) -> None:
        self.parts, self.seed = parts, seed
        self.order = EpochOrder([len(p) for p in parts], weights, seed)
        self.epoch_len: int = self.order.epoch_len
        self.fingerprint = _fingerprint(parts, weights)

    def epoch(self, consumed: int) -> int:
        return consumed // self.epoch_len

    def batches(
        self, start: int, offset: int, micro: int, stride: int, workers: int, pin_memory: bool
    ) -> Iterator[dict[str, Any]]:
        for position in itertools.count(start + offset, stride):
            picked = [self.order.at(position + j) for j in range(micro)]
            yield {"prompts": [self.parts[part][i] for part, i in picked]}

    def state(self) -> dict[str, Any]:
        return {}

    def check(self, state: dict[str, Any], allow_revision_change: bool) -> list[str]:
        return []

    def load(self, state: dict[str, Any]) -> None:
        pass  # the position is the count of prompts consumed, which the dealer holds


def prompt_stream(
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    room: int,
    prompts_per_step: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    say: Callable[[str], None],
    template_kwargs: dict[str, Any] | None = None,
) -> Batches:
    """This rank's batches of `prompts_per_step` prompts, one per generation, dealt like any training data."""
    parts = load_prompts(data, tokenizer, room, say, template_kwargs)
    weights = [s.weight for s in data.sources("train")]
    sequences = PromptSequences(parts, weights, seed)
    return Batches(sequences, prompts_per_step, dp_rank, dp_size, workers=0, pin_memory=False)
