"""The ALST memory switches (`memory.tiled_mlp`, `memory.tiled_loss`, `memory.offload_checkpoints`).

Arctic Long Sequence Training (arXiv 2506.13996; DeepSpeed `runtime/sequence_parallel/ulysses_sp.py`)
makes long sequences fit by never holding a whole-sequence intermediate that is not needed:

- tiled MLP: a decoder MLP's [tokens x intermediate] activations exist for one tile of the
  sequence at a time. DeepSpeed's `TiledMLP` runs the tiles without autograd and recomputes
  each one in backward. Tiles: ceil(seq_len / hidden_size), ALST's rule.
- tiled loss: the output layer and the cross-entropy run tile by tile, so the [tokens x vocab]
  logits (fp32: 4 bytes x 128k vocab per token) never exist whole. Like the MLP, each tile is
  recomputed in backward. DeepSpeed's `TiledFusedLogitsLoss` is not used: it runs the backward
  inside forward assuming an upstream gradient of 1, so the output layer's weight gradient
  misses any later scaling of the loss (DeepSpeed divides it by gradient_accumulation_steps;
  fp16 multiplies it by the loss scale), and it averages per-tile means instead of tokens.
- checkpoint offload: with activation checkpointing, each layer's input (the only activation
  kept between forward and backward) waits in host RAM.

This module patches one model instance (never its class, so `config`, `loss_function`,
`save_pretrained` and other instances are untouched) and knows nothing of DeepSpeed's engine.
It does cooperate with ZeRO: parameters may be partitioned (ZeRO-3 gathers them in the hooks of
each submodule call, so the tiles call submodules), and a parameter used by several tiles is
marked `ds_grad_is_ready = False` until its last tile, so ZeRO reduces its gradient once.

Every rank must cut the same number of tiles, because under ZeRO-3 each tile's submodule call
gathers parameters collectively: the counts depend only on the sequence length, the hidden
size and the vocabulary, and every rank holds `data.seq_len` tokens per row (or the same SP
chunk of it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import types
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from llm_train.errors import UserError
from llm_train.planning.memory import LOSS_TILE_LOGITS_BYTES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100
# Configs whose causal LM transforms the logits before the loss (Gemma 2/3 soft-capping, Cohere's
# scale, Granite's divisor) or adds a router loss to it (MoE): the tiled loss would not equal theirs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_router_logits")


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
# Tiled loss


def enable_tiled_loss(lm: PreTrainedModel, tile_bytes: int = LOSS_TILE_LOGITS_BYTES) -> None:
    """Make `lm(..., labels=...)` / `lm(..., shift_labels=...)` compute its loss without whole-sequence logits.

    With labels (HF style, shifted inside) or shift_labels (already shifted, -100 = ignored; the
    sequence-parallel path passes these) the forward returns `.loss` equal to transformers'
    causal-LM loss: the summed token cross-entropy over `num_items_in_batch` when given, else over
    the non-ignored tokens (0 tokens: NaN, as transformers gives). `.logits` is None then. The
    loss is tiled in evaluation too (an eval batch at training length would need the same
    logits). Without labels (generation, sampling, export checks) the forward is the model's own.
    `tile_bytes`: fp32 logits per row of the batch in one tile.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING

    name = type(lm).__name__
    for key in _LOGIT_TRANSFORMS:
        value = getattr(lm.config, key, None)
        if value not in (None, False, 0, 1, 1.0):
            raise UserError(
                f"memory.tiled_loss: {name} applies {key}={value} to its logits or loss, which the tiled "
                "loss does not reproduce; set memory.tiled_loss=false"
            )
    if lm.loss_function is not LOSS_MAPPING["ForCausalLM"] or lm.get_output_embeddings() is None:
        raise UserError(
            f"memory.tiled_loss: {name} is not a plain causal LM loss; set memory.tiled_loss=false"
        )
    # An int attribute of this instance (Module's typed __setattr__ takes only tensors and modules).
    setattr(lm, "_tiled_loss_tile_bytes", tile_bytes)  # noqa: B010 - see above
    lm.forward = types.MethodType(_tiled_loss_forward, lm)


def _tiled_loss_forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    if kwargs.get("labels") is None and kwargs.get("shift_labels") is None:
        return forward(self, *args, **kwargs)
    call = _named_arguments(forward, self, args, kwargs)
    if call.get("logits_to_keep") or call.get("return_dict") is False:
        return forward(self, *args, **kwargs)  # callers that want logits or tuples get the model's own
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels, shift_labels = call.pop("labels", None), call.pop("shift_labels", None)
    num_items = call.pop("num_items_in_batch", None)
    ignore_index = call.pop("ignore_index", IGNORE_INDEX)
    call.pop("logits_to_keep", None)
    call.setdefault("use_cache", False)  # the loss path returns no cache, so building one is waste
    outputs = self.get_decoder()(**call)
    hidden = outputs[0]
    if shift_labels is None:  # transformers' ForCausalLMLoss: token t predicts label t+1
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if shift_labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"labels of shape {tuple(shift_labels.shape)} for hidden states {tuple(hidden.shape)}"
        )
    if num_items is None:
        denominator = (shift_labels != ignore_index).sum()
    else:
        denominator = torch.as_tensor(num_items, device=hidden.device)
    vocab = self.config.get_text_config().vocab_size
    tiles = max(1, min(hidden.shape[1], math.ceil(hidden.shape[1] * vocab * 4 / self._tiled_loss_tile_bytes)))
    head = self.get_output_embeddings()
    embedding = self.get_input_embeddings()
    tied = {id(p) for p in head.parameters()} & {id(p) for p in embedding.parameters()}
    loss = _TiledCrossEntropy.apply(hidden, shift_labels, denominator, head, tiles, ignore_index, tied)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )


def _named_arguments(
    forward: Callable[..., Any], self: PreTrainedModel, args: tuple, kwargs: dict
) -> dict[str, Any]:
    """The call's arguments by name (positional ones too), the **kwargs folded in."""
    signature = inspect.signature(forward)
    bound = signature.bind(self, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))  # self
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
    return named


def _token_loss_sum(
    head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = head(hidden).float()  # transformers upcasts the logits before the cross-entropy too
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


class _TiledCrossEntropy(torch.autograd.Function):
    """sum over tiles of CE_sum(head(hidden_tile), labels_tile) / denominator, recomputed per tile in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        denominator: torch.Tensor,
        head: torch.nn.Module,
        tiles: int,
        ignore_index: int,
        tied: set[int],
    ) -> torch.Tensor:
        ctx.head, ctx.tiles, ctx.ignore_index, ctx.tied = head, tiles, ignore_index, tied
        ctx.save_for_backward(hidden, labels, denominator)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for x, y in zip(
                hidden.tensor_split(tiles, dim=1), labels.tensor_split(tiles, dim=1), strict=True
            ):
                total += _token_loss_sum(head, x, y, ignore_index)
        return total / denominator

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels, denominator = ctx.saved_tensors
        wants_input_grad = ctx.needs_input_grad[0]
        params = [p for p in ctx.head.parameters() if p.requires_grad]
        grad_hidden = torch.zeros_like(hidden) if wants_input_grad else None
        scale = grad_loss / denominator  # d loss / d (each tile's summed token loss)
        pieces = zip(
            hidden.tensor_split(ctx.tiles, dim=1), labels.tensor_split(ctx.tiles, dim=1), strict=True
        )
        start = 0
        for i, (x, y) in enumerate(pieces):
            last = i == ctx.tiles - 1
            for p in params:
                # ZeRO reduces a gradient once, when it is ready: after the last tile, or, for a
                # weight tied to the input embedding, after the embedding's own backward.
                p.ds_grad_is_ready = last and id(p) not in ctx.tied
            x = x.detach().requires_grad_(wants_input_grad)
            with torch.enable_grad():
                tile_loss = _token_loss_sum(ctx.head, x, y, ctx.ignore_index)
            if tile_loss.requires_grad:
                torch.autograd.backward(tile_loss, scale)
            if grad_hidden is not None and x.grad is not None:
                grad_hidden[:, start : start + x.shape[1]] = x.grad
            start += x.shape[1]
        for p in params:
            p.ds_grad_is_ready = True
        return grad_hidden, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Checkpoint offload


def enable_checkpoint_offload(lm: PreTrainedModel, pin_memory: bool) -> int:
    """Keep each checkpointed layer's input in host RAM between forward and backward; how many layers.

    Needs activation checkpointing already on (transformers' `gradient_checkpointing_enable`).
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
