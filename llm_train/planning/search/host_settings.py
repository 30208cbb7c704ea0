"""The host-side settings of an offloaded run, chosen by the planner for a host-RAM budget.

Two settings decide how much host RAM an offloaded run takes beyond its model states:

- `sub_group_size` (the DS JSON's zero_optimization key): ZeRO-3 steps the optimizer one sub-group
  at a time. Under CPU offload a 16-bit copy of one sub-group is in flight during the step and,
  under torch's pinning, each sub-group's gradient is rounded up to a power of two on its own;
  under NVMe offload every swap buffer is as large as the largest sub-group. Smaller sub-groups
  cost more, smaller I/O requests and CPU Adam calls; the largest sub-group is never smaller than
  the largest tensor (the embedding). The choice: the largest candidate whose host estimate is
  within SUB_GROUP_SLACK_BYTES of the smallest any candidate reaches.
- `data.loader_workers`: forked workers keep copy-on-write twins of the optimizer state the parent
  rewrites (planning/memory/offload_buffers.py, its docstring on forked loader workers). The choice: the CUDA default of 2 when the run fits
  the budget with them, else 0 (batches are cut in the training process).

Bucket sizes (reduce, prefetch, all-gather) are GPU buffers, counted in the GPU rows: they do not
move the host estimate, so the host budget does not choose them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_train.config.hardware import Hardware
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.search.candidate import needs
from llm_train.units import GiB

SUB_GROUP_CANDIDATES = (10**7, 2 * 10**7, 5 * 10**7, 10**8, 2 * 10**8, 5 * 10**8, 10**9)
# Within half a GiB of the smallest host estimate, fewer and larger sub-groups win: the saving below
# that is noise next to the estimate's own precision.
SUB_GROUP_SLACK_BYTES = GiB // 2
DEFAULT_CUDA_LOADER_WORKERS = 2  # data/dealer.py's default on CUDA


@dataclass(frozen=True)
class HostSettings:
    """The planner's choice for one run and budget, with the host estimate under each candidate."""

    sub_group_size: int
    loader_workers: int
    host_by_sub_group: dict[int, int]
    """Host bytes per node under each sub_group_size candidate (no forked workers)."""
    host_with_workers: int
    """Host bytes per node with DEFAULT_CUDA_LOADER_WORKERS forked workers at the chosen sub_group_size."""


def choose_host_settings(inp: MemoryInputs, hw: Hardware) -> HostSettings:
    """sub_group_size and loader workers for `inp` on `hw` (module docstring for the rules)."""
    host: dict[int, int] = {}
    for size in SUB_GROUP_CANDIDATES:
        host[size] = needs(estimate_memory(inp.vary(sub_group_size=size, loader_forks=False)), inp, hw.kind)[
            1
        ]
    smallest = min(host.values())
    chosen = max(size for size, nbytes in host.items() if nbytes <= smallest + SUB_GROUP_SLACK_BYTES)
    forked = inp.vary(sub_group_size=chosen, loader_forks=hw.kind == "cuda")
    with_workers = needs(estimate_memory(forked), inp, hw.kind)[1]
    workers = DEFAULT_CUDA_LOADER_WORKERS if with_workers <= hw.host_limit_bytes else 0
    return HostSettings(chosen, workers, host, with_workers)


def describe(settings: HostSettings, inp: MemoryInputs) -> str:
    """One line for `llm-train plan`: the choice, and what the run's own settings cost against it."""
    ours = settings.host_by_sub_group.get(inp.sub_group_size)
    worse = f" (the DS JSON's {inp.sub_group_size:.0e}: {ours / GiB:.1f} GiB)" if ours else ""
    chosen = settings.host_by_sub_group[settings.sub_group_size]
    workers = f"data.loader_workers {settings.loader_workers}" + (
        f" (forked workers would take the host to {settings.host_with_workers / GiB:.1f} GiB)"
        if settings.loader_workers == 0
        else ""
    )
    return (
        f"host settings for this budget: sub_group_size {settings.sub_group_size:.0e} "
        f"(host {chosen / GiB:.1f} GiB){'' if inp.sub_group_size == settings.sub_group_size else worse}, {workers}"
    )
