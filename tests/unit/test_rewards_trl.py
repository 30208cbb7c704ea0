"""TRL's reward interface, received the same: one set of reward functions run through TRL 1.16's GRPOTrainer and
through our rollouts on the same completions, and what each function was handed compared field by field.

TRL trains one step on CPU (use_cpu, no vLLM, fp32, as GRPOConfig runs on a CPU) with conversational prompts, its
`generate` writing the completions; every reward function records its keyword arguments. Our `Rollouts` is then
given TRL's completions (its generation engine replays TRL's completion ids) for the same prompts, and the
same functions record what our scoring hands them: a sync function, an `async def` one (TRL awaits them
concurrently) and one that returns None for some completions. Both must give the same prompts, completions
(message lists for conversational prompts), completion ids, dataset columns, and a `trainer_state` with
TRL's attribute names and values, plus `log_metric` / `log_extra` that work.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, TrainerState

# TRL is test-only (pyproject's dev extra, which `make install` installs): imported, not skipped.
from trl import GRPOConfig, GRPOTrainer

from llm_train.config.objective_sections import GrpoSection, parse_reward
from llm_train.data.prompts import Prompt
from llm_train.runtime.base.collectives import WORLD
from llm_train.runtime.rl.grpo import Rollouts, RolloutShape
from llm_train.runtime.rl.rewards import RewardContext, RewardFunction
from tests.helpers import REPO, tiny_llama

TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
    {"prompt": [{"role": "user", "content": "What is 3+4?"}], "answer": "7"},
]
GENERATIONS, COMPLETION = 2, 6
RECEIVED: dict[str, list[dict[str, Any]]] = {"sync": [], "async": [], "none": []}


def _record(name: str, kwargs: dict[str, Any]) -> list[float | None]:
    state = kwargs["trainer_state"]
    kwargs["log_metric"](f"{name}_calls", 1.0)
    kwargs["log_extra"](f"{name}_len", [len(c) for c in kwargs["completion_ids"]])
    RECEIVED[name].append(
        {
            **{k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_metric", "log_extra")},
            "keys": sorted(kwargs),
            "state": (type(state).__name__, state.global_step, state.max_steps),
        }
    )
    return [float(len(c)) for c in kwargs["completion_ids"]]


def sync_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    # TRL's documented way for conversational prompts: completion[0]["content"].
    contents = [completion[0]["content"] for completion in completions]
    assert all(isinstance(c, str) for c in contents)
    return _record("sync", {"prompts": prompts, "completions": completions, **kwargs})


async def async_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    await asyncio.sleep(0)
    return _record("async", {"prompts": prompts, "completions": completions, **kwargs})


def none_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    values = _record("none", {"prompts": prompts, "completions": completions, **kwargs})
    return [None if i % 2 else v for i, v in enumerate(values)]


FUNCTIONS = [sync_reward, async_reward, none_reward]


def _trl_received(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    from datasets import Dataset

    args = GRPOConfig(
        output_dir="/tmp/llm_train-test-grpo-rewards",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        beta=0,
        per_device_train_batch_size=len(ROWS) * GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        max_steps=1,
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=FUNCTIONS,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
    )
    for calls in RECEIVED.values():
        calls.clear()
    trainer.train()
    return {name: calls[0] for name, calls in RECEIVED.items()}


class _Replay:
    """Our generation engine replaying TRL's completions for the same prompts (same order)."""

    def __init__(self, completions: list[list[int]]) -> None:
        self.completions = completions
        self.eos_ids = [AutoTokenizer.from_pretrained(TOKENIZER).eos_token_id]

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        assert len(prompts) == len(self.completions)
        return self.completions


class _Prompts:
    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts

    def __next__(self) -> dict[str, Any]:
        return {"prompts": self.prompts}


def _ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _ours_received(trl: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    order = trl["prompts"][::GENERATIONS]  # TRL repeats each prompt num_generations times, consecutively
    rows = {str(r["prompt"]): r for r in ROWS}
    prompts = [Prompt(p, _ids(tokenizer, p), {"answer": rows[str(p)]["answer"]}) for p in order]
    grpo = GrpoSection(
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        rewards=[parse_reward({"kind": "format", "pattern": "x"}, "r")],
    )
    rewards = [
        RewardFunction(f.__name__, f"grpo.rewards[{i}]", f.__name__, 1.0, f) for i, f in enumerate(FUNCTIONS)
    ]
    rollouts = Rollouts(
        _Prompts(prompts),  # type: ignore[arg-type]
        _Replay(trl["completion_ids"]),
        rewards,
        grpo,
        RolloutShape(micro_batch=len(trl["completion_ids"]), accumulation=1, dp_size=1),
        tokenizer,
        WORLD,
        0,
        policy_logps=lambda batch: torch.zeros(batch["completion_ids"].shape),
        context=RewardContext.at_step(0, 1),  # TRL's first generation: 0 steps done of max_steps 1
    )
    for calls in RECEIVED.values():
        calls.clear()
    batch = next(rollouts)
    return {name: calls[0] for name, calls in RECEIVED.items()}, batch["rollout_metrics"]


@pytest.fixture(scope="module")
def received() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]]:
    trl = _trl_received(
        tiny_llama(len(AutoTokenizer.from_pretrained(TOKENIZER)), max_position_embeddings=128)
    )
    ours, metrics = _ours_received(trl["sync"])
    return trl, ours, metrics


@pytest.mark.parametrize("name", list(RECEIVED))
def test_each_function_receives_what_trl_hands_it(
    received: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]], name: str
) -> None:
    trl, ours, _ = received
    theirs, mine = trl[name], ours[name]
    print(f"{name}: TRL passed {theirs['keys']}; llm_train passed {mine['keys']}")
    assert mine["keys"] == theirs["keys"]  # every keyword, no more, no fewer
    for key in theirs:
        assert mine[key] == theirs[key], (key, mine[key], theirs[key])
    # Conversational prompts: message lists, the completion one assistant message (TRL's shape).
    assert isinstance(mine["prompts"][0], list) and mine["completions"][0][0]["role"] == "assistant"
    assert mine["state"] == ("TrainerState", 0, 1)
    assert sorted(mine["answer"]) == sorted(r["answer"] for r in ROWS for _ in range(GENERATIONS))


def test_logged_metrics_and_nones_reach_the_step(
    received: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]],
) -> None:
    _, ours, metrics = received
    assert metrics["sync_calls"] == metrics["async_calls"] == metrics["none_calls"] == 1.0  # log_metric
    # none_reward returned None for every other completion: its mean is over the others only (NaN-aware, as TRL).
    lengths = [len(ids) for ids in ours["none"]["completion_ids"]]
    assert metrics["rewards/none_reward/mean"] == pytest.approx(sum(lengths[::2]) / len(lengths[::2]))
    assert metrics["rewards/sync_reward/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["frac_reward_unscored"] == 0.0  # sync and async scored every completion


def test_a_generation_no_function_scores_says_so() -> None:
    said: list[str] = []
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)

    def nothing(completions: list[Any], **_: Any) -> list[None]:
        return [None] * len(completions)

    grpo = GrpoSection(
        num_generations=2,
        max_completion_length=4,
        rewards=[parse_reward({"kind": "format", "pattern": "x"}, "r")],
    )
    rollouts = Rollouts(
        _Prompts([Prompt("p", [1, 5], {})]),  # type: ignore[arg-type]
        _Replay([[7, 2], [8, 2]]),
        [RewardFunction("nothing", "grpo.rewards[0]", "m:nothing", 1.0, nothing)],
        grpo,
        RolloutShape(micro_batch=2, accumulation=1, dp_size=1),
        tokenizer,
        WORLD,
        0,
        policy_logps=lambda batch: torch.zeros(batch["completion_ids"].shape),
        say=said.append,
    )
    batch = next(rollouts)
    assert batch["rollout_metrics"]["frac_reward_unscored"] == 1.0
    assert batch["advantages"].tolist() == [0.0, 0.0]
    assert len(said) == 1 and "every reward function returned None" in said[0] and "\n" not in said[0]


def test_trainer_state_has_trls_attribute_names() -> None:
    state = RewardContext.at_step(3, 10).trainer_state
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (3, 10)


def test_the_generation_options_are_trls() -> None:
    """Sampling options, generation_kwargs and stop ids: our generate call's keywords against the GenerationConfig
    TRL's trainer builds from the same options (grpo_trainer.py __init__)."""
    from datasets import Dataset

    from llm_train.runtime.rl.grpo import sampling_options, stop_ids

    options = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1}
    extra = {"no_repeat_ngram_size": 3, "top_k": 7}  # generation_kwargs override the options, in both
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = tiny_llama(len(tokenizer), max_position_embeddings=128)
    model.generation_config.eos_token_id = [9, tokenizer.eos_token_id, 11]  # an end-of-turn list
    args = GRPOConfig(
        output_dir="/tmp/llm_train-test-grpo-options",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=COMPLETION,
        generation_kwargs=extra,
        **options,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=FUNCTIONS[:1],
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    grpo = GrpoSection(
        max_completion_length=COMPLETION,
        generation_kwargs=extra,
        rewards=[parse_reward({"kind": "format", "pattern": "x"}, "r")],
        **options,
    )
    eos = stop_ids(tokenizer, model.generation_config)
    ours = sampling_options(grpo, tokenizer.pad_token_id, eos)
    theirs = trainer.generation_config
    assert eos == trainer.eos_token_ids == [9, tokenizer.eos_token_id, 11]
    for key, value in ours.items():
        assert getattr(theirs, key) == value, (key, value, getattr(theirs, key))
    assert ours["top_k"] == 7 and ours["no_repeat_ngram_size"] == 3


def test_every_trl_option_we_take_has_trls_name_and_default() -> None:
    """Each grpo key that GRPOConfig also has defaults to TRL 1.16's value (its dataclass default, before its
    __post_init__ fills generation_batch_size / steps_per_generation from the batch), and scale_rewards'
    booleans map as TRL maps them."""
    import dataclasses

    theirs = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = GrpoSection().model_dump()
    shared = sorted(set(ours) & set(theirs))
    assert len(shared) >= 30, shared  # every option of the recipe's grpo section but `rewards`
    assert set(ours) - set(shared) == {"rewards"}, set(ours) - set(shared)
    differ = {k: (ours[k], theirs[k]) for k in shared if ours[k] != theirs[k]}
    assert not differ, differ
    for value in (True, False):
        trl = GRPOConfig(
            output_dir="/tmp/llm_train-test-grpo-scale", use_cpu=True, report_to=[], scale_rewards=value
        )
        assert GrpoSection(scale_rewards=value).scale_rewards == trl.scale_rewards
