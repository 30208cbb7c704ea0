"""Host RAM of CPU offload: DeepSpeed's own grouping code, torch's rounding rule, bytes by hand."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from llm_train.planning.host_offload import held_bytes, trainable_tensors, zero3_sub_groups
from llm_train.planning.memory import GiB, MemoryInputs, estimate_memory
from llm_train.planning.shapes import shape_of

LLAMA2_7B = shape_of("meta-llama/Llama-2-7b-hf")
# Llama-2-7B: embedding + head 2*V*h, per layer 4h^2 + 3*h*I matrices and two norms, a final norm.
V, H, L, I_MLP = 32000, 4096, 32, 11008
MATRICES_7B = 2 * V * H + L * (4 * H * H + 3 * H * I_MLP)  # 6,738,149,376
NORMS_7B = (2 * L + 1) * H  # 266,240
PSI_7B = MATRICES_7B + NORMS_7B
MiB = 2**20


def test_pinned_buffers_take_the_next_power_of_two() -> None:
    # torch's CachingHostAllocator::allocate rounds with PowerOf2Ceil (ATen/core/CachingHostAllocator.h).
    assert held_bytes(4 * 1_011_875_840, "torch") == 2**32  # one fp32 sub-group of Llama-2-7B: 3.77 -> 4 GiB
    assert held_bytes(2 * PSI_7B, "torch") == 2**34  # the flat 16-bit gradient buffer: 12.55 -> 16 GiB
    assert held_bytes(2**32, "torch") == 2**32 and held_bytes(2**32 + 1, "torch") == 2**33
    assert held_bytes(2 * PSI_7B, "off") == 2 * PSI_7B and held_bytes(0, "torch") == 0


def test_trainable_tensors_are_the_model_in_the_optimizers_two_groups() -> None:
    matrices, vectors = trainable_tensors(LLAMA2_7B, None)
    assert (sum(matrices), sum(vectors)) == (MATRICES_7B, NORMS_7B)
    assert len(matrices) == 2 + 7 * L and len(vectors) == 2 * L + 1
    assert matrices[0] == V * H and matrices[1:8] == [H * H] * 4 + [H * I_MLP] * 3  # registration order
    lora, none = trainable_tensors(LLAMA2_7B, 16)
    assert sum(lora) == LLAMA2_7B.lora_params(16) and none == []


def test_sub_groups_are_deepspeeds_own() -> None:
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")

    def deepspeed_groups(numels: list[int], size: int) -> list[int]:
        params = [SimpleNamespace(partition_numel=lambda n=n: n) for n in numels]
        groups = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(
            SimpleNamespace(sub_group_size=size), params
        )
        return [sum(p.partition_numel() for p in g) for g in groups]

    matrices, vectors = trainable_tensors(LLAMA2_7B, None)
    for numels, size in [
        ([3, 4, 5, 6, 1], 7),
        ([3, 4], 100),
        (matrices, 10**9),
        (matrices, 10**8),
        (vectors, 10**9),
    ]:
        assert zero3_sub_groups(numels, size) == deepspeed_groups(numels, size), size
    # Llama-2-7B at DeepSpeed's 1e9: six groups just over 1e9 elements and the rest.
    assert zero3_sub_groups(matrices, 10**9) == [1_007_681_536] + [1_011_875_840] * 5 + [671_088_640]


def offload_7b(**changes: object) -> MemoryInputs:
    """7b-rtx4090 as planned: one process, ZeRO-3, optimizer on CPU, bf16, micro 4, checkpointing."""
    inp = MemoryInputs.of(
        shape=LLAMA2_7B,
        world_size=1,
        zero_stage=3,
        offload_optimizer="cpu",
        micro_batch=4,
        activation_checkpointing=True,
    )
    return dataclasses.replace(inp, **changes)


def test_zero3_cpu_adam_host_terms_by_hand() -> None:
    est = estimate_memory(offload_7b())
    t = est.host_terms
    # stage3.py _create_fp32_partitions: fp32 master; cpu_adam.py: m and v at the first step. Pageable.
    assert t["offloaded_optimizer_states"] == 12 * PSI_7B
    # stage3.py initialize_optimizer_states: one pinned fp32 gradient per sub-group: 7 x 4 GiB, and
    # the norms' group (266,240 x 4 = 1.02 MiB -> 2 MiB).
    assert t["offloaded_fp32_gradients"] == 7 * 2**32 + 2 * MiB
    # stage3.py _setup_for_real_optimizer: the flat bf16 gradient partitions, pinned: 12.55 -> 16 GiB.
    assert t["offload_16bit_buffers"] == 2**34
    # The update of the largest sub-group goes back to the GPU through a bf16 CPU copy.
    assert t["optimizer_step_transient"] == 2 * 1_011_875_840
    expected = 3 * GiB + 12 * PSI_7B + 7 * 2**32 + 2 * MiB + 2**34 + 2 * 1_011_875_840
    assert est.host_bytes == pytest.approx(expected, rel=1e-9)  # 124.19 GiB: the first step's peak


def test_the_7b_host_peak_does_not_fit_the_h200_machine_that_killed_it() -> None:
    # bench/results/gpu_check-h200-20261130-1906-d-rerun.log: exit -9 in the first step on a machine
    # with 125.9 GiB of RAM. The planner keeps max(4 GiB, 5%) for the OS: 119.6 GiB usable there.
    usable = 125.87 * GiB - max(4 * GiB, 0.05 * 125.87 * GiB)
    assert estimate_memory(offload_7b()).host_bytes > usable
    # What it used to say (16 bytes per parameter + 3 GiB) fitted with 16 GiB to spare.
    assert 16 * PSI_7B + 3 * GiB < usable - 16 * GiB


def test_unpinned_buffers_are_not_rounded() -> None:
    pinned, unpinned = estimate_memory(offload_7b()), estimate_memory(offload_7b(pinning="off"))
    assert unpinned.host_terms["offloaded_fp32_gradients"] == 4 * PSI_7B
    assert unpinned.host_terms["offload_16bit_buffers"] == 2 * PSI_7B
    saved = (7 * 2**32 + 2 * MiB - 4 * PSI_7B) + (2**34 - 2 * PSI_7B)  # 2.9 + 3.45 GiB
    assert pinned.host_bytes - unpinned.host_bytes == pytest.approx(saved, rel=1e-9)
    assert unpinned.host_bytes / GiB == pytest.approx(117.85, abs=0.01)


def test_forked_loader_workers_hold_a_second_copy_of_the_pageable_state() -> None:
    forked = estimate_memory(offload_7b(loader_forks=True))
    assert forked.host_terms["loader_fork_copies"] == 12 * PSI_7B  # master, m and v after a resume
    assert forked.host_bytes - estimate_memory(offload_7b()).host_bytes == 12 * PSI_7B


def test_bf16_states_halve_the_master_moments_and_sub_group_gradients() -> None:
    t = estimate_memory(offload_7b(state_dtype="bf16")).host_terms
    assert t["offloaded_optimizer_states"] == 6 * PSI_7B
    # bf16 sub-groups of ~1.01e9 elements: 2.02e9 bytes -> 2 GiB each; the norms' 532,480 B -> 1 MiB.
    assert t["offloaded_fp32_gradients"] == 7 * 2**31 + MiB
    assert t["offload_16bit_buffers"] == 2**34  # the model's dtype, unchanged
    assert t.get("optimizer_step_transient", 0) == 0  # bf16 master into bf16 weights: no conversion


def test_zero2_cpu_adam_host_terms_by_hand() -> None:
    # stage_1_and_2.py: per parameter group, the fp32 master and its fp32 gradient pinned (26.95 GB ->
    # 32 GiB each), a pinned bf16 copy of the partition (16 GiB) and a staging buffer as large as the
    # largest tensor (262 MB -> 256 MiB); the norms' group adds 1 MiB + 1 MiB + 512 KiB.
    inp = dataclasses.replace(offload_7b(), layout=offload_7b().layout.vary(zero_stage=2))
    t = estimate_memory(inp).host_terms
    assert t["offloaded_optimizer_states"] == 2**35 + 2 * MiB + 8 * PSI_7B
    assert t["offloaded_fp32_gradients"] == 2**35 + 2 * MiB
    assert t["offload_16bit_buffers"] == 2**34 + MiB + 2**28


def test_offloaded_parameters_keep_zero_inits_pinned_blocks() -> None:
    # partition_parameters.py pins each tensor's partition; stage3.py then copies the trainable ones into
    # one flat pinned buffer per group and frees the blocks into torch's pinned cache, which keeps them.
    assert estimate_memory(offload_7b()).host_terms["offloaded_parameters"] == 0
    inp = MemoryInputs.of(
        shape=LLAMA2_7B, world_size=1, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"
    )
    t = estimate_memory(inp).host_terms
    # Per tensor (bf16): embedding and head 262 MB -> 256 MiB; q, k, v, o 32 MiB exactly; gate, up,
    # down 90 MB -> 128 MiB; the 65 norms 8 KiB each (ZeRO-3 keeps them whole on the GPU, but zero.Init
    # pinned their partition first: measured on CPU, tests/e2e/test_host_offload.py). Flat: 13.48 GB
    # -> 16 GiB, and the norms' group 532,480 B -> 1 MiB.
    blocks = 2 * 256 * MiB + L * (4 * 32 * MiB + 3 * 128 * MiB) + (2 * L + 1) * 8 * 2**10
    assert t["offloaded_parameters"] == 2**34 + MiB + blocks  # 32.5 GiB for 12.55 GiB of weights
