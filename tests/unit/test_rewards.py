"""GRPO's rewards: the built-ins score what they say, a user's function is imported and called as TRL calls
one, weights and None values reach the advantages, and every bad input is one line naming the key."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_train.config.objective_sections import FunctionReward, parse_reward
from llm_train.errors import UserError
from llm_train.runtime.loss.grpo import group_advantages
from llm_train.runtime.rl.rewards import completions_as_trl, gather, load_rewards, reward_metrics, score
from tests.helpers import tiny_llama_config

PROMPTS = ["2+2=", "2+2=", "3+4=", "3+4="]
COMPLETIONS = ["<a>4</a>", "so <a>5</a>", "<a>7.0</a>", "seven"]
IDS = [[5, 6, 2], [5, 6, 7, 8, 9, 2], [5] * 10, [5] * 12]
COLUMNS = {"answer": ["4", "4", "7", "7"]}


def _rewards(*specs: dict[str, Any], max_completion_length: int = 12) -> list[Any]:
    return load_rewards(
        [parse_reward(s, f"grpo.rewards[{i}]") for i, s in enumerate(specs)], max_completion_length
    )


def _score(*specs: dict[str, Any], columns: dict[str, list[Any]] | None = None) -> torch.Tensor:
    return score(_rewards(*specs), PROMPTS, COMPLETIONS, IDS, COLUMNS if columns is None else columns)


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    """A user's reward module `name` in the working directory, as a user writes one next to the recipe."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_format_matches_the_whole_completion_or_a_part() -> None:
    full = _score({"kind": "format", "pattern": r"<a>\d+</a>"})
    part = _score({"kind": "format", "pattern": r"<a>\d+</a>", "match": "search"})
    assert full[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert part[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_exact_match_compares_the_last_final_answer_with_the_column() -> None:
    table = _score({"kind": "exact_match", "column": "answer", "pattern": r"<a>(.*?)</a>"})
    # '7.0' equals '7' as a number; 'seven' has no <a>...</a>: no final answer, 0.
    assert table[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    whole = _score({"kind": "exact_match"}, columns={"answer": COMPLETIONS[:2] + ["x", "seven"]})
    assert whole[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_exact_match_finds_the_right_answer_in_a_worked_solution_column() -> None:
    # GSM8K's answer column: the worked solution, then '#### <answer>' (docs/rl.md's GSM8K mapping).
    solutions = ["2 and 2 make <<2+2=4>>4.\n#### 4"] * 2 + ["3 and 4 make 7.\n#### 7", "no marker"]
    spec = {"kind": "exact_match", "pattern": r"<a>(.*?)</a>", "column_pattern": r"####\s*(.*)"}
    table = _score(spec, columns={"answer": solutions})
    # A row whose column has no right answer scores 0, as a completion without a final answer does.
    assert table[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_overlong_penalty_ramps_over_the_buffer_by_tokens() -> None:
    # max_completion_length 12, buffer 4: free up to 8 tokens, then -1/4 per token, -1 at 12.
    table = _score({"kind": "overlong", "buffer": 4})
    assert table[:, 0].tolist() == [0.0, 0.0, -0.5, -1.0]


def test_a_users_function_gets_prompts_completions_ids_and_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(
        tmp_path,
        monkeypatch,
        "rewards_called",
        """
        def correct(prompts, completions, completion_ids, answer, **kwargs):
            assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
            return [None if p.startswith("3") else float(a in c) for p, c, a in zip(prompts, completions, answer)]
        """,
    )
    table = _score({"kind": "function", "function": f"{name}:correct"})
    assert table[:2, 0].tolist() == [1.0, 0.0] and torch.isnan(table[2:, 0]).all()


def test_weights_and_none_reach_the_advantages_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(
        tmp_path,
        monkeypatch,
        "rewards_weighted",
        """
        def half(completions, **kwargs):
            return [0.5, None, 1, 0]
        """,
    )
    rewards = _rewards(
        {"kind": "format", "pattern": r"<a>.*</a>", "match": "search", "weight": 2.0},
        {"kind": "function", "function": f"{name}:half", "weight": 1.0},
    )
    table = score(rewards, PROMPTS, COMPLETIONS, IDS, COLUMNS)
    out = group_advantages(table, torch.tensor([r.weight for r in rewards]), group=2)
    # Weighted sums: 2*1 + 0.5, 2*1 (None left out), 2*1 + 1, 2*0 + 0.
    assert out.rewards.tolist() == [2.5, 2.0, 3.0, 0.0]
    assert out.advantages[0] > 0 > out.advantages[1] and out.advantages[2] > 0 > out.advantages[3]
    metrics = reward_metrics(rewards, table, out.rewards, out.zero_std)
    # TRL's metric names (grpo_trainer.py), so a TRL run's dashboard reads ours.
    assert metrics["rewards/format/mean"] == 0.75 and metrics["rewards/half/mean"] == pytest.approx(0.5)
    assert metrics["reward"] == pytest.approx(7.5 / 4) and metrics["frac_reward_zero_std"] == 0.0
    assert metrics["frac_reward_unscored"] == 0.0


def test_gather_puts_every_ranks_rows_together_in_rank_order() -> None:
    class TwoRanks:
        def gather_objects(self, obj: torch.Tensor) -> list[torch.Tensor]:
            return [obj, obj + 10]

    local = torch.tensor([[1.0], [2.0]])
    assert gather(local, TwoRanks()).flatten().tolist() == [1.0, 2.0, 11.0, 12.0]  # type: ignore[arg-type]


def test_a_failure_on_one_rank_is_the_same_one_line_on_every_rank() -> None:
    """The rank whose function raised and the rank whose did not both raise its line from the gather: no rank
    is left waiting in a collective that a peer's exit breaks (a gloo traceback instead of the fix)."""
    line = "grpo.rewards[0] (m:f) raised ValueError: boom; fix the function"

    class TwoRanks:
        def __init__(self, other: object) -> None:
            self.other = other

        def gather_objects(self, obj: object) -> list[object]:
            return [obj, self.other]

    failing = UserError(line)
    with pytest.raises(UserError, match="raised ValueError: boom"):
        gather(failing, TwoRanks(torch.ones(1, 1)))  # type: ignore[arg-type]
    with pytest.raises(UserError, match="raised ValueError: boom"):
        gather(torch.ones(1, 1), TwoRanks(line))  # type: ignore[arg-type]


# ------------------------------------------------------------------ every bad input: one line, the key, the fix


def _one_line_error(excinfo: pytest.ExceptionInfo[UserError], *parts: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message
    return message


def test_a_module_that_cannot_be_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "function", "function": "no_such_rewards:correct"})
    _one_line_error(
        excinfo, "grpo.rewards[0].function=no_such_rewards:correct", "no_such_rewards.py", "PYTHONPATH"
    )


def test_a_module_that_fails_while_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _module(tmp_path, monkeypatch, "rewards_broken", "import not_installed_anywhere\n")
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "function", "function": f"{name}:correct"})
    _one_line_error(excinfo, f"grpo.rewards[0].function={name}:correct", "ModuleNotFoundError")


def test_a_missing_or_uncallable_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _module(tmp_path, monkeypatch, "rewards_names", "THRESHOLD = 3\ndef correct(**kw): return []\n")
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "function", "function": f"{name}:corect"})
    _one_line_error(excinfo, "has no 'corect'", "its functions: correct")
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "function", "function": f"{name}:THRESHOLD"})
    _one_line_error(excinfo, "'THRESHOLD' is a int, not a function")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("raise KeyError('answer')", "raised KeyError: 'answer'; fix the function"),
        ("return [1.0]", "returned 1 values for 4 completions; return one float (or None) per completion"),
        ("return 1.0", "returned a float; return a list with one float (or None) per completion"),
        ("return [1.0, 'yes', 0.0, 0.0]", "returned 'yes' (str) for completion 1; return a finite float"),
        ("return [1.0, float('nan'), 0.0, 0.0]", "returned nan (float) for completion 1"),
    ],
)
def test_a_function_that_misbehaves_when_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, expected: str
) -> None:
    name = _module(tmp_path, monkeypatch, f"rewards_bad_{abs(hash(body))}", f"def f(**kw):\n    {body}\n")
    with pytest.raises(UserError) as excinfo:
        _score({"kind": "format", "pattern": "x"}, {"kind": "function", "function": f"{name}:f"})
    _one_line_error(excinfo, f"grpo.rewards[1] ({name}:f)", expected)


def test_an_exact_match_column_the_rows_lack() -> None:
    with pytest.raises(UserError) as excinfo:
        _score({"kind": "exact_match", "column": "solution"})
    _one_line_error(excinfo, "grpo.rewards[0].column=solution", "(fields: answer)")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"kind": "regex", "pattern": "x"},
            "grpo.rewards[0].kind: 'regex' is not one of format, exact_match",
        ),
        ({"kind": "format", "patern": "x"}, "unknown key 'patern' for kind format; did you mean 'pattern'?"),
        ({"kind": "format", "pattern": "("}, "grpo.rewards[0].pattern: not a regular expression"),
        ({"kind": "function", "function": "my_rewards.correct"}, "is not 'module:function'"),
        ({"kind": "overlong", "buffer": 0}, "grpo.rewards[0].buffer: Input should be greater than 0"),
    ],
)
def test_a_bad_reward_entry_names_its_key(spec: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=None) as excinfo:
        parse_reward(spec, "grpo.rewards[0]")
    assert expected in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_two_rewards_with_one_name_and_no_rewards() -> None:
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "format", "pattern": "a"}, {"kind": "format", "pattern": "b"})
    _one_line_error(
        excinfo, "grpo.rewards[1] and grpo.rewards[0] are both named 'format'", "grpo.rewards[1].name"
    )
    with pytest.raises(UserError) as excinfo:
        _rewards()
    _one_line_error(excinfo, "grpo.rewards is empty")
    with pytest.raises(UserError) as excinfo:
        _rewards({"kind": "overlong", "buffer": 12})
    _one_line_error(excinfo, "grpo.rewards[0].buffer=12 must be below grpo.max_completion_length=12")


def test_a_function_reward_is_named_after_its_function() -> None:
    spec = FunctionReward(function="pkg.sub:check")
    assert spec.kind == "function" and spec.weight == 1.0


def _reward_model_dir(path: Path, chat_template: bool = True) -> Path:
    """A tiny Llama reward model (one output, pad id set) with the bundled tokenizer, as objective reward exports."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from tests.unit.data_fixtures import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = tiny_llama_config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_labels=1, pad_token_id=pad
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    return path


def _trained_rows(path: Path, prompts: list[Any], completions: list[Any]) -> list[list[int]]:
    """The rows objective reward trains on for these (prompt, chosen) pairs: the preference format's own
    tokenisation (data/formats/preference.py), read back from its stored int32 rows."""
    import numpy as np
    from transformers import AutoTokenizer

    from llm_train.config.source_schema import PreferenceSource
    from llm_train.data.formats import FORMATS

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenize = FORMATS["preference"].tokenize_fn(
        PreferenceSource(path="x.jsonl"), tokenizer, None, "data.train[0]"
    )
    batch = {"prompt": prompts, "chosen": completions, "rejected": completions}
    stored = tokenize(batch, list(range(len(prompts))))["input_ids"]
    return [np.frombuffer(row, dtype=np.int32).tolist() for row in stored[::2]]  # chosen rows: 0, 2, ...


def _scores(path: Path, rows: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]


CHAT_PROMPTS = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.mark.parametrize("kind", ["chat", "text with a chat template", "text without a chat template"])
def test_a_reward_model_scores_what_objective_reward_trained_on(tmp_path: Path, kind: str) -> None:
    """The reward's score of (prompt, completion) is the model's score of the row the preference format stores
    for that prompt and response: the same tokens, rendered with the reward model's own chat template."""
    path = _reward_model_dir(tmp_path / "rm", chat_template=kind != "text without a chat template")
    if kind == "chat":
        prompts: list[Any] = CHAT_PROMPTS
        completions: list[Any] = completions_as_trl(prompts, COMPLETIONS)
        trained = _trained_rows(path, prompts, completions)
    elif kind == "text with a chat template":  # a text prompt of message pairs is the user's message
        prompts, completions = PROMPTS, COMPLETIONS
        trained = _trained_rows(path, prompts, completions_as_trl(CHAT_PROMPTS, COMPLETIONS))
    else:  # text pairs: bos + prompt, the response, eos
        prompts, completions = PROMPTS, COMPLETIONS
        trained = _trained_rows(path, prompts, completions)
    (reward,) = _rewards({"kind": "reward_model", "path": str(path), "weight": 0.5})
    assert (reward.name, reward.weight) == ("reward_model", 0.5)
    table = score([reward], prompts, completions, IDS, COLUMNS)
    expected = _scores(path, trained)
    # Padding the batch changes only the shapes the kernels see: fp32 rounding, far below 1e-5.
    assert torch.allclose(table[:, 0], torch.tensor(expected), atol=1e-5, rtol=0), (table, expected)
    assert len(set(expected)) == 4  # the texts differ, and so do their scores: the test tells rows apart


def test_a_reward_model_path_that_does_not_load_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        UserError, match=r"grpo.rewards\[0\].path: cannot load a reward model from"
    ) as missing:
        _rewards({"kind": "reward_model", "path": str(tmp_path / "nowhere")})
    assert "\n" not in str(missing.value)


def test_the_trl_documentation_reward_in_docs_rl_md_runs_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/rl.md's reward function (TRL's documentation's, for conversational prompts) as a user's module:
    it indexes `completion[0]["content"]`, which works only on TRL's message-list completions."""
    from tests.helpers import REPO

    page = (REPO / "docs" / "rl.md").read_text()
    block = next(b for b in page.split("```python\n")[1:] if "def format_reward_func" in b).split("```")[0]
    name = _module(tmp_path, monkeypatch, "my_rewards_doc", block)
    (reward,) = _rewards({"kind": "function", "function": f"{name}:format_reward_func"})
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    texts = ["<think>add</think><answer>4</answer>", "4"]
    table = score([reward], prompts, completions_as_trl(prompts, texts), [[1], [2]], {})
    assert table[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_refuse_a_reward_model_in_one_line(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reward model has a score head, no LM head: loaded as a causal LM it printed random text and exited 0."""
    from llm_train import cli

    path = _reward_model_dir(tmp_path / "rm")
    capsys.readouterr()  # the save's progress bar is not the command's output
    argv = [command, str(path), "--prompt", "Hello"] if command == "generate" else [command, str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "is a reward model (LlamaForSequenceClassification" in err and "kind: reward_model" in err
    assert len(err.splitlines()) == 1
