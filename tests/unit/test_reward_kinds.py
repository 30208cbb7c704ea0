"""A reward kind is one registered object: its schema class (config/objective_sections.py, a member of `Reward`) and
its builder (runtime/rl/rewards.py `REWARD_KINDS`) exist together under one `kind`, the schema's description and
docs/rl.md's table name it. These checks fail while a half is missing (docs/development.md, "Adding a reward
kind").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from llm_train.config.objective_sections import REWARD_CLASSES, GrpoSection, Reward, parse_reward
from llm_train.runtime.rl import rewards
from llm_train.runtime.rl.rewards import REWARD_KINDS, build_reward

REPO = Path(__file__).resolve().parents[2]


def test_every_schema_class_has_its_builder_under_the_same_kind() -> None:
    assert list(REWARD_CLASSES) == list(REWARD_KINDS)
    assert tuple(REWARD_CLASSES.values()) == get_args(Reward)
    assert get_args(GrpoSection.model_fields["rewards"].annotation) == (Reward,)
    for kind, row in REWARD_KINDS.items():
        assert row.schema is REWARD_CLASSES[kind], kind
        assert REWARD_CLASSES[kind].model_fields["kind"].default == kind


def test_build_reward_asks_the_registry_and_no_class_test() -> None:
    """No `isinstance` ladder over the schema classes left in rewards.py: a kind is built by its row alone."""
    source = Path(rewards.__file__).read_text()
    assert not re.search(
        r"isinstance\([^)]*\b(" + "|".join(c.__name__ for c in get_args(Reward)) + r")\b", source
    )


# A minimal entry of each kind that builds without files or imports (function and reward_model load something).
MINIMAL = {
    "format": {"pattern": "x"},
    "exact_match": {"column": "solution"},
    "overlong": {"buffer": 4},
}


def test_each_row_builds_a_call_with_its_name_label_and_columns() -> None:
    for kind, fields in MINIMAL.items():
        reward = build_reward(parse_reward({"kind": kind, **fields}, "r"), 2, 16)
        assert (reward.name, reward.label, reward.key) == (kind, kind, "grpo.rewards[2]")
        assert callable(reward.call)
    assert build_reward(parse_reward({"kind": "exact_match", "column": "solution"}, "r"), 0, 16).columns == (
        "solution",
    )
    function = REWARD_KINDS["function"]
    spec = parse_reward({"kind": "function", "function": "pkg.sub:check"}, "r")
    assert function.label is not None and function.default_name is not None
    assert (function.label(spec), function.default_name(spec)) == ("pkg.sub:check", "check")


def test_the_docs_and_the_schema_name_every_kind() -> None:
    table = (REPO / "docs" / "rl.md").read_text().split("## Rewards", 1)[1].split("\n\n", 2)[1]
    assert re.findall(r"^\| `(\w+)`", table, re.MULTILINE) == list(REWARD_CLASSES)
    description = GrpoSection.model_fields["rewards"].description or ""
    assert f"{{kind: {'|'.join(REWARD_CLASSES)}," in description
