"""GRPO's continuous-batching engine (runtime/rl/continuous.py) against `generate` (HfGeneration) on one tiny model:
greedy decoding gives the same tokens, sampling is seeded by the run's RNG, and the recipe refuses what its
paged sampler would drop. Its speed against `generate`: bench/grpo_generation.py (no timed test)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llm_train.config.objective_sections import GrpoSection, parse_reward
from llm_train.config.recipe import load_recipe
from llm_train.errors import UserError
from llm_train.runtime.rl.continuous import ContinuousBatchingGeneration, cache_blocks
from llm_train.runtime.rl.grpo import HfGeneration
from tests.helpers import tiny_llama

EOS, PAD, VOCAB = 2, 0, 97


def _engines(**grpo: Any) -> tuple[HfGeneration, ContinuousBatchingGeneration]:
    model = tiny_llama(VOCAB, attn_implementation="sdpa").eval()
    section = GrpoSection(
        max_completion_length=12, rewards=[parse_reward({"kind": "format", "pattern": "x"}, "r")], **grpo
    )
    engine = SimpleNamespace(module=model)  # what both read of a DeepSpeed engine off ZeRO-3
    return HfGeneration(engine, False, section, PAD, [EOS]), ContinuousBatchingGeneration(
        engine, False, section, PAD, [EOS]
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in (3, 11, 6, 17, 9, 4)]


def test_greedy_decoding_gives_the_tokens_generate_gives() -> None:
    """Uneven prompts, some completions stopping early at EOS: each engine's completions token for token."""
    plain, paged = _engines()
    # The recipe refuses generation_kwargs with continuous batching; set past the schema here only to make both
    # engines decode greedily (their sampling options are otherwise the same).
    plain.grpo = paged.grpo = plain.grpo.model_copy(update={"generation_kwargs": {"do_sample": False}})
    prompts = _prompts()
    expected = []
    for p in prompts:  # one row at a time: no left padding, generate's own reference
        expected += plain([p])
    got = paged(prompts)
    assert got == expected, (got, expected)
    assert all(EOS not in c[:-1] for c in got)  # each cut after its first EOS


def test_sampling_follows_the_runs_seed() -> None:
    _, paged = _engines(temperature=1.0)
    prompts = _prompts()
    torch.manual_seed(5)
    first = paged(prompts)
    torch.manual_seed(5)
    again = paged(prompts)
    torch.manual_seed(6)
    other = paged(prompts)
    assert first == again and first != other
    assert all(1 <= len(c) <= 12 for c in first)


def test_the_cache_holds_every_prompt_with_its_longest_completion() -> None:
    assert cache_blocks([[1] * 30, [1] * 3], new_tokens=4, page_size=32) == 2 + 1


@pytest.mark.parametrize(
    "option", ["grpo.repetition_penalty=1.2", "grpo.generation_kwargs={no_repeat_ngram_size: 2}"]
)
def test_what_its_sampler_would_drop_is_refused(option: str) -> None:
    with pytest.raises(UserError, match="is not built yet with grpo.use_transformers_continuous_batching"):
        load_recipe("tiny-cpu-grpo", ["grpo.use_transformers_continuous_batching=true", option])
    assert load_recipe(
        "tiny-cpu-grpo", ["grpo.use_transformers_continuous_batching=true"]
    ).grpo.use_transformers_continuous_batching
