"""The memory conventions the planner is checked against: the ZeRO paper's and DeepSpeed's own estimators.

Only the tests use them (tests/unit/test_memory.py), so they live here, not in llm_train/planning/memory/estimate.py.
`zero_paper_model_states` is the ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3.1 and Figure 1: 16 bytes per parameter,
K = 12); `deepspeed_zero2_model_states` / `deepspeed_zero3_model_states` reproduce DeepSpeed's
`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` expression by expression
(18 bytes per parameter: they add fp32 gradients; planning/memory/estimate.py's module docstring says why the
estimator counts 16 on the GPU).
"""

from __future__ import annotations


def zero_paper_model_states(params: float, dp: int, stage: int) -> float:
    """Bytes of model states per GPU, ZeRO paper Figure 1 convention (16 bytes/param, K = 12).

    Stage 0: 16 P; 1 (P_os): 4 P + 12 P/dp; 2 (P_os+g): 2 P + 14 P/dp; 3 (P_os+g+p): 16 P/dp.
    """
    k = 12
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return (2 + 2) * params + k * params / dp
    if stage == 2:
        return 2 * params + (2 + k) * params / dp
    if stage == 3:
        return (2 + 2 + k) * params / dp
    raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {stage}")


def deepspeed_zero2_model_states(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes): exactly `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`.

    Same expressions in the same order so float rounding matches bit for bit.
    cpu_bytes is per node; gpu_bytes per GPU. Counts 18 bytes/param (see module doc).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_bytes): exactly DeepSpeed's `estimate_zero3_model_states_mem_needs`.

    Mirrors deepspeed/runtime/zero/stage3.py expression by expression, including its
    third return value (4 bytes per parameter of the largest layer, gathered on GPU).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
                )
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
                )
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
