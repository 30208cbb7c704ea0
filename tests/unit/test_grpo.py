"""objective grpo without a launch: the recipe's rules (one line each), the prompts and how they are dealt,
and how `Rollouts` turns one generation into the step's micro-batches (a stand-in generator and two ranks).

The loss and the advantages against TRL: test_grpo_loss.py; the rewards: test_rewards.py; real runs:
tests/e2e/test_grpo.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_train.config.objective_sections import GrpoSection, parse_reward
from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import DataSection
from llm_train.config.resolution import resolve_run
from llm_train.data.prompts import Prompt, load_prompts, prompt_stream
from llm_train.errors import UserError
from llm_train.runtime.loop import LoopConfig
from llm_train.runtime.model.model import load_tokenizer
from llm_train.runtime.rl.grpo import Rollouts, RolloutShape, SampleLog, cut_at_eos, left_pad, right_pad
from llm_train.runtime.rl.rewards import load_rewards
from llm_train.runtime.session import sample_log
from tests.devices import CPU
from tests.helpers import REPO

PROMPTS = REPO / "llm_train" / "assets" / "tiny" / "prompts.jsonl"


def _refused(overrides: list[str], *parts: str, recipe: str = "tiny-cpu-grpo") -> None:
    with pytest.raises(UserError) as info:
        load_recipe(recipe, overrides)
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message


def test_the_shipped_recipe_resolves_with_whole_groups_per_rank() -> None:
    run = resolve_run("tiny-cpu-grpo", [], world_size=2, device=CPU)
    grpo = run.recipe.grpo
    assert run.recipe.objective == "grpo" and grpo.loss_type == "dapo" and grpo.num_generations == 8
    assert (run.layout.micro_batch_size * run.layout.grad_accum) % grpo.num_generations == 0


@pytest.mark.parametrize(
    ("overrides", "parts"),
    [
        (["objective=lm"], ("data.train[0] is format prompt", "set objective: grpo")),
        (
            ["objective=grpo", "data.train=[llm_train/assets/tiny/corpus.txt]"],
            ("data.train[0] is format text, but objective=grpo generates from prompts", "format: prompt"),
        ),
        (["grpo.rewards=[]"], ("grpo.rewards is empty",)),
        (
            ["grpo.max_completion_length=64"],
            ("grpo.max_completion_length=64 leaves no room", "data.seq_len=64"),
        ),
        (["data.eval_fraction=0.1"], ("data.eval_fraction=0.1: objective grpo has no evaluation set",)),
        (["preference.beta=0.2"], ("preference.beta is set but objective is grpo",)),
        (["grpo.loss_type=ppo"], ("grpo.loss_type",)),
        (["grpo.num_generations=1"], ("grpo.num_generations",)),
    ],
)
def test_what_grpo_cannot_use_is_refused_in_one_line(overrides: list[str], parts: tuple[str, ...]) -> None:
    _refused(overrides, *parts)


def test_a_grpo_section_without_objective_grpo_is_refused() -> None:
    _refused(["grpo.beta=0.1"], "grpo.beta is set but objective is dpo", recipe="tiny-cpu-dpo")


def test_num_generations_that_do_not_divide_a_ranks_completions_are_refused() -> None:
    with pytest.raises(UserError) as info:
        resolve_run("tiny-cpu-grpo", ["grpo.num_generations=6"], world_size=2, device=CPU)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "grpo.num_generations=6 does not divide each rank's completions per step (micro batch 8 x accumulation 2"
        in message
    )
    assert "make optim.micro_batch_size x grad_accum a multiple of 6" in message


def test_a_layout_that_splits_sequences_is_refused_for_grpo() -> None:
    with pytest.raises(
        UserError, match="objective=grpo is not supported with deepspeed.pipeline_stages=2"
    ) as info:
        resolve_run(
            "tiny-cpu-grpo",
            ["deepspeed.pipeline_stages=2", "deepspeed.config=zero1"],
            world_size=2,
            device=CPU,
        )
    assert "train with GRPO with ZeRO data parallelism" in str(info.value)


# ------------------------------------------------------------------ prompts


def _data(tmp_path: Path, rows: list[dict[str, Any]], **source: Any) -> DataSection:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataSection.model_validate(
        {
            "train": [{"path": str(path), "format": "prompt", **source}],
            "eval_fraction": 0.0,
            "cache_dir": str(tmp_path),
        }
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(load_recipe("tiny-cpu-grpo").model)


def test_text_and_chat_prompts_are_rendered_and_carry_their_other_fields(
    tmp_path: Path, tokenizer: Any
) -> None:
    chat = [{"role": "user", "content": "What is 2+2?"}]
    data = _data(
        tmp_path,
        [{"question": "What is 2+2?", "answer": "4"}, {"question": chat, "answer": "4"}],
        prompt_field="question",
        prompt_template="Q: {prompt}\nA:",
    )
    (prompts,) = load_prompts(data, tokenizer, room=48, say=lambda _: None)
    text, messages = prompts
    assert text.ids == tokenizer("Q: What is 2+2?\nA:")["input_ids"] and text.columns == {"answer": "4"}
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (
        messages.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"] and messages.text == chat
    )


def test_a_dataset_without_the_prompt_field_is_one_line(tmp_path: Path, tokenizer: Any) -> None:
    data = _data(tmp_path, [{"question": "x", "answer": "1"}])
    with pytest.raises(UserError) as info:
        load_prompts(data, tokenizer, room=48, say=lambda _: None)
    message = str(info.value)
    assert "\n" not in message and "no field 'prompt' for format prompt (fields: question, answer)" in message
    assert "set prompt_field" in message


def test_overlong_prompts_are_dropped_or_refused(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"prompt": "short"}, {"prompt": " ".join(["word"] * 80)}]
    said: list[str] = []
    (kept,) = load_prompts(_data(tmp_path, rows), tokenizer, room=20, say=said.append)
    assert len(kept) == 1 and "1 longer than 20 tokens dropped" in said[0]
    with pytest.raises(
        UserError, match=r"row 1's prompt has \d+ tokens, more than .* = 20; raise data.seq_len"
    ):
        load_prompts(_data(tmp_path, rows, overlong="error"), tokenizer, room=20, say=lambda _: None)


def test_prompts_are_dealt_once_per_epoch_over_ranks_and_resume_at_the_prompt(tokenizer: Any) -> None:
    data = DataSection.model_validate(
        {"train": [{"path": str(PROMPTS), "format": "prompt"}], "eval_fraction": 0.0, "seq_len": 64}
    )
    ranks = [prompt_stream(data, tokenizer, 48, 2, r, 2, seed=7, say=lambda _: None) for r in range(2)]
    epoch = ranks[0].epoch_len
    assert epoch == 185
    seen = []
    for _ in range(epoch // 4):
        for stream in ranks:
            seen += [p.columns["topic"] for p in next(stream)["prompts"]]
    assert len(set(seen)) == len(seen) == epoch // 4 * 4  # no prompt twice within an epoch, none lost
    state = ranks[0].state_dict()
    following = [p.columns["topic"] for p in next(ranks[0])["prompts"]]
    again = prompt_stream(data, tokenizer, 48, 2, 0, 2, seed=7, say=lambda _: None)
    again.load_state_dict(state)
    assert [p.columns["topic"] for p in next(again)["prompts"]] == following


# ------------------------------------------------------------------ rollouts


def test_padding_and_the_cut_after_the_first_eos() -> None:
    ids, mask = left_pad([[5, 6], [7]], pad=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    ids, mask = right_pad([[5, 6], [7]], pad=0)
    assert ids.tolist() == [[5, 6], [7, 0]] and mask.tolist() == [[1, 1], [1, 0]]
    assert cut_at_eos(torch.tensor([[4, 2, 9, 0], [4, 5, 6, 7]]), [2]) == [[4, 2], [4, 5, 6, 7]]


class _Rank:
    """This rank's collectives in a world of two whose other rank holds `other` rewards (the same shape)."""

    def __init__(self, rank: int, other: float) -> None:
        self.rank, self.other = rank, other

    def gather_objects(self, obj: Any) -> list[Any]:
        theirs = obj if not isinstance(obj, torch.Tensor) else torch.full_like(obj, self.other)
        return [obj, theirs] if self.rank == 0 else [theirs, obj]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * 2  # the other rank's totals taken equal to this one's


class _Prompts:
    def __next__(self) -> dict[str, Any]:
        return {"prompts": [Prompt("p", [1, 5, 6], {"answer": "7"}), Prompt("q", [1, 9], {"answer": "8"})]}


def _rollouts(tokenizer: Any, rank: int = 0, samples: SampleLog | None = None, **grpo: Any) -> Rollouts:
    completions = [[7, 2], [8, 8, 8, 2], [7, 7, 7, 7], [30, 2]]  # the third never ends: truncated at 4

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        assert len(prompts) == 8 and prompts[:4] == [[1, 5, 6]] * 4  # each prompt num_generations times
        return completions * 2

    section = GrpoSection(
        num_generations=4,
        max_completion_length=4,
        rewards=[parse_reward({"kind": "function", "function": "tests.unit.test_grpo:length"}, "r")],
        **grpo,
    )
    return Rollouts(
        _Prompts(),  # type: ignore[arg-type]
        generate,
        load_rewards(section.rewards, 4),
        section,
        RolloutShape(micro_batch=4, accumulation=2, dp_size=2),
        tokenizer,
        _Rank(rank, other=0.0),  # type: ignore[arg-type]
        rank,
        policy_logps=lambda batch: torch.full(batch["completion_ids"].shape, -1.0),
        samples=samples,
    )


def length(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The stand-in reward: the completion's length."""
    return [float(len(c)) for c in completion_ids]


def test_one_generation_becomes_the_steps_micro_batches(tokenizer: Any) -> None:
    rollouts = _rollouts(tokenizer, rank=1)
    first, second = next(rollouts), next(rollouts)
    for batch in (first, second):
        assert batch["prompt_ids"].shape[0] == batch["completion_ids"].shape[0] == 4  # micro_batch rows
        assert (
            batch["attention_mask"].shape[1]
            == batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
        )
        assert "old_logps" not in batch  # num_iterations 1: the ratio is exp(0)
    assert first["completion_mask"].sum(1).tolist() == [2, 4, 4, 2]
    # dapo: the step's tokens over both ranks (2 x 24) / (2 ranks x 2 micro-batches).
    assert first["dapo_tokens"] == pytest.approx(12.0)
    # Rank 1 holds rows 8..15 of the gathered rewards; each group of 4 has rewards 2, 4, 4, 2: mean 3,
    # unbiased std 2 / sqrt(3).
    assert torch.allclose(first["advantages"], torch.tensor([-1.0, 1.0, 1.0, -1.0]) / (2 / 3**0.5 + 1e-4))
    metrics = first["rollout_metrics"]
    assert metrics["reward_length_mean"] == pytest.approx(1.5)  # rank 0 stands in with rewards 0
    assert (
        metrics["completion_truncated_frac"] == pytest.approx(0.25) and metrics["completion_length_max"] == 4
    )


def test_a_generation_shows_its_first_completions_with_their_rewards(tokenizer: Any) -> None:
    shown: list[list[dict[str, Any]]] = []
    next(_rollouts(tokenizer, rank=1, samples=shown.append))
    (rows,) = shown
    assert [r["prompt"] for r in rows] == ["p"] * 4  # rank 1's first group
    assert [r["reward_length"] for r in rows] == [2.0, 4.0, 4.0, 2.0]  # its own rows of the gathered table
    assert [r["reward"] for r in rows] == [2.0, 4.0, 4.0, 2.0]  # weight 1
    assert rows[1]["advantage"] > 0 > rows[0]["advantage"]
    assert rows[0]["completion"] == tokenizer.decode([7, 2], skip_special_tokens=True)


def test_completions_are_logged_at_the_generations_that_train_a_logged_step() -> None:
    class Tables:
        steps: list[int] = []

        def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
            assert key == "completions" and rows == [{"completion": "x"}]
            self.steps.append(step)

    tables = Tables()
    cfg = LoopConfig(max_steps=10, log_every=4, eval_every=0)
    log = sample_log(tables, cfg, iterations=2)  # type: ignore[arg-type]
    for _ in range(5):  # generations train steps 1-2, 3-4, 5-6, 7-8, 9-10
        log([{"completion": "x"}])
    assert tables.steps == [1, 3, 7, 9]  # the first, those holding steps 4 and 8, the last


def test_truncated_completions_can_be_left_out_and_generations_reused(tokenizer: Any) -> None:
    rollouts = _rollouts(tokenizer, mask_truncated_completions=True, num_iterations=2)
    step = [next(rollouts) for _ in range(4)]  # two optimizer steps on one generation
    assert step[0]["completion_mask"][2].sum() == 0  # the never-ending completion: out of the loss
    assert torch.equal(step[0]["completion_ids"], step[2]["completion_ids"])
    assert (
        step[0]["rollout_metrics"]["time_generate_s"] > 0
        and step[2]["rollout_metrics"]["time_generate_s"] == 0
    )
    assert torch.equal(step[0]["old_logps"], torch.full(step[0]["completion_ids"].shape, -1.0))


def test_data_inspect_shows_the_prompts_as_generation_sees_them(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.cli import main

    assert main(["data", "inspect", "--recipe", "tiny-cpu-grpo", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompts of at most 48 tokens (objective grpo; nothing to prepare)" in out
    assert "185 prompts from" in out and "\"Explain the Python topic 'assert'.\"" in out
    assert "fields for rewards: {'topic': 'assert'}" in out
    assert main(["data", "prepare", "--recipe", "tiny-cpu-grpo"]) == 0  # nothing to tokenise ahead


@pytest.mark.parametrize("iterations", [1, 2])
def test_optim_epochs_count_passes_over_the_prompts(iterations: int) -> None:
    from llm_train.runtime.session import grpo_data

    overrides = ["optim.max_steps=null", "optim.epochs=1", f"grpo.num_iterations={iterations}"]
    run = resolve_run("tiny-cpu-grpo", overrides, world_size=2, device=CPU)
    data = grpo_data(run, load_tokenizer(run.recipe.model), 0, lambda _: None)
    # 185 prompts, 2 per rank per generation on 2 ranks: 46 generations, each trained num_iterations steps.
    assert data.max_steps == 46 * iterations and data.eval_blocks is None
