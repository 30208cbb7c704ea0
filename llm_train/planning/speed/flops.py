"""Training FLOPs per token: the one formula MFU and the planner's speed model both use.

Per token, a decoder-only transformer trained on sequences of T tokens costs

    6N + 6*L*H*Q*T        (forward 2N + 2LHQT, backward twice the forward)

N counts the weights that take part in matmuls (6 FLOPs each: forward, activation gradient,
weight gradient); a frozen weight (LoRA's base model) costs 4, having no weight gradient.
The second term is the two weight-free attention matmuls, scores QK^T and values PV: a
token at position t multiplies its query against t keys and its probabilities against t
values, 2*Q FLOPs each per multiply-add, per head and layer: 4*L*H*Q*t forward.

Causal mask: counted as half. Averaged over positions t = 1..T a token attends to T/2 others,
hence 6*L*H*Q*T. PaLM (Chowdhery et al. 2022, appendix B: 6N + 12LHQT) and the Megatron-LM
paper (Narayanan et al. 2021, appendix: 96BsLh^2(1 + s/6h + V/16Lh) with recomputation, i.e.
12*L*h*s per token for attention) count the full T x T matrix: for an 8B
Llama that adds 3.5% at 2k tokens, within noise. At 128k attention is 70% of the work even
halved, and the causal kernels we run (flash-attention, SDPA's flash/cuDNN backends) skip the
masked half: the full count would report 1.7x the MFU really reached there, and can pass 100%.
Megatron-LM's own `num_floating_point_operations` (megatron/training/training.py) has since
switched to "causal mask (only half of the mask is non-zero)", as FlashAttention's benchmarks
count causal attention; we follow them.

T is the length the attention really spans: `data.seq_len` for a row that is one sequence.
Rows that pack several samples with boundaries (data/model_inputs.py) attend only within each sample;
their true span is sum(n_i^2) / sum(n_i) over the samples, which Megatron-LM takes per batch
(`seqlen_squared_sum`); passing the row width there overstates attention. MFU is counted with
that span (`TokenFlops.at(attention_span(...))`, measured on the batches a run trains on), and
beside it with the row width, the figure most tools print (observability/metrics.py). A kernel
that computes the whole row anyway (sdpa with a dense mask) does the same model work in more
time: its MFU is lower, as it should be.

Activation checkpointing runs the forward once more; that is hardware work, not model work,
so MFU leaves it out (`recompute=False`; PaLM's convention: counted, it is hardware FLOPs
utilisation, HFU) while the step-time model counts it.
"""

from __future__ import annotations

from dataclasses import dataclass


def attention_flops_per_token(layers: int, heads: int, head_dim: int, seq_len: float) -> float:
    """Forward FLOPs per token of the scores and values matmuls under a causal mask (see above)."""
    # 2 matmuls x 2 FLOPs per multiply-add x head_dim, over seq_len / 2 positions on average.
    return 2.0 * layers * heads * head_dim * seq_len


def training_flops_per_token(
    trainable: float,
    layers: int,
    heads: int,
    head_dim: int,
    seq_len: float,
    frozen: float = 0.0,
    recompute: bool = False,
) -> float:
    """Model FLOPs of one trained token (forward + backward); `recompute` adds one forward (HFU)."""
    attention = attention_flops_per_token(layers, heads, head_dim, seq_len)
    # The attention matmuls carry no weights, so their inputs' gradients are always taken (x2).
    flops = 6.0 * trainable + 4.0 * frozen + 3.0 * attention
    if recompute:
        flops += 2.0 * (trainable + frozen) + attention
    return flops


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs per token as a function of the attention span T: `weights + attention * T`."""

    weights: float
    """6 per trained and 4 per frozen matmul weight (and one more forward with `recompute`)."""
    attention: float
    """The attention matmuls' FLOPs per token per unit of span (linear in T, see above)."""

    def at(self, span: float) -> float:
        return self.weights + self.attention * span


def token_flops(
    trainable: float, layers: int, heads: int, head_dim: int, frozen: float = 0.0, recompute: bool = False
) -> TokenFlops:
    """`training_flops_per_token` split into its span-free part and its slope in the span."""
    weights = training_flops_per_token(trainable, layers, heads, head_dim, 0.0, frozen, recompute)
    slope = training_flops_per_token(0.0, layers, heads, head_dim, 1.0, 0.0, recompute)
    return TokenFlops(weights, slope)


def attention_span(squared_lengths: float, tokens: float) -> float | None:
    """sum(n_i^2) / sum(n_i): the span T at which the formula gives the attention of documents n_i."""
    return squared_lengths / tokens if tokens > 0 else None
