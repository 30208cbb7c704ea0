"""The planner chooses sub_group_size and loader workers for the host budget; the consumer recipes carry them."""

from __future__ import annotations

import dataclasses

import pytest

from llm_train.config.ds_json import load_ds_config
from llm_train.config.hardware import hardware_for
from llm_train.config.recipe import load_recipe
from llm_train.config.resolution import resolve_run
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import shape_from_config, shape_of
from llm_train.planning.search.candidate import memory_inputs
from llm_train.planning.search.host_settings import SUB_GROUP_CANDIDATES, choose_host_settings
from llm_train.units import GiB

CONSUMER_FULL_FINETUNES = ["7b-rtx4090", "8b-rtx4090", "8b-rtx4090-nvme", "13b-rtx4090-offload"]


def _planned(name: str) -> tuple[MemoryInputs, object]:
    recipe = load_recipe(name)
    hw = hardware_for(
        1, None, recipe.hardware.gpu_mem_gib, recipe.hardware.host_ram_gib, recipe, detect=False
    )
    run = resolve_run(name, [], world_size=1, device=hw.device())
    return memory_inputs(run, shape_from_config(run.model_fields)), hw


@pytest.mark.parametrize("name", CONSUMER_FULL_FINETUNES)
def test_the_consumer_recipes_carry_the_planners_host_settings(name: str) -> None:
    inp, hw = _planned(name)
    chosen = choose_host_settings(inp, hw)
    _, raw = load_ds_config(load_recipe(name).deepspeed.config)
    assert raw["zero_optimization"]["sub_group_size"] == chosen.sub_group_size, name
    assert load_recipe(name).data.loader_workers == chosen.loader_workers == 0, name


def test_smaller_sub_groups_win_only_by_more_than_half_a_gib() -> None:
    # 7B, exact-size buffers: the only term that moves is the 16-bit copy of the largest sub-group in flight
    # (2 bytes x ~1.01e9 at 1e9; never below the 131M-element embedding's group).
    inp, hw = _planned("7b-rtx4090")
    chosen = choose_host_settings(inp, hw)
    host = chosen.host_by_sub_group
    assert set(host) == set(SUB_GROUP_CANDIDATES)
    assert host[10**9] - host[min(host, key=host.get)] > GiB // 2  # 1e9 loses 1.6 GiB
    assert chosen.sub_group_size == 2 * 10**8 and host[2 * 10**8] - min(host.values()) <= GiB // 2
    # Under torch's pinning each sub-group's gradient rounds up on its own: 1e8 is the worst there.
    rounded = choose_host_settings(inp.vary(pinning="torch"), hw).host_by_sub_group
    assert rounded[10**8] == max(rounded.values())


def test_nvme_swap_buffers_follow_the_largest_sub_group() -> None:
    shape = shape_of("meta-llama/Llama-3.1-8B")
    inp = MemoryInputs.of(shape=shape, world_size=1, zero_stage=3, offload_optimizer="nvme", pinning="native")
    swap = {
        size: estimate_memory(inp.vary(sub_group_size=size)).host_terms["optimizer_swap_buffers"]
        for size in (10**8, 5 * 10**8, 10**9)
    }
    embedding = shape.vocab_size * shape.hidden_size
    assert swap[10**8] == 4 * 4 * embedding  # below the embedding, it decides
    assert swap[10**8] < swap[5 * 10**8] < swap[10**9]


def test_loader_workers_are_forked_only_when_the_budget_holds_their_copies() -> None:
    inp, hw = _planned("7b-rtx4090")
    assert choose_host_settings(inp, hw).loader_workers == 0  # +113 GiB of copy-on-write twins
    roomy = dataclasses.replace(hw, host_ram_bytes=512 * GiB)
    assert choose_host_settings(inp, roomy).loader_workers == 2
