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
from llm_train.runtime.rl.grpo import (
    Rollouts,
    RolloutShape,
    SampleLog,
    cut_at_eos,
    disable_dropout,
    left_pad,
    right_pad,
    sampling_options,
    stop_ids,
)
from llm_train.runtime.rl.rewards import load_rewards
from llm_train.runtime.rl.wiring import grpo_prompts, sample_log
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
        # Non-finite values are refused where they are parsed, never trained on.
        (["grpo.temperature=inf"], ("grpo.temperature",)),
        (["grpo.beta=inf"], ("grpo.beta",)),
        (["grpo.rewards=[{kind: format, pattern: x, weight: .nan}]"], ("grpo.rewards[0].weight",)),
        (["grpo.reward_weights=[.nan]"], ("grpo.reward_weights",)),
        (["grpo.reward_weights=[1.0, 2.0]"], ("grpo.reward_weights has 2 weights for 1 rewards",)),
        (["reward.margin=0.5"], ("reward.margin is set but objective is grpo", "grpo.rewards")),
        # TRL options not built yet: refused in one line that says so (docs/rl.md lists them).
        (["grpo.steps_per_generation=2"], ("grpo.steps_per_generation is not built yet", "docs/rl.md")),
        (["grpo.generation_batch_size=32"], ("grpo.generation_batch_size is not built yet",)),
        (["grpo.sync_ref_model=true"], ("grpo.sync_ref_model is not built yet",)),
        (["grpo.num_generations_eval=2"], ("grpo.num_generations_eval is not built yet",)),
    ],
)
def test_what_grpo_cannot_use_is_refused_in_one_line(overrides: list[str], parts: tuple[str, ...]) -> None:
    _refused(overrides, *parts)


def test_trl_options_are_taken_under_trls_names_and_defaults() -> None:
    """TRL 1.16's GRPOConfig defaults and values: max_completion_length 512, scale_rewards booleans, its loss
    types, reward_weights, the sampling options; a recipe written with TRL's values loads."""
    assert GrpoSection().max_completion_length == 512 and GrpoSection().loss_type == "dapo"
    recipe = load_recipe(
        "tiny-cpu-grpo",
        [
            "grpo.scale_rewards=false",
            "grpo.loss_type=sapo",
            "grpo.delta=1.5",
            "grpo.reward_weights=[0.5]",
            "grpo.min_p=0.05",
            "grpo.repetition_penalty=1.1",
            "grpo.generation_kwargs={no_repeat_ngram_size: 3}",
            "grpo.disable_dropout=true",
        ],
    )
    grpo = recipe.grpo
    assert grpo.scale_rewards == "none" and grpo.loss_type == "sapo" and grpo.delta == 1.5
    assert load_recipe("tiny-cpu-grpo", ["grpo.scale_rewards=true"]).grpo.scale_rewards == "group"
    options = sampling_options(grpo, pad_id=0, eos_ids=[2, 7])
    assert options["min_p"] == 0.05 and options["repetition_penalty"] == 1.1
    assert options["no_repeat_ngram_size"] == 3 and options["eos_token_id"] == [2, 7]
    for loss_type in ("cispo", "luspo", "vespo"):
        assert load_recipe("tiny-cpu-grpo", [f"grpo.loss_type={loss_type}"]).grpo.loss_type == loss_type


def test_disable_dropout_zeroes_every_dropout_as_trl_does() -> None:
    from trl.trainer.utils import disable_dropout_in_model

    ours = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1))
    )
    theirs = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1))
    )
    assert disable_dropout(ours) == 2
    disable_dropout_in_model(theirs)
    probabilities = [
        [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] for model in (ours, theirs)
    ]
    assert probabilities == [[0.0, 0.0], [0.0, 0.0]]


def test_a_reward_models_margin_must_be_finite() -> None:
    _refused(
        ["reward.margin=nan"], "reward.margin: Input should be a finite number", recipe="tiny-cpu-reward"
    )


def test_generation_stops_at_every_eos_of_the_generation_config(tokenizer: Any) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    assert stop_ids(tokenizer, GenerationConfig(eos_token_id=[eos, 9, 11])) == [eos, 9, 11]
    assert stop_ids(tokenizer, GenerationConfig(eos_token_id=5)) == [eos, 5]
    assert stop_ids(tokenizer, None) == [eos]


def test_the_console_line_shows_the_reward_and_each_functions_when_several() -> None:
    from llm_train.observability.console import progress_line

    one = progress_line(3, 30, {"loss": 0.1, "reward": 0.75, "rewards/has_digit/mean": 0.75}, None)
    assert "| reward 0.750 |" in one + " |" and "(" not in one
    several = {"loss": 0.1, "reward": 1.25, "rewards/format/mean": 0.5, "rewards/correct/mean": 0.75}
    assert "reward 1.250 (format 0.500, correct 0.750)" in progress_line(3, 30, several, None)


def test_a_grpo_section_without_objective_grpo_is_refused() -> None:
    _refused(["grpo.beta=0.1"], "grpo.beta is set but objective is dpo", recipe="tiny-cpu-dpo")


def test_groups_may_span_ranks_as_in_trl() -> None:
    """TRL's rule: num_generations divides the global batch; 16 generations over 2 ranks of 8 completions."""
    run = resolve_run(
        "tiny-cpu-grpo",
        ["grpo.num_generations=8", "optim.micro_batch_size=2", "optim.grad_accum=2"],
        world_size=2,
        device=CPU,
    )
    assert run.layout.micro_batch_size * run.layout.grad_accum * run.layout.dp == 8


def test_num_generations_that_do_not_divide_the_steps_completions_are_refused() -> None:
    with pytest.raises(UserError) as info:
        resolve_run("tiny-cpu-grpo", ["grpo.num_generations=6"], world_size=2, device=CPU)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "grpo.num_generations=6 does not divide the step's completions (micro batch 8 x accumulation 2 x 2 "
        "data-parallel ranks = 32)" in message
    )
    assert "make optim.micro_batch_size x grad_accum x ranks a multiple of 6" in message


@pytest.mark.parametrize("config", ["zero2", "zero1", "zero3"])
def test_grpo_with_pipeline_stages_is_refused_naming_a_layout_that_works(config: str) -> None:
    """It first said 'use deepspeed.config=zero1' (the pipeline's ZeRO rule), which then failed for GRPO."""
    _refused(
        ["deepspeed.pipeline_stages=2", f"deepspeed.config={config}"],
        "deepspeed.pipeline_stages=2: objective grpo",
        "deepspeed.pipeline_stages=1 with deepspeed.config=zero2",
    )
    # The layout it names resolves.
    resolve_run(
        "tiny-cpu-grpo", ["deepspeed.pipeline_stages=1", "deepspeed.config=zero2"], world_size=2, device=CPU
    )


def test_a_layout_that_splits_sequences_is_refused_for_grpo() -> None:
    with pytest.raises(
        UserError, match="objective=grpo is not supported with deepspeed.sequence_parallel=2"
    ) as info:
        resolve_run("tiny-cpu-grpo", ["deepspeed.sequence_parallel=2"], world_size=2, device=CPU)
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


def test_chat_template_kwargs_reach_the_chat_template(tmp_path: Path, tokenizer: Any) -> None:
    """grpo.chat_template_kwargs (TRL's option): extra variables the template reads, e.g. enable_thinking."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %} think{% endif %}"
    )
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": "2+2?"}]}])
    (plain,) = load_prompts(data, tok, room=48, say=lambda _: None)
    (thinking,) = load_prompts(
        data, tok, room=48, say=lambda _: None, template_kwargs={"enable_thinking": True}
    )
    assert plain[0].ids == tok("2+2?", add_special_tokens=False)["input_ids"]
    assert thinking[0].ids == tok("2+2? think", add_special_tokens=False)["input_ids"] != plain[0].ids


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
        # The step's prompts for both ranks (each draws the same): rank 0 writes the groups of the first two.
        pair = [Prompt("p", [1, 5, 6], {"answer": "7"}), Prompt("q", [1, 9], {"answer": "8"})]
        return {"prompts": pair * 2}


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
    assert metrics["rewards/length/mean"] == pytest.approx(1.5)  # rank 0 stands in with rewards 0
    assert (
        metrics["completions/clipped_ratio"] == pytest.approx(0.25) and metrics["completions/max_length"] == 4
    )


def test_a_generation_shows_its_first_completions_with_their_rewards(tokenizer: Any) -> None:
    shown: list[list[dict[str, Any]]] = []
    next(_rollouts(tokenizer, rank=1, samples=shown.append))
    (rows,) = shown
    assert [r["prompt"] for r in rows] == ["p"] * 4  # rank 1's first group
    assert [r["rewards/length"] for r in rows] == [2.0, 4.0, 4.0, 2.0]  # its own rows of the gathered table
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
    overrides = ["optim.max_steps=null", "optim.epochs=1", f"grpo.num_iterations={iterations}"]
    run = resolve_run("tiny-cpu-grpo", overrides, world_size=2, device=CPU)
    prompts, max_steps = grpo_prompts(run, load_tokenizer(run.recipe.model), lambda _: None)
    # 185 prompts, 2 per rank per generation on 2 ranks: 46 generations, each trained num_iterations steps.
    assert prompts.per_epoch == 46 and max_steps == 46 * iterations


class _ThreadWorld:
    """Collectives of `world` ranks run as threads of this process: each gather waits for every rank."""

    def __init__(self, world: int) -> None:
        import threading

        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def rank(self, r: int) -> Any:
        world = self

        class Rank:
            def gather_objects(self, obj: Any) -> list[Any]:
                world.slots[r] = obj
                world.barrier.wait()
                out = list(world.slots)
                world.barrier.wait()  # nobody overwrites a slot before every rank has read them all
                return out

            def sum(self, tensor: torch.Tensor) -> torch.Tensor:
                return torch.stack(self.gather_objects(tensor)).sum(dim=0)

        return Rank()


def _spanning_step(world: int, micro: int, accumulation: int, tokenizer: Any) -> tuple[torch.Tensor, float]:
    """(the step's advantages in global order, the step's loss as DeepSpeed reduces it: the mean over ranks
    of each rank's micro-batch losses / accumulation) for one prompt's group of 8 over `world` ranks."""
    from concurrent.futures import ThreadPoolExecutor

    from llm_train.runtime.loss.grpo import policy_loss
    from llm_train.runtime.rl.grpo import loss_settings

    group = 8
    completions = [[7] * (1 + (3 * i) % 5) + [2] for i in range(group)]  # lengths 2..6, the reward
    section = GrpoSection(
        num_generations=group,
        max_completion_length=8,
        rewards=[parse_reward({"kind": "function", "function": "tests.unit.test_grpo:length"}, "r")],
    )
    threads = _ThreadWorld(world)
    n = micro * accumulation

    class OnePrompt:
        def __next__(self) -> dict[str, Any]:
            return {"prompts": [Prompt("p", [1, 5, 6], {})]}

    def run(rank: int) -> tuple[torch.Tensor, float]:
        rollouts = Rollouts(
            OnePrompt(),  # type: ignore[arg-type]
            lambda prompts: completions[rank * n : rank * n + len(prompts)],  # its slice of the group
            load_rewards(section.rewards, 8),
            section,
            RolloutShape(micro_batch=micro, accumulation=accumulation, dp_size=world),
            tokenizer,
            threads.rank(rank),
            rank,
            policy_logps=lambda batch: torch.full(batch["completion_ids"].shape, -1.0),
        )
        advantages, loss = [], 0.0
        for _ in range(accumulation):
            batch = next(rollouts)
            logps = (
                -0.5 - 0.1 * batch["completion_ids"].float()
            )  # any fixed log-probs: the same on both layouts
            value, _ = policy_loss(
                logps,
                batch["advantages"],
                batch["completion_mask"],
                loss_settings(section),
                None,
                None,
                batch["dapo_tokens"],
            )
            advantages.append(batch["advantages"])
            loss += float(value) / accumulation
        return torch.cat(advantages), loss

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(run, range(world)))
    return torch.cat([a for a, _ in results]), sum(loss for _, loss in results) / world


def test_a_group_spanning_two_ranks_gets_the_advantages_and_loss_of_one_rank(tokenizer: Any) -> None:
    one_advantages, one_loss = _spanning_step(1, micro=4, accumulation=2, tokenizer=tokenizer)
    two_advantages, two_loss = _spanning_step(2, micro=2, accumulation=2, tokenizer=tokenizer)
    print(f"one rank: loss {one_loss:.6f}; two ranks: loss {two_loss:.6f}")
    assert torch.equal(one_advantages, two_advantages) and one_advantages.abs().sum() > 0
    assert one_loss != 0 and abs(one_loss - two_loss) <= 1e-6


def test_completions_rewind_with_the_metrics_on_resume(tmp_path: Path) -> None:
    """After a kill the resumed run logs the steps past its checkpoint again: completions.jsonl keeps none of the
    killed run's rows for them (they were duplicates), a partial last line included."""
    from llm_train.runtime.checkpointing.resume import rewind_step_logs

    metrics = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7))
    completions = "".join(
        json.dumps({"step": s, "completion": "x"}) + "\n" for s in range(1, 7) for _ in range(4)
    )
    (tmp_path / "metrics.jsonl").write_text(metrics)
    (tmp_path / "completions.jsonl").write_text(completions + '{"step": 7, "compl')
    rewind_step_logs(tmp_path, 4)
    for name, per_step in (("metrics.jsonl", 1), ("completions.jsonl", 4)):
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert [r["step"] for r in rows] == [s for s in range(1, 5) for _ in range(per_step)], name


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        (
            "{kind: function, function: nowhere_module:f}",
            "grpo.rewards[0].function=nowhere_module:f: cannot import",
        ),
        (
            "{kind: overlong, buffer: 20}",
            "grpo.rewards[0].buffer=20 must be below grpo.max_completion_length=16",
        ),
        ("{kind: exact_match, column: answer}", "grpo.rewards[0] (exact_match) needs the field 'answer'"),
        ("{kind: function, function: tests.unit.test_grpo:needs_solution}", "needs the field 'solution'"),
    ],
)
def test_dry_run_imports_the_rewards_and_checks_their_fields(
    reward: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dry-run` meets the rewards as a run would: imported, the overlong buffer, the fields they read."""
    from llm_train import train

    assert train.main(["--recipe", "tiny-cpu-grpo", "--dry-run", f"grpo.rewards=[{reward}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert expected in err[-1], err
    assert train.main(["--recipe", "tiny-cpu-grpo", "--dry-run"]) == 0
    assert "grpo.rewards[0] format: loaded, weight 1.0" in capsys.readouterr().out


def needs_solution(completions: list[str], solution: list[str], **kwargs: Any) -> list[float]:
    """A reward that reads a `solution` field the bundled prompts do not have."""
    return [0.0] * len(completions)
