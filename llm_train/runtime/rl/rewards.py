"""What GRPO's completions are scored by: the recipe's `grpo.rewards`, each a weighted function.

A reward kind (`kind:`) has two halves, like a data format: its schema class in config/objective_sections.py (one
member of `Reward`, what a recipe may write) and its row of `REWARD_KINDS` below (how it is built). Built in:
`format` (a regular expression the completion matches), `exact_match` (the completion's final answer against a
column of the prompt's row) and `overlong` (DAPO's soft length penalty), `reward_model` (a trained reward model's
score, objective reward's final/). `function` imports yours, `module:function`, from the working directory or
PYTHONPATH, and calls it exactly as TRL 1.16's GRPOTrainer (`_calculate_rewards`) calls a reward function,
with keyword arguments only, so a function written for TRL runs unchanged:

    function(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns,
             trainer_state=..., log_metric=..., log_extra=...) -> [float | None, ...]

one entry per completion (a prompt appears once per generation). In TRL's shapes: a conversational prompt
(a list of {role, content} messages) comes as that list and its completion as
`[{"role": "assistant", "content": text}]`; a text prompt and its completion as strings. `columns` are the
prompt rows' other fields (e.g. `answer=[...]`); `trainer_state` is a transformers `TrainerState` with
TRL's attribute names (`global_step`: optimizer steps done, `max_steps`); `log_metric(name, value)` logs a
scalar beside the step's metrics (averaged over the step's calls and the ranks); `log_extra(column, values)`
adds a column, one value per completion, to the completions table. An `async def` function (or a callable
whose `__call__` is async, TRL's `is_async_callable`) is awaited, all of them concurrently. None means "not
mine to score": the completion is left out of that function's mean and of the weighted sum (NaN-aware, as
TRL); a completion no function scores gets advantage 0 (loss/grpo.py), and a generation where no function
scored anything says so on screen (grpo.py).

Every way a reward function can go wrong is the user's to fix, so each is one line that names the
recipe key and what to change (UserError): a function that cannot be imported or is not callable (found
before any worker starts, `load_rewards`), one that raises, returns the wrong number of values, or a
value that is not a finite number or None.

Each rank scores its own completions; `gather` then puts every rank's rows together, in rank order,
before the group advantages (a batch-scaled std, and the metrics, need all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import math
import numbers
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from llm_train.config.objective_sections import (
    ExactMatchReward,
    FormatReward,
    FunctionReward,
    OverlongReward,
    Reward,
    RewardModelReward,
)
from llm_train.config.section import Section
from llm_train.data.formats.prompted import ChatRenderer
from llm_train.errors import UserError, first_line
from llm_train.runtime.base.collectives import Collectives

RewardCall = Callable[..., Any]
# The keywords beside the data every function receives (RewardContext), never a prompt row's field.
CONTEXT_KEYS = ("trainer_state", "log_metric", "log_extra")


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward: its metrics name, recipe key, weight and the call that scores completions."""

    name: str
    key: str  # e.g. grpo.rewards[1]: what every error names
    label: str  # what the user wrote: the kind, or module:function
    weight: float
    call: RewardCall
    columns: tuple[str, ...] = ()  # the prompt rows' fields it needs (checked by `check_columns`)


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


def completions_as_trl(prompts: Sequence[Any], texts: list[str]) -> list[Any]:
    """The completions as TRL hands them to reward functions: for conversational prompts (message lists)
    each is `[{"role": "assistant", "content": text}]` (grpo_trainer.py, `_generate_and_score_completions`),
    else the text itself."""
    if prompts and isinstance(prompts[0], list):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)


def _text(completion: Any) -> str:
    """A completion's text whichever shape it came in (the built-ins accept both of TRL's)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def is_async_callable(function: Any) -> bool:
    """TRL's test (trainer/utils.py): partials unwrapped; an instance whose `__call__` is async counts."""
    while isinstance(function, functools.partial):
        function = function.func
    call = type(function).__call__ if not inspect.isfunction(function) and callable(function) else None
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


@dataclass
class RewardLog:
    """What reward functions report through TRL's `log_metric` and `log_extra` keywords during one generation
    (TRL's `_log_metric` / `_log_completion_extra`): scalars per name, extra table columns per name."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    extra: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra[column].extend(values)

    def drain(self) -> tuple[dict[str, float], dict[str, list[Any]]]:
        """(each logged metric's mean, the extra columns), and empty for the next generation."""
        means = {name: sum(v) / len(v) for name, v in self.metrics.items() if v}
        extra = dict(self.extra)
        self.metrics, self.extra = defaultdict(list), defaultdict(list)
        return means, extra


@dataclass
class RewardContext:
    """The keywords TRL passes every reward function beside the data: `trainer_state` (a transformers
    TrainerState, whose `global_step` the rollouts advance), `log_metric` and `log_extra` (`log`)."""

    trainer_state: Any = None
    log: RewardLog = field(default_factory=RewardLog)

    def __post_init__(self) -> None:
        if self.trainer_state is None:
            from transformers import TrainerState

            self.trainer_state = TrainerState()

    @classmethod
    def at_step(cls, global_step: int, max_steps: int) -> RewardContext:
        from transformers import TrainerState

        return cls(TrainerState(global_step=global_step, max_steps=max_steps))

    def keywords(self) -> dict[str, Any]:
        return {
            "trainer_state": self.trainer_state,
            "log_metric": self.log.log_metric,
            "log_extra": self.log.log_extra,
        }


def _format(spec: FormatReward) -> RewardCall:
    pattern = re.compile(spec.pattern, re.DOTALL)
    matches = pattern.fullmatch if spec.match == "full" else pattern.search

    def reward(completions: list[Any], **_: Any) -> list[float]:
        texts = [_text(c) for c in completions]
        return [1.0 if matches(c.strip() if spec.match == "full" else c) else 0.0 for c in texts]

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
        completions: list[Any], prompts: Any = None, completion_ids: Any = None, **columns: Any
    ) -> list[float]:
        if spec.column not in columns:
            raise UserError(
                f"{key}.column={spec.column}: the prompt rows have no field '{spec.column}' (fields: "
                f"{', '.join(sorted(set(columns) - set(CONTEXT_KEYS))) or 'none'}); name one of them"
            )
        answers = [final_answer(_text(c)) for c in completions]
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

    renderer = ChatRenderer(tokenizer, None, key)

    def reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        rows = [
            reward_model_ids(tokenizer, renderer, p, c) for p, c in zip(prompts, completions, strict=True)
        ]
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        batch = {
            "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        }
        with torch.no_grad():
            return [float(v) for v in model(**batch).logits[:, 0]]

    return reward


def reward_model_ids(tokenizer: Any, renderer: ChatRenderer, prompt: Any, completion: Any) -> list[int]:
    """Prompt + completion as objective reward trained on them (data/formats/preference.py, prompted.py), prompt
    and response encoded apart so no token merges across the boundary:

    - a conversational prompt: the reward model's own chat template, the prompt with its generation prompt, then
      the text the template adds for the assistant's completion (its end-of-turn token included), without added
      special tokens: TRL's `_calculate_rewards` renders prompt + completion through the reward model's template too;
    - a text prompt, when the reward model's tokenizer has a chat template: as one user message, rendered as
      above (the preference format turns a text prompt of message pairs into a user message the same way);
    - a text prompt, without a chat template: the prompt with the tokenizer's special tokens (bos), the
      completion, then eos: the preference format's text pairs.
    TRL scores text prompts as a plain `prompt + completion` string; a reward model trained on rendered
    conversations scores that as text it never saw (the issue measured 5.48 rendered against -0.30 raw on
    one of its own training pairs), so ours renders it as it was trained.
    """
    text = _text(completion)
    if not isinstance(prompt, list) and getattr(tokenizer, "chat_template", None):
        prompt = [{"role": "user", "content": str(prompt)}]
    if isinstance(prompt, list):
        prompt_text = renderer(list(prompt), generation_prompt=True)
        conversation = [*prompt, {"role": "assistant", "content": text}]
        response = renderer.after_prompt(prompt_text, conversation, renderer.key)
        return list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"]) + list(
            tokenizer(response, add_special_tokens=False)["input_ids"]
        )
    ids = list(tokenizer(str(prompt))["input_ids"]) + list(
        tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


Spec = TypeVar("Spec", bound=Section)


@dataclass(frozen=True)
class RewardKind(Generic[Spec]):
    """The runtime half of one reward kind: how its recipe entry (`schema`, config/objective_sections.py) becomes
    the call that scores completions, and what the metrics and errors call it."""

    schema: type[Spec]
    # (its recipe entry, its key such as grpo.rewards[1], grpo.max_completion_length) -> the call; a mistake the
    # entry makes is one UserError naming the key, raised here (before any worker starts, `load_rewards`).
    build: Callable[[Spec, str, int], RewardCall]
    # What the user wrote (errors name it) and the metrics' name when the entry sets none; None: the kind.
    label: Callable[[Spec], str] | None = None
    default_name: Callable[[Spec], str] | None = None
    # The prompt rows' fields it needs (`check_columns`): by default those its call's signature requires.
    columns: Callable[[Spec, RewardCall], tuple[str, ...]] = lambda spec, call: needed_columns(call)


# Every reward kind, by the `kind` a recipe writes; config/objective_sections.py `Reward` is the schema half, and
# tests/unit/test_reward_kinds.py fails while the two name different kinds (docs/development.md, "Adding a reward
# kind").
REWARD_KINDS: dict[str, RewardKind[Any]] = {
    "format": RewardKind(FormatReward, lambda spec, key, max_length: _format(spec)),
    "exact_match": RewardKind(
        ExactMatchReward,
        lambda spec, key, max_length: _exact_match(spec, key),
        # Its call takes every field (**columns): the one it reads is the recipe's `column`.
        columns=lambda spec, call: (spec.column,),
    ),
    "overlong": RewardKind(OverlongReward, lambda spec, key, max_length: _overlong(spec, max_length, key)),
    "function": RewardKind(
        FunctionReward,
        lambda spec, key, max_length: import_function(spec.function, key),
        label=lambda spec: spec.function,
        default_name=lambda spec: spec.function.rpartition(":")[2],
    ),
    "reward_model": RewardKind(RewardModelReward, lambda spec, key, max_length: _reward_model(spec, key)),
}


def build_reward(spec: Reward, index: int, max_completion_length: int) -> RewardFunction:
    key = f"grpo.rewards[{index}]"
    kind = REWARD_KINDS[spec.kind]
    call = kind.build(spec, key, max_completion_length)
    label = kind.label(spec) if kind.label else spec.kind
    name = spec.name or (kind.default_name(spec) if kind.default_name else spec.kind)
    return RewardFunction(name, key, label, spec.weight, call, kind.columns(spec, call))


# What every reward function receives besides the prompt rows' fields (TRL 1.16's keywords).
PASSED = ("prompts", "completions", "completion_ids", *CONTEXT_KEYS, "environments")


def needed_columns(call: RewardCall) -> tuple[str, ...]:
    """The parameters a function requires that only a prompt row's field can fill (no default, not one of the
    keywords every function receives); () when its signature cannot be read."""
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in PASSED
    )


def check_columns(rewards: Sequence[RewardFunction], columns: Sequence[str]) -> None:
    """Every field the rewards need is a field of the prompt rows, or one line naming the reward and the fields
    there are (`--dry-run` checks it before any run; a run would stop at its first scoring)."""
    for reward in rewards:
        missing = [c for c in reward.columns if c not in columns]
        if missing:
            raise UserError(
                f"{reward.key} ({reward.label}) needs the field '{missing[0]}' but the prompt rows have "
                f"{', '.join(sorted(columns)) or 'no other field'}; add it to the data or name one of them"
            )


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
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    context: RewardContext | None = None,
) -> torch.Tensor:
    """[completions, functions] float32 rewards of this rank's completions, NaN where a function returned None.

    Called as TRL calls them: synchronous functions one after another, then every async one awaited
    concurrently (TRL: asyncio.gather on its event loop); `completions` already in TRL's shape
    (`completions_as_trl`)."""
    n = len(completions)
    keywords = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **columns,
        **(context or RewardContext()).keywords(),
    }
    table = torch.empty(n, len(rewards), dtype=torch.float32)
    pending: list[tuple[int, RewardFunction]] = []
    for j, reward in enumerate(rewards):
        if is_async_callable(reward.call):
            pending.append((j, reward))
            continue
        with _failures_named(reward):
            values = reward.call(**keywords)
        if inspect.isawaitable(values):  # a sync wrapper around an async function: await it like TRL's
            pending.append(
                (j, RewardFunction(reward.name, reward.key, reward.label, reward.weight, _done(values)))
            )
            continue
        table[:, j] = torch.tensor(_checked(reward, values, n))
    if pending:
        for (j, reward), values in zip(pending, _await_all(pending, keywords), strict=True):
            table[:, j] = torch.tensor(_checked(reward, values, n))
    return table


def _done(awaitable: Any) -> RewardCall:
    async def call(**_: Any) -> Any:
        return await awaitable

    return call


def _await_all(pending: list[tuple[int, RewardFunction]], keywords: dict[str, Any]) -> list[Any]:
    """Every async function's values, awaited concurrently; a failure is one line naming its key."""

    async def one(reward: RewardFunction) -> Any:
        with _failures_named(reward):
            return await reward.call(**keywords)

    async def every() -> list[Any]:
        return list(await asyncio.gather(*(one(r) for _, r in pending)))

    return asyncio.run(every())


@contextlib.contextmanager
def _failures_named(reward: RewardFunction) -> Iterator[None]:
    """A user's function that raised: one line naming its key, not a worker's traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # the user's function failed: theirs to fix
        raise UserError(
            f"{reward.key} ({reward.label}) raised {type(exc).__name__}: {first_line(exc)}; fix the function (it "
            "is called as TRL calls one: prompts, completions, completion_ids, the prompt rows' fields, "
            "trainer_state, log_metric and log_extra, as keywords)"
        ) from None


def gather(local: torch.Tensor | UserError, comm: Collectives) -> torch.Tensor:
    """Every rank's reward rows, in rank order: the step's groups back together (a group may span ranks, grpo.py).

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
    """The step's reward metrics over every rank's completions, under TRL's names (`rewards/<name>/mean` and
    `/std`, `reward`, `reward_std`, `frac_reward_zero_std`), so a dashboard built on a TRL run reads ours;
    None values left out. `frac_reward_unscored`: the completions no function scored (TRL warns about them)."""
    out: dict[str, float] = {}
    for j, reward in enumerate(rewards):
        column = table[:, j]
        out[f"rewards/{reward.name}/mean"] = float(torch.nanmean(column))
        out[f"rewards/{reward.name}/std"] = _nanstd(column)
    out["reward"] = float(torch.nanmean(weighted))
    out["reward_std"] = _nanstd(weighted)
    out["frac_reward_zero_std"] = float(zero_std.float().mean())
    out["frac_reward_unscored"] = float(torch.isnan(table).all(dim=1).float().mean()) if len(table) else 0.0
    return out


def _nanstd(x: torch.Tensor) -> float:
    kept = x[~torch.isnan(x)]
    return float(kept.std()) if kept.numel() > 1 else float("nan")
