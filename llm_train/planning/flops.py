"""Training FLOPs per token: the one formula MFU and the planner's speed model both use.

PaLM (Chowdhery et al. 2022, appendix B): 6N + 12*L*H*Q*T per token, where N counts the
weights that take part in matmuls, L layers, H heads of size Q, T the sequence length. The
forward pass is 2N + 4LHQT, the backward pass twice that. A frozen weight (LoRA's base model)
costs 4 instead of 6: forward and the activation gradient, no weight gradient; the attention
matmuls carry no weights and are always differentiated. Full activation checkpointing runs
the forward once more; that is hardware work, not model work, so MFU leaves it out
(`recompute=False`) while the step-time model counts it.
"""

from __future__ import annotations


def training_flops_per_token(
    trainable: float,
    layers: int,
    heads: int,
    head_dim: int,
    seq_len: int,
    frozen: float = 0.0,
    recompute: bool = False,
) -> float:
    attention = 4.0 * layers * heads * head_dim * seq_len  # forward: scores and values
    flops = 6.0 * trainable + 4.0 * frozen + 3.0 * attention
    if recompute:
        flops += 2.0 * (trainable + frozen) + attention
    return flops
