"""The trained model's logits on a fixed batch: recorded in the training process, read by the export check.

Every engine runs the live model on one fixed batch (`reference_input_ids`, every rank takes part in the
forward) and rank 0 writes the logits: next to final/ as RUN_DIR/export_reference.safetensors
(`write_reference`, so final/ stays a clean HF folder) and into each checkpoint
(checkpointing/run_state.py `Saver`). The export check (runtime/export/verify.py) reads them back and compares
the reloaded model's logits with them. This module is the file format both sides share; the comparison
and its tolerance are runtime/export/verify.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REFERENCE_FILE = "export_reference.safetensors"
# Any fixed text will do: it only has to be the same batch in the training process and after
# reloading. Tokenised with the run's own tokenizer, so the ids are ones the model has seen.
REFERENCE_TEXT = "The import statement combines two operations; it searches for the named module."
REFERENCE_TOKENS = 16


@dataclass(frozen=True)
class Reference:
    """The trained model's logits on a fixed batch, computed in the training process."""

    input_ids: torch.Tensor  # (1, T) int64
    logits: torch.Tensor  # (1, T, vocab) as the training forward gave them, stored as fp32
    dtype: torch.dtype  # the dtype the training forward computed in


def reference_input_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """The fixed batch (1, REFERENCE_TOKENS) both sides of the logit check run."""
    ids = list(tokenizer(REFERENCE_TEXT, add_special_tokens=False)["input_ids"])[:REFERENCE_TOKENS]
    ids += list(range(3, 3 + REFERENCE_TOKENS - len(ids)))  # a tokenizer that makes few tokens: pad
    return torch.tensor([[i % vocab_size for i in ids]], dtype=torch.long)


def reference_path(final: Path) -> Path:
    return Path(final).parent / REFERENCE_FILE


def write_reference(final: Path, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Record the training process's logits next to final/ (rank 0, after the forward on every rank)."""
    write_reference_file(reference_path(final), input_ids, logits)


def write_reference_file(path: Path, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """input_ids and logits (stored as fp32) with the dtype the forward computed in."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "input_ids": input_ids.cpu().contiguous(),
        "logits": logits.detach().float().cpu().contiguous(),
    }
    save_file(tensors, str(path), metadata={"dtype": str(logits.dtype).removeprefix("torch.")})


def read_reference(final: Path) -> Reference | None:
    return read_reference_file(reference_path(final))


def read_reference_file(path: Path) -> Reference | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        dtype = getattr(torch, (handle.metadata() or {}).get("dtype", "float32"))
        return Reference(handle.get_tensor("input_ids"), handle.get_tensor("logits"), dtype)
