"""A tracker is one registered object: its torch-free row (config/trackers.py `TRACKERS`: when a recipe turns it
on, the `tracking` keys it reads, what it writes) and its opener (observability/tracking.py `OPENERS`) exist under
one name, and every key of the recipe's `tracking` section belongs to exactly one tracker. These checks fail while a
half is missing (docs/development.md, "Adding a tracker").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llm_train.config.recipe_sections import TrackingSection
from llm_train.config.trackers import TRACKERS, trackers_on
from llm_train.observability.tracking import OPENERS, JsonlTracker, TensorBoardTracker, open_trackers


def test_every_tracker_has_its_opener_under_the_same_name() -> None:
    assert list(TRACKERS) == list(OPENERS)
    for name, spec in TRACKERS.items():
        assert spec.name == name


def test_every_tracking_key_belongs_to_one_tracker() -> None:
    """A key added to the schema without its tracker, or a tracker reading a key the schema lacks, fails here."""
    keys = [key for spec in TRACKERS.values() for key in spec.keys]
    assert sorted(keys) == sorted(TrackingSection.model_fields)
    assert [name for name, spec in TRACKERS.items() if not spec.keys] == ["jsonl"]  # the one always on


def test_each_trackers_switch_turns_it_on_and_opens_it(tmp_path: Path) -> None:
    """Off by default (but metrics.jsonl); each switch turns its tracker on and open_trackers opens that one.
    W&B's is only asked (opening it starts its service; tests/unit/test_tracking.py runs it offline)."""
    assert [s.name for s in trackers_on(TrackingSection())] == ["jsonl"]
    assert [s.name for s in trackers_on(TrackingSection(tensorboard=True))] == ["jsonl", "tensorboard"]
    assert [s.name for s in trackers_on(TrackingSection(mode="offline"))] == ["jsonl", "wandb"]
    opened = open_trackers(TrackingSection(tensorboard=True), tmp_path, {}, True)
    try:
        assert [type(t) for t in opened.trackers] == [JsonlTracker, TensorBoardTracker]
    finally:
        opened.close()
    assert {p.name for p in tmp_path.iterdir()} == {"metrics.jsonl", "tensorboard"}


def test_the_summary_lists_what_each_tracker_writes() -> None:
    tracking = TrackingSection(mode="offline", project="p", tensorboard=True)
    assert [spec.output(tracking) for spec in trackers_on(tracking)] == [
        "metrics.jsonl",
        "tensorboard/",
        "wandb/ (offline, project p)",
    ]


def test_the_table_imports_no_tracker_library() -> None:
    """config/ reads the table before any tracker library loads (a fresh interpreter)."""
    code = (
        "import sys, llm_train.config.trackers; "
        "sys.exit(any(m in sys.modules for m in ('torch', 'wandb', 'tensorboard')))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
