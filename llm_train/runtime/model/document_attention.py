"""`memory.attention: sdpa_flex`: per batch, sdpa with is_causal or flex_attention with a per-document block mask.

transformers (5.x) picks an attention kernel by name from two registries: AttentionMaskInterface
builds the mask once per forward, AttentionInterface runs each layer's attention with it. This
module registers one more name in both (their documented extension point, the same one
transformers' own kernels use):

- the mask: when the batch needs nothing beyond causality (no sample boundary in the position ids,
  no padding in the attention mask: transformers then passes `allow_is_causal_skip=True` and an
  all-ones or absent mask), None, so that sdpa runs with `is_causal` exactly as
  `attn_implementation="sdpa"` does; otherwise transformers' own flex_attention BlockMask, built
  from the same mask function (causal, and the packed samples or the padding).
- the attention: flex_attention where it received a BlockMask, sdpa otherwise.

Both halves are transformers' functions (masking_utils.flex_attention_mask,
integrations.sdpa_attention / flex_attention); only the choice between them is ours. Their
signatures are the same in transformers 5.17 and 5.24 (compared). The dense [b, 1, s, s] mask of
`sdpa` is never built. config/attention_kernel.py says when `auto` picks this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

NAME = "sdpa_flex"


def _needs_only_causality(
    allow_is_causal_skip: bool,
    attention_mask: torch.Tensor | None,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
) -> bool:
    """What sdpa's is_causal computes equals the mask: no boundary, no padding, no cache offset.

    transformers clears `allow_is_causal_skip` itself when it found packed samples (or any extra mask
    function); padding shows as a False in the 2D mask. Reading the mask (`.all()`) is one host sync
    per forward, the same one transformers' sdpa path makes.
    """
    if not allow_is_causal_skip or q_length != kv_length:
        return False
    if not isinstance(q_offset, int) or q_offset != 0:
        return False
    return attention_mask is None or bool(attention_mask.all())


def document_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> BlockMask | None:
    """None (sdpa, is_causal) when causality is the whole mask, else transformers' flex BlockMask."""
    from transformers.masking_utils import flex_attention_mask

    if _needs_only_causality(allow_is_causal_skip, attention_mask, q_length, kv_length, q_offset):
        return None
    return flex_attention_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        # Annotated int there, yet transformers hands static caches' tensor offsets on (masking_utils).
        q_offset=q_offset,  # type: ignore[arg-type]
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flex_attention for a BlockMask, sdpa (is_causal when the mask is None) for anything else."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, BlockMask):
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_sdpa_flex() -> None:
    """Make `attn_implementation="sdpa_flex"` known to transformers in this process (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, document_attention)
    AttentionMaskInterface.register(NAME, document_mask)
