"""The ALST memory switches (`memory.tiled_mlp`, `memory.offload_checkpoints`; `memory.tiled_loss`: loss/chunked.py).

Arctic Long Sequence Training (arXiv 2506.13996; DeepSpeed `runtime/sequence_parallel/ulysses_sp.py`)
makes long sequences fit by never holding a whole-sequence intermediate that is not needed:

- tiled MLP: a decoder MLP's [tokens x intermediate] activations exist for one tile of the
  sequence at a time. DeepSpeed's `TiledMLP` runs the tiles without autograd and recomputes
  each one in backward. Tiles: ceil(seq_len / hidden_size), ALST's rule.
- tiled loss: the output layer and the cross-entropy run chunk by chunk, so the [tokens x vocab]
  logits never exist whole; each chunk is recomputed in backward. It serves every path, not only
  long sequences, and lives in runtime/loss/chunked.py.
- checkpoint offload: with activation checkpointing, each layer's input (the only activation
  kept between forward and backward) waits in host RAM.

This module patches one model instance (never its class, so `config`, `loss_function`,
`save_pretrained` and other instances are untouched) and knows nothing of DeepSpeed's engine.
It does cooperate with ZeRO: parameters may be partitioned (ZeRO-3 gathers them in the hooks of
each submodule call, so the tiles call submodules), and a parameter used by several tiles is
marked `ds_grad_is_ready = False` until its last tile, so ZeRO reduces its gradient once.

Every rank must cut the same number of tiles, because under ZeRO-3 each tile's submodule call
gathers parameters collectively: the counts depend only on the sequence length, the hidden
size, and every rank holds `data.seq_len` tokens per row (or the same SP chunk of it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from llm_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ---------------------------------------------------------------------------------------------
# Tiled MLP


def enable_tiled_mlp(lm: PreTrainedModel) -> int:
    """Make every dense decoder MLP (a submodule named `mlp`) run in sequence tiles; how many were patched."""
    mlps = [
        module
        for name, module in lm.named_modules()
        if name.rsplit(".", 1)[-1] == "mlp" and not hasattr(module, "experts")  # MoE blocks route per tile
    ]
    if not mlps:
        raise UserError(
            f"memory.tiled_mlp: {type(lm).__name__} has no dense decoder MLP (a submodule named 'mlp') "
            "to tile; set memory.tiled_mlp=false"
        )
    for mlp in mlps:
        # A bound method (not a closure) so that a deepcopy of the model binds its own copy.
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
    return len(mlps)


def _tiled_mlp_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    forward = type(self).forward
    if args or kwargs or x.dim() < 2:
        return forward(self, x, *args, **kwargs)
    shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
    if shards == 1:  # short inputs (generation steps): nothing to tile, nothing to recompute
        return forward(self, x)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    # TiledMLP chunks dim -2 in forward but the flattened tokens in backward; with one row the
    # two cuts are the same tiles, which is what replaying dropout masks needs. The MLP is per
    # token, so flattening the rows changes nothing else.
    flat = x.reshape(1, -1, x.shape[-1])
    out = TiledMLP.apply(_mlp_tile_fn(self), self, flat, shards, list(self.parameters()))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _mlp_tile_fn(mlp: torch.nn.Module) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """The per-tile function TiledMLP calls: once per tile in forward (no grad), again in backward.

    With active dropout (LoRA's `lora_dropout` sits inside the MLP) the backward recomputation
    must draw the forward's masks, or the gradient belongs to a different function than the
    loss: each forward tile records the RNG state it started from and its recomputation
    replays it, as torch.utils.checkpoint does for whole layers.
    """
    forward = type(mlp).forward
    if not (mlp.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())):
        return forward
    states: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()

    def tile(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # TiledMLP.forward runs its tiles under no_grad
            states.append(_rng_state(x.device))
            return forward(self, x)
        with _replayed_rng(states.popleft(), x.device):  # TiledMLP.backward: same tiles, same order
            return forward(self, x)

    return tile


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Iterator[None]:
    cpu, cuda = state
    devices = [device] if cuda is not None else []
    with torch.random.fork_rng(devices=devices):  # the outer stream continues as if nothing ran
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


# ---------------------------------------------------------------------------------------------
# Checkpoint offload


def enable_checkpoint_offload(lm: PreTrainedModel, pin_memory: bool) -> int:
    """Keep each checkpointed layer's input in host RAM between forward and backward; how many layers.

    Needs activation checkpointing already on (transformers' `activation_checkpointing_enable`).
    Each layer's checkpoint function runs under `torch.autograd.graph.save_on_cpu`. Checkpointing
    keeps exactly one thing per layer, its tensor inputs (the hidden state), and keeps them as
    saved tensors: `save_for_backward` when reentrant, `SavedTensor`s made before the frame's own
    hook when non-reentrant (torch 2.13's `_CheckpointFrame.save_inputs`; `_NoopSaveInputs` in
    earlier releases). So the host hook moves them, and nothing else: the tensors saved inside the
    layer go to the checkpoint's own, innermost hook, which keeps none. Keyword inputs (the rotary
    cos/sin, the mask) are shared by all layers and stay put. One exception: with frozen
    embeddings (LoRA) transformers and PEFT make the embedding output a leaf that requires grad,
    and its gradient accumulator keeps the first layer's input on the device (1 of L hidden
    states). `pin_memory`: page-locked host buffers for asynchronous copies (CUDA only).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    if not layers:
        raise UserError(
            f"memory.offload_checkpoints: {type(lm).__name__} has no checkpointed layers; "
            "set memory.activation_checkpointing=true"
        )
    for layer in layers:
        # transformers sets this attribute undeclared (set_gradient_checkpointing's setattr); read and
        # written the same way here, since Module's typed attributes are only tensors and submodules.
        checkpoint = getattr(layer, "_gradient_checkpointing_func")  # noqa: B009 - see above
        if not (isinstance(checkpoint, functools.partial) and checkpoint.func is _offloaded):
            offloaded = functools.partial(_offloaded, checkpoint, pin_memory)
            setattr(layer, "_gradient_checkpointing_func", offloaded)  # noqa: B010 - see above
    return len(layers)


def _offloaded(checkpoint: Callable[..., Any], pin_memory: bool, *args: Any, **kwargs: Any) -> Any:
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        return checkpoint(*args, **kwargs)
