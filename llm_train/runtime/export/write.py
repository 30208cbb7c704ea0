"""Write a plain Hugging Face model directory (config, safetensors, tokenizer) from a gathered state dict.

The dtypes an export is written in are named here too (EXPORT_DTYPES). verify.py checks what this writes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llm_train.runtime.export.names import checkpoint_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def save_hf_model(
    model: PreTrainedModel,
    state_dict: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # A tied pair (one Parameter under two names: Gemma's head and embedding) is stored once, under its first
    # name, as the hub's checkpoints store it. Decided by the model, not by storage: ZeRO-0's gathered state
    # dict holds the pair as two copies, and the clone below would make them two tensors anyway.
    first = {name for name, _ in model.named_parameters()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    state_dict = {k: v for k, v in state_dict.items() if k not in aliases}
    # safetensors refuses tensors that share storage (views into one gathered buffer, tied weights):
    # those are cloned. The others are written as they are, so the host holds one copy of the
    # model, not two (planning/memory/estimate.py export_peak_bytes).
    sharing = Counter(v.untyped_storage().data_ptr() for v in state_dict.values())
    clean = {
        k: v.detach().contiguous().clone()
        if sharing[v.untyped_storage().data_ptr()] > 1
        else v.detach().contiguous()
        for k, v in state_dict.items()
    }
    # Named as the hub's checkpoints of the family are (names.py), written as they are (no second renaming).
    model.save_pretrained(
        out_dir,
        state_dict=checkpoint_names(model, clean),
        safe_serialization=True,
        max_shard_size="5GB",
        save_original_format=False,
    )
    tokenizer.save_pretrained(out_dir)
