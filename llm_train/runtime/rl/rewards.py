"""What GRPO's completions are scored by: the recipe's `grpo.rewards`, each a weighted function.

Built in (config/objective_sections.py has their options): `format` (a regular expression the completion matches),
`exact_match` (the completion's final answer against a column of the prompt's row) and `overlong`
(DAPO's soft length penalty), `reward_model` (a trained reward model's score, objective reward's final/).
`function` imports yours, `module:function`, from the working directory or
PYTHONPATH, and calls it the way TRL calls a reward function, with keyword arguments only:

    function(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> [float | None, ...]

one entry per completion (a prompt appears once per generation), `columns` the prompt rows' other fields
(e.g. `answer=[...]`). None means "not mine to score": the completion is left out of that function's
mean and of the weighted sum; a completion no function scores gets advantage 0 (loss/grpo.py).

Every way a reward function can go wrong is the user's to fix, so each is one line that names the
recipe key and what to change (UserError): a function that cannot be imported or is not callable (found
before any worker starts, `load_rewards`), one that raises, returns the wrong number of values, or a
value that is not a finite number or None.

Each rank scores its own completions; `gather` then puts every rank's rows together, in rank order,
before the group advantages (a batch-scaled std, and the metrics, need all of them).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_train.config.objective_sections import (
    ExactMatchReward,
    FormatReward,
    FunctionReward,
    OverlongReward,
    Reward,
    RewardModelReward,
)
from llm_train.errors import UserError, first_line
from llm_train.runtime.base.collectives import Collectives

RewardCall = Callable[..., Sequence[Any]]


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward: its metrics name, recipe key, weight and the call that scores completions."""

    name: str
    key: str  # e.g. grpo.rewards[1]: what every error names
    label: str  # what the user wrote: the kind, or module:function
    weight: float
    call: RewardCall


def import_function(path: str, key: str) -> RewardCall:
    """`module:function` imported from the working directory or PYTHONPATH, or one line saying why not."""
    module_name, _, attribute = path.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:  # `python llm_train/train.py` puts llm_train/, not the working directory, first
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module is theirs to fix
        raise UserError(
            f"{key}.function={path}: cannot import module '{module_name}' ({type(exc).__name__}: {first_line(exc)}); "
            f"put {module_name.replace('.', '/')}.py in the working directory or on PYTHONPATH"
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        names = sorted(n for n in vars(module) if callable(vars(module)[n]) and not n.startswith("_"))
        raise UserError(
            f"{key}.function={path}: module '{module_name}' has no '{attribute}'; "
            f"its functions: {', '.join(names) or 'none'}"
        )
    if not callable(function):
        raise UserError(
            f"{key}.function={path}: '{attribute}' is a {type(function).__name__}, not a function; name a function"
        )
    return function


def _format(spec: FormatReward) -> RewardCall:
    pattern = re.compile(spec.pattern, re.DOTALL)
    matches = pattern.fullmatch if spec.match == "full" else pattern.search

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [1.0 if matches(c.strip() if spec.match == "full" else c) else 0.0 for c in completions]

    return reward


def _same_answer(found: str, expected: Any) -> bool:
    """Equal as text (outer whitespace ignored), or as numbers when both read as numbers ('3.0' == '3')."""
    found, wanted = found.strip(), str(expected).strip()
    if found == wanted:
        return True
    try:
        return math.isclose(float(found.replace(",", "")), float(wanted.replace(",", "")))
    except ValueError:
        return False


def _final_answer(pattern: str | None) -> Callable[[str], str | None]:
    """The text's answer: the last match of `pattern` (its first group if it has one); None: no match."""
    compiled = re.compile(pattern, re.DOTALL) if pattern is not None else None

    def final_answer(text: str) -> str | None:
        if compiled is None:
            return text
        found = list(compiled.finditer(text))
        if not found:
            return None
        last = found[-1]
        return last.group(1) if compiled.groups else last.group(0)

    return final_answer


def _exact_match(spec: ExactMatchReward, key: str) -> RewardCall:
    final_answer, right_answer = _final_answer(spec.pattern), _final_answer(spec.column_pattern)

    def reward(
        completions: list[str], prompts: Any = None, completion_ids: Any = None, **columns: Any
    ) -> list[float]:
        if spec.column not in columns:
            raise UserError(
                f"{key}.column={spec.column}: the prompt rows have no field '{spec.column}' (fields: "
                f"{', '.join(sorted(columns)) or 'none'}); name one of them"
            )
        answers = [final_answer(c) for c in completions]
        expected = [right_answer(str(e)) for e in columns[spec.column]]
        return [
            1.0 if a is not None and e is not None and _same_answer(a, e) else 0.0
            for a, e in zip(answers, expected, strict=True)
        ]

    return reward


def _overlong(spec: OverlongReward, max_completion_length: int, key: str) -> RewardCall:
    if spec.buffer >= max_completion_length:
        raise UserError(
            f"{key}.buffer={spec.buffer} must be below grpo.max_completion_length={max_completion_length}; "
            "lower the buffer"
        )
    free = max_completion_length - spec.buffer

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        lengths = [len(ids) for ids in completion_ids]
        return [0.0 if n <= free else max(-1.0, (free - n) / spec.buffer) for n in lengths]

    return reward


def _reward_model(spec: RewardModelReward, key: str) -> RewardCall:
    """Loaded once, when the rewards are built (before any worker starts, then in each), so a wrong path is one
    line up front. Scored in fp32 on the CPU: the policy's engine holds the accelerator."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{key}.path: cannot load a reward model from '{spec.path}' ({first_line(exc)}); give the final/ "
            "directory of an objective reward run"
        ) from None
    if model.config.num_labels != 1 or model.config.pad_token_id is None:
        raise UserError(
            f"{key}.path: '{spec.path}' has {model.config.num_labels} outputs and pad id "
            f"{model.config.pad_token_id}; a reward model has one output and a pad id (objective reward's final/)"
        )
    # Right padding with the model's own pad id: the head reads each row at its last non-pad token.
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = model.config.pad_token_id

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        texts = [f"{p}{c}" for p, c in zip(prompts, completions, strict=True)]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            return [float(v) for v in model(**batch).logits[:, 0]]

    return reward


def build_reward(spec: Reward, index: int, max_completion_length: int) -> RewardFunction:
    key = f"grpo.rewards[{index}]"
    call: RewardCall
    if isinstance(spec, FunctionReward):
        call = import_function(spec.function, key)
        label = spec.function
        default_name = spec.function.rpartition(":")[2]
    else:
        label = default_name = spec.kind
        if isinstance(spec, FormatReward):
            call = _format(spec)
        elif isinstance(spec, ExactMatchReward):
            call = _exact_match(spec, key)
        elif isinstance(spec, RewardModelReward):
            call = _reward_model(spec, key)
        else:
            call = _overlong(spec, max_completion_length, key)
    return RewardFunction(spec.name or default_name, key, label, spec.weight, call)


def load_rewards(specs: Sequence[Reward], max_completion_length: int) -> list[RewardFunction]:
    """The recipe's rewards, every function imported: called once before the workers start (train.py) so an
    import error is one line, and again in each worker."""
    if not specs:
        raise UserError("grpo.rewards is empty; give at least one reward (e.g. {kind: format, pattern: ...})")
    rewards = [build_reward(spec, i, max_completion_length) for i, spec in enumerate(specs)]
    seen: dict[str, str] = {}
    for reward in rewards:
        if reward.name in seen:
            raise UserError(
                f"{reward.key} and {seen[reward.name]} are both named '{reward.name}' in the metrics; "
                f"set {reward.key}.name to tell them apart"
            )
        seen[reward.name] = reward.key
    return rewards


def _checked(reward: RewardFunction, values: Any, n: int) -> list[float]:
    """The function's values as floats (NaN for None), or one line saying what is wrong with them."""
    where = f"{reward.key} ({reward.label})"
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise UserError(
            f"{where} returned a {type(values).__name__}; return a list with one float (or None) per completion"
        )
    if len(values) != n:
        raise UserError(
            f"{where} returned {len(values)} values for {n} completions; return one float (or None) per completion"
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise UserError(
                f"{where} returned {value!r} ({type(value).__name__}) for completion {i}; return a finite float, "
                "or None to leave a completion unscored"
            )
        out.append(float(value))
    return out


def score(
    rewards: Sequence[RewardFunction],
    prompts: list[Any],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> torch.Tensor:
    """[completions, functions] float32 rewards of this rank's completions, NaN where a function returned None."""
    n = len(completions)
    table = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        try:
            values = reward.call(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
        except UserError:
            raise
        except Exception as exc:  # the user's function failed: one line, not a worker's traceback
            raise UserError(
                f"{reward.key} ({reward.label}) raised {type(exc).__name__}: {first_line(exc)}; fix the function "
                "(it is called with prompts, completions, completion_ids and the prompt rows' fields as keywords)"
            ) from None
        table[:, j] = torch.tensor(_checked(reward, values, n))
    return table


def gather(local: torch.Tensor | UserError, comm: Collectives) -> torch.Tensor:
    """Every rank's reward rows, in rank order (each rank's completions are whole groups, see grpo.py).

    `local` is this rank's scoring error when its rewards failed (`score` raised): the gather then raises
    that one line on every rank. A rank that raised alone would leave the others waiting in this
    collective until gloo/NCCL broke it, and their tracebacks would bury the line that says what to fix.
    """
    gathered = comm.gather_objects(local.cpu() if isinstance(local, torch.Tensor) else str(local))
    failed = [g for g in gathered if isinstance(g, str)]
    if failed:
        raise UserError(failed[0])
    return torch.cat([g for g in gathered if isinstance(g, torch.Tensor)], dim=0)


def reward_metrics(
    rewards: Sequence[RewardFunction], table: torch.Tensor, weighted: torch.Tensor, zero_std: torch.Tensor
) -> dict[str, float]:
    """The step's reward metrics over every rank's completions (TRL's rewards/<name>/mean and /std, reward,
    reward_std, frac_reward_zero_std); None values left out."""
    out: dict[str, float] = {}
    for j, reward in enumerate(rewards):
        column = table[:, j]
        out[f"reward_{reward.name}_mean"] = float(torch.nanmean(column))
        out[f"reward_{reward.name}_std"] = _nanstd(column)
    out["reward_mean"] = float(torch.nanmean(weighted))
    out["reward_std"] = _nanstd(weighted)
    out["frac_reward_zero_std"] = float(zero_std.float().mean())
    return out


def _nanstd(x: torch.Tensor) -> float:
    kept = x[~torch.isnan(x)]
    return float(kept.std()) if kept.numel() > 1 else float("nan")
