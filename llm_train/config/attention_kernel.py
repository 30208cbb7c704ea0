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
- `sdpa_flex`: per batch, the cheaper exact one of the two (runtime/model/document_attention.py): sdpa with
  `is_causal` where the batch has no sample boundary and no padding (the very call `sdpa` makes),
  flex_attention with the block mask where it has. It never builds the dense mask, and is never
  slower than `sdpa` once the flex kernels are compiled (the first batch with a boundary compiles
  them: tens of seconds on a GPU, once per run).
- `flash_attention_2`: the flash-attn package; packed rows run its variable-length kernel from the
  position ids, padded rows are unpadded; needs flash-attn and a GPU.
- `eager`: plain matmuls that materialise the scores; for debugging.

`auto` picks the fastest exact kernel this machine has for the run and is known to train there, and
the dry run says which: flash_attention_2 where flash-attn is installed (GPU), else sdpa_flex where
flex_attention's backward fits the card at the model's head_dim (below), else sdpa. On CPU it is
sdpa (flex cannot train there). The document-aware kernels are chosen only on the plain ZeRO path:
pipeline stages build their own masks (runtime/engines/pipeline_model.py), DeepSpeed's Ulysses attention
wraps sdpa or flash-attention only, and AutoTP with flex is not verified; there `auto` is
flash_attention_2 where installed, else sdpa, and flex_attention / sdpa_flex are refused
(config/parallel.py).

Where flex's backward fits: torch compiles it with Triton, and its tile sizes grow with head_dim.
At head_dim 128 it has been reported to need 128 KiB of shared memory per thread block (pytorch/
pytorch#133254, RTX 4090: "out of resource: shared memory, Required: 131074, Hardware limit:
101376"; the same failure on A10G), and on sm_12x boards above head_dim 128 (#198224), while
H100/H200 offer 227 KiB and A100 163 KiB. It fails at the first batch with a sample boundary,
after the model has loaded, so `auto` takes the safe road: flex only where the card's opt-in
shared memory per block (`Device.shared_memory_per_block`, torch's `shared_memory_per_block_optin`,
else the CUDA table by compute capability below) is known to hold the backward at that head_dim,
else sdpa (and its dense mask for packed rows). An explicit `memory.attention=sdpa_flex` is taken as
written: what runs on a consumer card depends on the card and the torch release.

Decided without importing torch (config/ never does): package presence and torch's version come
from importlib's metadata, the card's facts from `Device` (config/hardware.py reads them at launch).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llm_train.config.hardware import Device
from llm_train.errors import UserError

# The values memory.attention takes; "auto" is resolved to one of the others before anything runs.
KERNELS = ("sdpa", "sdpa_flex", "flex_attention", "flash_attention_2", "eager")
FLEX_KERNELS = ("flex_attention", "sdpa_flex")
# torch.nn.attention.flex_attention appeared in torch 2.5.
FLEX_MIN_TORCH = (2, 5)
KiB = 1024
# Shared memory one thread block may opt in to, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): what a card has when torch's properties are not at
# hand (a dry run for a named card). A10/A10G and the RTX 30/40/50 cards are 8.6, 8.9 and 12.0.
OPTIN_SHARED_MEMORY = {
    (7, 0): 96 * KiB,
    (7, 5): 64 * KiB,
    (8, 0): 163 * KiB,
    (8, 6): 99 * KiB,
    (8, 7): 163 * KiB,
    (8, 9): 99 * KiB,
    (9, 0): 227 * KiB,
    (10, 0): 227 * KiB,
    (10, 3): 227 * KiB,
    (12, 0): 99 * KiB,
    (12, 1): 99 * KiB,
}
# flex_attention's compiled backward, shared memory per block by head_dim (module docstring): up to 64 it
# fits every card flex runs on; up to 128 it needs the 131,074 bytes #133254 reports; above 128 it failed on
# sm_12x (#198224) and is taken as fitting only the 227 KiB class (H100, H200, B200).
FLEX_BACKWARD_128 = 131074
FLEX_BACKWARD_ABOVE_128 = 227 * KiB
# A model whose head_dim is not known offline: the common one (Llama, Mistral, Qwen at 7B and up).
ASSUMED_HEAD_DIM = 128


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


def head_dim_of(fields: Mapping[str, Any]) -> int | None:
    """The attention head size of a model's config.json fields (an explicit head_dim wins, as in HF)."""
    if fields.get("head_dim"):
        return int(fields["head_dim"])
    hidden = fields.get("hidden_size") or fields.get("n_embd") or fields.get("d_model")
    heads = fields.get("num_attention_heads") or fields.get("n_head")
    return int(hidden) // int(heads) if hidden and heads else None


def block_shared_memory(gpu: Device) -> int | None:
    """Bytes of shared memory one block may use on `gpu`: as torch read it, else by compute capability."""
    if gpu.shared_memory_per_block:
        return gpu.shared_memory_per_block
    return OPTIN_SHARED_MEMORY.get(gpu.compute_capability) if gpu.compute_capability else None


def flex_backward_need(head_dim: int) -> int:
    """Shared memory per block flex_attention's backward needs at `head_dim` (0: fits every card)."""
    if head_dim <= 64:
        return 0
    return FLEX_BACKWARD_128 if head_dim <= 128 else FLEX_BACKWARD_ABOVE_128


def flex_fits(gpu: Device | None, head_dim: int | None) -> tuple[bool, str]:
    """Whether flex_attention's backward is known to fit `gpu` at `head_dim`, and the clause that says why."""
    dim = head_dim or ASSUMED_HEAD_DIM
    said = f"head_dim {dim}" + ("" if head_dim else " (assumed: the model's is not known offline)")
    need = flex_backward_need(dim)
    if need == 0:
        return True, f"flex_attention's backward fits every card at {said}"
    have = block_shared_memory(gpu) if gpu is not None else None
    card = gpu.name if gpu is not None and gpu.name not in ("cuda", "GPU") else "this GPU"
    if have is None:
        return False, (
            f"{card}'s shared memory per block is not known, and flex_attention's backward at {said} needs "
            f"{need / KiB:.0f} KiB"
        )
    verdict = "fits" if have >= need else "does not fit (pytorch/pytorch#133254)"
    return have >= need, (
        f"flex_attention's backward at {said} needs {need / KiB:.0f} KiB of shared memory per block, "
        f"{card} has {have / KiB:.0f} KiB: it {verdict}"
    )


def choose_attention(
    requested: str,
    device: Device | str,
    tp: int = 1,
    pp: int = 1,
    sp: int = 1,
    installed: Installed | None = None,
    head_dim: int | None = None,
) -> AttentionChoice:
    """The kernel for `memory.attention=requested` on `device` (a detected or declared Device, or just its
    kind, "cuda" | "cpu", where the card is not known) with these degrees and the model's head_dim."""
    have = installed or Installed.here()
    gpu = device if isinstance(device, Device) else None
    kind = device.kind if isinstance(device, Device) else device
    if requested != "auto":
        if requested in FLEX_KERNELS and not have.flex:
            found = ".".join(map(str, have.torch_version))
            raise UserError(
                f"memory.attention={requested} needs torch >= 2.5 (flex_attention), this environment has "
                f"torch {found}; upgrade torch or set memory.attention=auto"
            )
        return AttentionChoice(requested, "as the recipe sets it")
    if kind == "cpu":
        return AttentionChoice("sdpa", "auto -> sdpa: on CPU (flex_attention has no backward there)")
    plain = tp == pp == sp == 1
    if have.flash_attn:
        return AttentionChoice(
            "flash_attention_2",
            "auto -> flash_attention_2: flash-attn is installed (packed rows run its varlen kernel)",
        )
    dense = "packed and padded rows get a dense s x s mask"
    if not plain or not have.flex:
        where = "with tensor, pipeline or sequence parallelism" if not plain else "without torch >= 2.5"
        return AttentionChoice("sdpa", f"auto -> sdpa: {where} and no flash-attn, {dense}")
    fits, because = flex_fits(gpu, head_dim)
    if fits:
        return AttentionChoice(
            "sdpa_flex",
            f"auto -> sdpa_flex: {because}; batches with sample boundaries or padding run flex_attention with "
            "a block mask per document, the others sdpa with is_causal (flash-attn not installed)",
        )
    return AttentionChoice(
        "sdpa",
        f"auto -> sdpa: {because}; {dense} (flash-attn not installed; memory.attention=sdpa_flex tries flex anyway)",
    )
