"""Llama-2-7B and Llama-3.1-8B by hand: the tensor sizes and DeepSpeed sub-groups the offload tests count with.

Written from the models' published configs, not from llm_train's planner, so a test that compares the
planner's rows with these checks the planner against arithmetic, not against itself.
"""

from __future__ import annotations

from llm_train.planning.model.shapes import shape_of

MiB = 2**20
GiB = 2**30

LLAMA2_7B = shape_of("meta-llama/Llama-2-7b-hf")
# Llama-2-7B: embedding + head 2*V*h, per layer 4h^2 + 3*h*I matrices and two norms, a final norm.
V, H, L, I_MLP = 32000, 4096, 32, 11008
MATRICES_7B = 2 * V * H + L * (4 * H * H + 3 * H * I_MLP)  # 6,738,149,376
NORMS_7B = (2 * L + 1) * H  # 266,240
PSI_7B = MATRICES_7B + NORMS_7B

LLAMA31_8B = shape_of("meta-llama/Llama-3.1-8B")
# Llama-3.1-8B: vocabulary 128,256, hidden 4096, MLP 14,336, 8 KV heads of 128, 32 layers, untied head.
V8, I8, KV8 = 128_256, 14_336, 1024
EMBED_8B = V8 * H  # 525,336,576
LAYER_8B = 2 * H * H + 2 * H * KV8 + 3 * H * I8  # q, o 16.8M; k, v 4.2M; gate, up, down 58.7M: 218,103,808
PSI_8B = 2 * EMBED_8B + L * LAYER_8B + NORMS_7B  # the same 65 norms of 4096: 8,030,261,248
# At the recipes' sub_group_size 2e8 (stage3.py _create_fp16_sub_groups; test_offload_buffers.py checks the rule
# against DeepSpeed's own code): 7B: the embedding with layer 1's q, k, v, o, gate; 31 of (up, down, q, k, v, o, gate); the
# last up, down with the head. 8B: the embedding alone, one group per layer, the head alone. The norms
# are a group of their own in both.
SUB_GROUPS_7B = [V * H + 4 * H * H + H * I_MLP] + [3 * H * I_MLP + 4 * H * H] * 31 + [2 * H * I_MLP + V * H]
SUB_GROUPS_8B = [EMBED_8B] + [LAYER_8B] * L + [EMBED_8B]


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def zero3_cpu_offload_host(psi: int, subs: list[int], pinning: str) -> dict[str, int]:
    """ZeRO-3 with the optimizer on the CPU, bf16, one process: the host buffers by hand.

    stage3.py: an fp32 gradient per sub-group (the norms a group of their own) and the flat bf16
    gradient partitions are pinned; master, m and v (12 bytes per parameter) are pageable; the update of
    the largest sub-group returns through a bf16 copy. torch pinning rounds each pinned block up to a
    power of two (its CachingHostAllocator); native pinning mlocks the exact size; off pins nothing.
    """
    grads = [4 * s for s in [*subs, NORMS_7B]]
    flat = 2 * psi
    if pinning == "torch":
        grads, flat = [pow2(g) for g in grads], pow2(flat)
    host = 3 * GiB + 12 * psi + sum(grads) + flat + 2 * max(subs)  # 3 GiB: the run's own process
    return {
        "fp32_gradients": sum(grads),
        "flat_16bit": flat,
        "host": host,
        "locked": sum(grads) + flat if pinning == "native" else 0,
    }
