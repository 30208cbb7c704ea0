"""Which attention kernel a run uses: `memory.attention`, and what `auto` picks.

The kernels (transformers' `attn_implementation` names, plus llm_train's `sdpa_flex`):

- `sdpa`: torch's scaled_dot_product_attention. A batch whose rows hold one sequence each, with no
  padding, runs with `is_causal` (the flash / cuDNN kernels on GPUs). Packed rows (position ids
  restarting at each sample) and padded rows make transformers build a dense [b, 1, s, s] boolean
  mask; sdpa then repeats K/V to every head, drops `is_causal`, and no flash kernel takes a mask,
  so the whole s x s square is computed (transformers 5.x masking_utils.sdpa_mask; torch's flash
  backend refuses any attn_mask).
- `flex_attention`: torch's flex_attention (torch >= 2.5) with a block mask per document, which
  transformers builds from the same position ids (masking_utils.flex_attention_mask): only the
  128 x 128 blocks a sample's causal triangle touches are computed. torch has no flex_attention
  backward on CPU ("FlexAttention does not support backward on CPU", checked with torch 2.13), so
  it trains on GPUs only; its forward runs on CPU (the exactness tests use it).
- `sdpa_flex`: per batch, the cheaper exact one of the two (runtime/document_attention.py): sdpa with
  `is_causal` where the batch has no sample boundary and no padding (the very call `sdpa` makes),
  flex_attention with the block mask where it has. It never builds the dense mask, and is never
  slower than `sdpa` once the flex kernels are compiled (the first batch with a boundary compiles
  them: tens of seconds on a GPU, once per run).
- `flash_attention_2`: the flash-attn package; packed rows run its variable-length kernel from the
  position ids, padded rows are unpadded; needs flash-attn and a GPU.
- `eager`: plain matmuls that materialise the scores; for debugging.

`auto` picks the fastest exact kernel this machine has for the run, and the dry run says which:
flash_attention_2 where flash-attn is installed (GPU), else sdpa_flex (GPU, torch >= 2.5), else
sdpa. On CPU it is sdpa (flex cannot train there). The document-aware kernels are chosen only on
the plain ZeRO path: pipeline stages build their own masks (runtime/pipeline_model.py), DeepSpeed's
Ulysses attention wraps sdpa or flash-attention only, and AutoTP with flex is not verified; there
`auto` is flash_attention_2 where installed, else sdpa, and flex_attention / sdpa_flex are refused
(config/parallel.py).

Decided without importing torch (config/ never does): package presence and torch's version come
from importlib's metadata.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from llm_train.errors import UserError

# The values memory.attention takes; "auto" is resolved to one of the others before anything runs.
KERNELS = ("sdpa", "sdpa_flex", "flex_attention", "flash_attention_2", "eager")
FLEX_KERNELS = ("flex_attention", "sdpa_flex")
# torch.nn.attention.flex_attention appeared in torch 2.5.
FLEX_MIN_TORCH = (2, 5)


@dataclass(frozen=True)
class Installed:
    """What this machine has that decides the kernel (read once per resolution; a test passes its own)."""

    flash_attn: bool
    torch_version: tuple[int, int]

    @staticmethod
    def here() -> Installed:
        return Installed(
            flash_attn=importlib.util.find_spec("flash_attn") is not None, torch_version=_torch_version()
        )

    @property
    def flex(self) -> bool:
        return self.torch_version >= FLEX_MIN_TORCH


def _torch_version() -> tuple[int, int]:
    try:
        major, minor = importlib.metadata.version("torch").split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0)


@dataclass(frozen=True)
class AttentionChoice:
    kernel: str
    """The kernel the run uses (one of KERNELS)."""
    why: str
    """One line for the dry run and the start-up summary."""


def choose_attention(
    requested: str, device: str, tp: int = 1, pp: int = 1, sp: int = 1, installed: Installed | None = None
) -> AttentionChoice:
    """The kernel for `memory.attention=requested` on `device` ("cuda" | "cpu") with these degrees."""
    have = installed or Installed.here()
    if requested != "auto":
        if requested in FLEX_KERNELS and not have.flex:
            found = ".".join(map(str, have.torch_version))
            raise UserError(
                f"memory.attention={requested} needs torch >= 2.5 (flex_attention), this environment has "
                f"torch {found}; upgrade torch or set memory.attention=auto"
            )
        return AttentionChoice(requested, "as the recipe sets it")
    if device == "cpu":
        return AttentionChoice("sdpa", "auto -> sdpa: on CPU (flex_attention has no backward there)")
    plain = tp == pp == sp == 1
    if have.flash_attn:
        return AttentionChoice(
            "flash_attention_2",
            "auto -> flash_attention_2: flash-attn is installed (packed rows run its varlen kernel)",
        )
    if plain and have.flex:
        return AttentionChoice(
            "sdpa_flex",
            "auto -> sdpa_flex: batches with sample boundaries or padding run flex_attention with a block "
            "mask per document, the others sdpa with is_causal (flash-attn not installed)",
        )
    where = "with tensor, pipeline or sequence parallelism" if not plain else "without torch >= 2.5"
    return AttentionChoice(
        "sdpa",
        f"auto -> sdpa: {where} and no flash-attn, packed and padded rows get a dense s x s mask",
    )
