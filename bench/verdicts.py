"""Verdicts: a measured number against the planner's estimate for the same configuration (+-15%) and against a
target (`verdict`, `judge`, `Judging`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ESTIMATE_TOLERANCE = 0.15  # the planner's stated precision (~15% on memory and speed)
NOT_JUDGED = "cpu-tiny: the planner's estimates and the targets are for GPUs"


def verdict(
    quantity: str,
    measured: float | None,
    estimate: float | None = None,
    target: float | None = None,
    higher_is_better: bool = True,
    tolerance: float = ESTIMATE_TOLERANCE,
    judged: bool = True,
    why_not_judged: str | None = None,
) -> dict[str, Any]:
    """One measured quantity judged against an estimate (within +-tolerance) and/or a target.

    `passed` is False when the estimate or the target is missed, or when nothing was measured although
    something was expected. judged=False records the comparison without enforcing it (why_not_judged says
    why: e.g. a CPU check of a GPU script, whose numbers mean nothing).
    """
    out: dict[str, Any] = {"quantity": quantity, "measured": measured}
    misses: list[str] = []
    if estimate is None and target is None:
        misses.append(f"{quantity}: no estimate to judge it against")
    if estimate is not None:
        out.update(estimate=estimate, tolerance=tolerance)
        if measured is None:
            misses.append(f"{quantity}: not measured (estimate {estimate:.4g})")
        else:
            ratio = measured / estimate if estimate else math.inf
            out.update(ratio=ratio, within_estimate=abs(ratio - 1) <= tolerance)
            if not out["within_estimate"]:
                misses.append(
                    f"{quantity} {measured:.4g} is {ratio - 1:+.0%} off the planner's {estimate:.4g} "
                    f"(allowed +-{tolerance:.0%})"
                )
    if target is not None:
        out.update(target=target, higher_is_better=higher_is_better)
        if measured is None:
            misses.append(f"{quantity}: not measured (target {target:.4g})")
        else:
            out["target_met"] = measured >= target if higher_is_better else measured <= target
            if not out["target_met"]:
                sign = ">=" if higher_is_better else "<="
                misses.append(f"{quantity} {measured:.4g} misses its target {sign} {target:.4g}")
    out["judged"] = judged
    if not judged:
        out["why_not_judged"] = why_not_judged
    out["misses"] = misses
    out["passed"] = not (judged and misses)
    return out


def judge(record: dict[str, Any], verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """`record` with its verdicts; a judged miss fails the line (passed False, `error` names the misses)."""
    record["verdicts"] = [*record.get("verdicts", []), *verdicts]
    record.setdefault("passed", True)
    missed = [m for v in verdicts if v["judged"] for m in v["misses"]]
    if missed:
        record["passed"] = False
        record["error"] = "; ".join([*([record["error"]] if record.get("error") else []), *missed])
    return record


@dataclass(frozen=True)
class Judging:
    """How measured cases are judged: against the planner's estimates (enforced on a GPU), or against
    estimates injected with --expect NAME.QUANTITY=VALUE (enforced anywhere: the CI test's hook)."""

    enforce: bool
    injected: dict[str, float] = field(default_factory=dict)

    def against(
        self,
        name: str,
        quantity: str,
        measured: float | None,
        planner: float | None = None,
        target: float | None = None,
        higher_is_better: bool = True,
    ) -> dict[str, Any]:
        key = f"{name}.{quantity}"
        judged = self.enforce or key in self.injected
        return verdict(
            quantity,
            measured,
            estimate=self.injected.get(key, planner),
            target=target,
            higher_is_better=higher_is_better,
            judged=judged,
            why_not_judged=None if judged else NOT_JUDGED,
        )
