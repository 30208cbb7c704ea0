"""Every tracker a recipe can switch on, one row each: the `tracking:` keys it reads, when it is on, what it writes.

The torch-free half of the tracker registry: config/ and the start-up summary (observability/console.py) ask it
without importing W&B or TensorBoard. The other half, how each is opened, is observability/tracking.py `OPENERS`,
keyed by the same names; tests/unit/test_tracker_registry.py fails while a tracker lacks either half, or a key of
the recipe's `tracking` section belongs to no tracker (docs/development.md, "Adding a tracker").

    name         on when                       writes in the run directory   its keys
    jsonl        always                        metrics.jsonl (KEY.jsonl      -
                                               per table)
    tensorboard  tracking.tensorboard: true    tensorboard/                  tensorboard
    wandb        tracking.mode != disabled     wandb/                        mode, project, entity, run_name, tags, group

Trackers run on rank 0 only, in this order; each receives every metric and table (observability/tracking.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llm_train.config.recipe_sections import TrackingSection


@dataclass(frozen=True)
class TrackerSpec:
    name: str
    on: Callable[[TrackingSection], bool]  # whether a recipe's `tracking` section turns it on
    output: Callable[[TrackingSection], str]  # what it writes, as the start-up summary's outputs list it
    keys: tuple[str, ...] = ()  # the `tracking` keys it reads (its switch first); none: always on


TRACKERS: dict[str, TrackerSpec] = {
    spec.name: spec
    for spec in (
        TrackerSpec("jsonl", lambda tracking: True, lambda tracking: "metrics.jsonl"),
        TrackerSpec(
            "tensorboard",
            lambda tracking: tracking.tensorboard,
            lambda tracking: "tensorboard/",
            ("tensorboard",),
        ),
        TrackerSpec(
            "wandb",
            lambda tracking: tracking.mode != "disabled",
            lambda tracking: f"wandb/ ({tracking.mode}, project {tracking.project})",
            ("mode", "project", "entity", "run_name", "tags", "group"),
        ),
    )
}


def trackers_on(tracking: TrackingSection) -> list[TrackerSpec]:
    """The trackers a recipe's `tracking` section turns on, in the table's order."""
    return [spec for spec in TRACKERS.values() if spec.on(tracking)]
