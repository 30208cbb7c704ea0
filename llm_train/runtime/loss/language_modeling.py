"""Language modelling: next-token cross-entropy on the loss mask (`objective: lm`, pre-training and SFT).

One loss, computed where each engine's forward leaves it:

    LanguageModeling      the ZeRO engine, whole rows: the model's own `.loss` (transformers' causal-LM
                          loss: the mean over the labelled tokens, in fp32). Under `memory.tiled_loss` the
                          model's forward is patched to compute that same loss chunk by chunk (chunked.py).
    SequenceParallelLM    the ZeRO engine with Ulysses (sp > 1): each rank scores its slice of the row
                          (runtime/engines/sequence_parallel.py `SequenceShard.shard`, which passes the group's
                          token count as `num_items_in_batch`), so its loss is its *share* of the group's
                          token mean; it backpropagates the share and logs the group's sum (one all-reduce).
                          Summing the shares' gradients over the group gives the gradient of the sp=1 loss.
    causal_lm_loss        the pipeline engine's last stage, from the logits (DeepSpeed calls it per
                          micro-batch, `PipelineModule(loss_fn=...)`).
    ChunkedCausalLMLoss   the same under `memory.tiled_loss`: the output layer runs inside the loss, chunk
                          by chunk (chunked.py `token_logps`), never whole (runtime/engines/pipeline_model.py
                          `chunk_the_loss` moves it there).

All four give transformers' loss to fp32 rounding (tests/unit/test_chunked_loss.py, test_pipeline_model.py,
tests/e2e/test_sequence_parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.loss.chunked import token_logps
from llm_train.runtime.loss.interface import Batch, Scored

if TYPE_CHECKING:
    from llm_train.data.prepare import PackedSplit


class LanguageModeling:
    """The model's own next-token loss over the tokens whose label is not -100."""

    name = "lm"

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored:
        return Scored(model(**batch).loss)

    def prepare(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None:
        """Nothing to compute before training."""

    def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
        loss = means["loss"]
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


class SequenceParallelLM(LanguageModeling):
    """LanguageModeling on this rank's slice of each row: `shard` cuts the batch (SequenceShard.shard), `group`
    is the sequence-parallel group whose shares add up to the row's loss. Preference, reward and GRPO
    objectives are refused under sequence parallelism (config/parallel.py)."""

    def __init__(self, shard: Callable[[Batch], Batch], group: Collectives) -> None:
        self.shard, self.group = shard, group

    def score(self, model: torch.nn.Module, batch: Batch) -> Scored:
        share = model(**self.shard(batch)).loss
        return Scored(share, logged=self.group.sum(share.detach()))  # the group's loss, not differentiable


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: predict token t+1 from t, mean over tokens, computed in fp32."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100
    )


class ChunkedCausalLMLoss:
    """`causal_lm_loss` from the last stage's final hidden states, by the chunked loss (memory.tiled_loss):
    the output layer runs inside the loss, chunk by chunk (chunked.py), never whole."""

    def __init__(
        self, head: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter], chunks: int
    ) -> None:
        self.head, self.params, self.chunks = head, params, chunks

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]  # token t predicts label t+1
        logps = token_logps(self.head, self.params, hidden, shifted, self.chunks)
        return -logps.sum() / (shifted != -100).sum()
