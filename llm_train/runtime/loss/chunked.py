"""The token loss without the full logits (`memory.tiled_loss`): chunk by chunk, recomputed in backward.

A causal LM's loss needs, per token, the log-probability of its label: log softmax of the
[tokens x vocabulary] logits. transformers builds those logits whole, upcasts them to fp32 and
keeps the log-softmax for backward: 12 bytes per logit at the peak of backward (measured on CPU,
tests/unit/test_memory_lines.py), 5.9 GiB for 2 x 2048 tokens of Llama-3's 128k vocabulary. Here
the tokens are cut into chunks of at most LOSS_CHUNK_LOGITS_BYTES of fp32 logits
(planning/memory/estimate.py); each chunk's logits are computed, reduced to one log-probability per token
and dropped, and recomputed in backward (the technique of torchtune's chunked cross-entropy,
DeepSpeed ALST's tiled loss and Liger's fused linear cross-entropy). What one chunk holds at most:

    forward   its logits, their fp32 copy and its log-softmax (torch's own, as in F.cross_entropy),
              reduced to the label's log-probability and dropped
    backward  the same again, then the log-softmax with its gradient and the gradient of the logits
              (torch's own log-softmax backward, then cast back to the logits' dtype)

so about 12 bytes per logit of one chunk (measured: planning/memory/estimate.py CHUNK_BYTES_PER_LOGIT), no
more than one chunk ever upcast, plus the gradient of the hidden states. The planner counts exactly
this (`chunked_loss_bytes`). Taking torch's own kernels for the log-softmax and its backward keeps
every token's log-probability and every logit's gradient those of transformers' loss bit for bit;
only the sums over tokens (the loss, the output layer's weight gradient) are taken in another order.
A hand-written softmax gradient in place would hold less (8 bytes per logit) but differs from torch's
kernel in the last bit of 8% of the logits (its exp is another implementation), which Adam's first
steps amplify (a sequence-parallel run drifted 1.6e-5 from the dense one in 5 steps).

Why not one of the libraries:
- Liger's `LigerFusedLinearCrossEntropyFunction` (0.8.5: per-token losses with the gradient
  recomputed in backward, `reduction="none"`) is used where it can run: `memory.liger_kernels`
  on (it needs CUDA and Triton), an output layer that is a plain `nn.Linear` whose weight is not
  partitioned by ZeRO-3 (it reads `weight` without calling the module, so ZeRO-3 would never gather
  it) and not wrapped by a LoRA adapter. Everywhere else (CPU, ZeRO-3, a LoRA head, pipeline
  stages) the loss below runs: it calls the output layer as a module, so ZeRO-3's hooks gather it,
  PEFT's adapters apply, and a tied embedding gets its gradient.
- DeepSpeed's `TiledFusedLogitsLoss` runs the backward inside forward assuming an upstream gradient
  of 1: the output layer's weight gradient then misses any later scaling of the loss (DeepSpeed
  divides it by gradient_accumulation_steps; fp16 multiplies it by the loss scale).
- torchtune's `CEWithChunkedOutputLoss` upcasts each chunk but keeps every chunk's logits for
  backward (the whole tensor, only split), and needs torchtune's own model output.

The primitive is the per-token log-probability (`token_logps`), differentiable with any upstream
gradient: the language-modelling loss is minus their sum over the token count (transformers'
reduction, `num_items_in_batch` included), DPO and SimPO sum them per sequence
(preference_tuning.py), the pipeline's last stage averages them over its micro-batch
(language_modeling.py). Exactness: losses (sums of the same per-token values) and weight
gradients agree with transformers' to fp32 rounding (tests/unit/test_chunked_loss.py).

Every rank must cut the same number of chunks, because under ZeRO-3 each chunk's call of the
output layer gathers its weight collectively. The count is taken from the most tokens a forward
carries (`max_tokens`: micro-batch rows x data.seq_len / sp, which every rank shares), not from the
tokens at hand, which vary with DPO's padded pairs.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch

from llm_train.errors import UserError
from llm_train.planning.memory.formulas import LOSS_CHUNK_LOGITS_BYTES, loss_chunks

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100
# Configs whose causal LM transforms the logits before the loss (Gemma 2/3 soft-capping, Cohere's
# scale, Granite's divisor) or adds a router loss to it (MoE): the chunked loss would not equal theirs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_router_logits")
# The first Liger release whose fused linear cross-entropy recomputes the gradient in backward for
# per-token losses (reduction="none" with a per-token upstream gradient; read in its 0.8.5 source).
LIGER_PER_TOKEN_VERSION = (0, 8, 5)

Head = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# The primitive: per-token log-probabilities of the labels, chunk by chunk


def token_logps(
    head: Head,
    params: list[torch.nn.Parameter],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunks: int,
    ignore_index: int = IGNORE_INDEX,
    tied: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """log p(label) of every token in fp32, 0 where the label is `ignore_index`, shaped like `labels`.

    `hidden` [..., h] are the output layer's inputs for the already-shifted `labels` [...]; `head`
    maps [n, h] -> [n, vocab] logits and `params` are its parameters (the ones it may train);
    `tied`: ids of those that are also the input embedding's.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    logps = _ChunkedLogps.apply(flat, labels.reshape(-1), head, params, chunks, ignore_index, tied)
    return logps.view(labels.shape)


def _bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous (start, end) ranges over `tokens`, as torch.tensor_split cuts them (some may be empty)."""
    step, extra = divmod(tokens, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + step + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _chunk_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """log p(label) per row of one chunk's logits: F.cross_entropy's own fp32 log-softmax, picked at the
    label (0 where ignored); differentiable, and its backward is F.cross_entropy's (log-softmax backward
    of the gradient at the label alone)."""
    valid = labels != ignore_index
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.masked_fill(~valid, 0)[:, None]).squeeze(-1).masked_fill(~valid, 0.0)


class _ChunkedLogps(torch.autograd.Function):
    """Per-token log-probabilities over chunks of tokens, each chunk's logits recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        head: Head,
        params: list[torch.nn.Parameter],
        chunks: int,
        ignore_index: int,
        tied: frozenset[int],
    ) -> torch.Tensor:
        ctx.head, ctx.params, ctx.chunks, ctx.ignore_index, ctx.tied = (
            head,
            params,
            chunks,
            ignore_index,
            tied,
        )
        ctx.save_for_backward(hidden, labels)
        out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for start, end in _bounds(labels.numel(), chunks):
                out[start:end] = _chunk_logps(head(hidden[start:end]), labels[start:end], ignore_index)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels = ctx.saved_tensors
        wants_input_grad = ctx.needs_input_grad[0]
        params = [p for p in ctx.params if p.requires_grad]
        grad_hidden = torch.zeros_like(hidden) if wants_input_grad else None
        bounds = _bounds(labels.numel(), ctx.chunks)
        for i, (start, end) in enumerate(bounds):
            last = i == len(bounds) - 1
            for p in params:
                # ZeRO reduces a gradient once, when it is ready: after the last chunk, or, for a
                # weight tied to the input embedding, after the embedding's own backward.
                p.ds_grad_is_ready = last and id(p) not in ctx.tied
            x = hidden[start:end].detach().requires_grad_(wants_input_grad)
            with (
                torch.enable_grad()
            ):  # the head's output is not kept, only the log-softmax its backward needs
                logps = _chunk_logps(ctx.head(x), labels[start:end], ctx.ignore_index)
            if logps.requires_grad:
                torch.autograd.backward(logps, grad_out[start:end])
            del logps
            if grad_hidden is not None and x.grad is not None:
                grad_hidden[start:end] = x.grad
        for p in params:
            p.ds_grad_is_ready = True
        return grad_hidden, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Liger's fused linear cross-entropy, where it runs


def liger_runs(head: torch.nn.Module, device: torch.device) -> bool:
    """Liger's kernel can compute this head's loss: CUDA, a plain unpartitioned nn.Linear, Liger >= 0.8.5."""
    return liger_reads(head, device) and liger_installed()


def liger_reads(head: torch.nn.Module, device: torch.device) -> bool:
    """Liger's kernel can read this head: on CUDA, a plain nn.Linear whose weight ZeRO-3 does not partition."""
    weight = getattr(head, "weight", None)
    return not (
        device.type != "cuda"
        or type(head) is not torch.nn.Linear
        or weight is None
        or hasattr(weight, "ds_id")
    )


def liger_installed() -> bool:
    """Liger >= 0.8.5 is installed (its per-token loss). A package-metadata read: once per model, not per forward."""
    try:
        found = tuple(int(part) for part in version("liger-kernel").split(".")[:3])
    except (PackageNotFoundError, ValueError):
        return False
    return found >= LIGER_PER_TOKEN_VERSION


def liger_token_logps(
    head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """token_logps by Liger's kernel: minus its per-token cross-entropy (0 where ignored), fp32."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    flat = hidden.reshape(-1, hidden.shape[-1])
    # Positional as 0.8.5 declares them: input, weight, target, bias, ce_weight, ignore_index,
    # lse_square_scale, label_smoothing, reduction.
    loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
        flat, head.weight, labels.reshape(-1), head.bias, None, ignore_index, 0.0, 0.0, "none"
    )
    return -loss.view(labels.shape)


# ---------------------------------------------------------------------------------------------
# A Hugging Face causal LM whose forward computes its loss this way


@functools.cache
def _output_class() -> type:
    """transformers' causal-LM output with one more field: the per-token log-probabilities."""
    from dataclasses import dataclass

    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class ChunkedLossOutput(CausalLMOutputWithPast):
        token_logps: torch.FloatTensor | None = None

    return ChunkedLossOutput


def enable_tiled_loss(
    lm: PreTrainedModel, max_tokens: int | None = None, liger: bool = False, chunk_bytes: int | None = None
) -> None:
    """Make `lm(..., labels=...)` / `lm(..., shift_labels=...)` compute its loss without the full logits.

    With labels (HF style, shifted inside) or shift_labels (already shifted, -100 = ignored; the
    sequence-parallel path passes these) the forward returns `.loss` equal to transformers'
    causal-LM loss: the summed token cross-entropy over `num_items_in_batch` when given, else over
    the non-ignored tokens (0 tokens: NaN, as transformers gives), and `.token_logps`, each token's
    log-probability of its shifted label (what DPO sums per sequence). `.logits` is None then.
    The loss is chunked in evaluation too (an eval batch at training length would need the same
    logits). Without labels (generation, sampling, export checks) the forward is the model's own.
    `max_tokens`: the most tokens one forward carries (sets the chunk count, see the module
    docstring; None: the tokens of each call). `liger`: Liger's kernel where `liger_runs`.
    `chunk_bytes`: fp32 logits per chunk (planning/memory/estimate.py's constant when None; tests shrink it).
    """
    from transformers.loss.loss_utils import LOSS_MAPPING

    name = type(lm).__name__
    for key in _LOGIT_TRANSFORMS:
        value = getattr(lm.config, key, None)
        if value not in (None, False, 0, 1, 1.0):
            raise UserError(
                f"memory.tiled_loss: {name} applies {key}={value} to its logits or loss, which the chunked "
                "loss does not reproduce; set memory.tiled_loss=false"
            )
    if lm.loss_function is not LOSS_MAPPING["ForCausalLM"] or lm.get_output_embeddings() is None:
        raise UserError(
            f"memory.tiled_loss: {name} is not a plain causal LM loss; set memory.tiled_loss=false"
        )
    # Plain attributes of this instance (Module's typed __setattr__ takes only tensors and modules).
    liger = liger and liger_installed()
    setattr(lm, "_chunked_loss", (max_tokens, liger, chunk_bytes))  # noqa: B010 - see above
    lm.forward = types.MethodType(_chunked_loss_forward, lm)


def _chunked_loss_forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    if kwargs.get("labels") is None and kwargs.get("shift_labels") is None:
        return forward(self, *args, **kwargs)
    call = _named_arguments(forward, self, args, kwargs)
    if call.get("logits_to_keep") or call.get("return_dict") is False:
        return forward(self, *args, **kwargs)  # callers that want logits or tuples get the model's own
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
    logps = model_token_logps(self, hidden, shift_labels, ignore_index)
    if num_items is None:
        denominator = (shift_labels != ignore_index).sum()
    else:
        denominator = torch.as_tensor(num_items, device=hidden.device)
    return _output_class()(
        loss=-logps.sum() / denominator,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        token_logps=logps,
    )


def model_token_logps(
    lm: PreTrainedModel, hidden: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """token_logps of a model patched by `enable_tiled_loss`, by Liger's kernel or in chunks."""
    max_tokens, liger, chunk_bytes = getattr(lm, "_chunked_loss")  # noqa: B009 - set by enable_tiled_loss
    head = lm.get_output_embeddings()  # looked up per call: PEFT may have wrapped it since
    if liger and liger_reads(head, hidden.device):  # liger: asked, and installed (enable_tiled_loss)
        return liger_token_logps(head, hidden, shift_labels, ignore_index)
    tokens = max(shift_labels.numel(), max_tokens or 0)
    vocab = lm.config.get_text_config().vocab_size
    chunks = loss_chunks(tokens, vocab, chunk_bytes or LOSS_CHUNK_LOGITS_BYTES)
    return token_logps(
        head, list(head.parameters()), hidden, shift_labels, chunks, ignore_index, tied_ids(lm)
    )


def tied_ids(lm: torch.nn.Module) -> frozenset[int]:
    """ids of the output layer's parameters that are also the input embedding's."""
    head, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()  # type: ignore[operator]
    return frozenset({id(p) for p in head.parameters()} & {id(p) for p in embedding.parameters()})


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
