"""The chunked loss (memory.tiled_loss) gives transformers' losses, log-probs and gradients on every path.

The model and the tolerance of tests/unit/test_tiling.py: a 2-layer fp32 Llama, hidden 32, vocabulary
256, two rows of 256 tokens. A chunk may hold 2 x 256 x 256 x 4 / 8 bytes of fp32 logits, so the
loss runs in 8 chunks of 64 tokens (the rows of a micro-batch are cut together). The chunked loss
takes F.cross_entropy's own log-softmax and its backward per chunk, so per-token values and logit
gradients are the dense loss's bit for bit; sums (the loss, weight gradients over tokens) are taken in
another order: differences of ~1e-6 on a loss of ~5.5 and ~1e-9 on gradients, far under TOL = 1e-5,
far under what a dropped chunk, a wrong mask or a wrong scale moves (1e-3 or more). bf16 logits: see
the bf16 test's own tolerance.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any

import pytest
import torch

from llm_train.config.objective_sections import PreferenceSection
from llm_train.config.recipe_sections import LoraSection, MemorySection
from llm_train.errors import UserError
from llm_train.planning.memory.formulas import LOSS_CHUNK_LOGITS_BYTES, loss_chunks
from llm_train.runtime.loss.chunked import enable_tiled_loss
from llm_train.runtime.loss.language_modeling import ChunkedCausalLMLoss, causal_lm_loss
from llm_train.runtime.loss.preference_tuning import Preference, reference_forward, sequence_logps
from llm_train.runtime.model.model import build_model
from tests.unit.test_tiling import (
    SEQ,
    TILES,
    TOL,
    VOCAB,
    assert_same,
    batch,
    calls_of,
    lora_of,
    loss_and_grads,
    model_section,
    readiness_of,
    shifted,
    tiny_llama,
)

CHUNK_BYTES = 2 * SEQ * VOCAB * 4 // TILES  # fp32 logits of two rows, in 8 chunks


@pytest.mark.parametrize("tie", [False, True])
def test_tiled_loss_with_labels_matches_the_model_loss_and_never_builds_whole_logits(tie: bool) -> None:
    plain = tiny_llama(tie)
    tiled = copy.deepcopy(plain)
    enable_tiled_loss(tiled, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    tokens, ready = calls_of(tiled.lm_head), readiness_of(tiled.lm_head.weight)
    reference = loss_and_grads(plain, input_ids=input_ids, labels=labels)
    result = loss_and_grads(tiled, input_ids=input_ids, labels=labels)
    assert_same(reference, result)
    assert tokens == [2 * SEQ // TILES] * (2 * TILES)  # forward chunks, then their recomputation
    if tie:  # one weight with the input embedding: ready only once the embedding's gradient is in
        assert ready == [False] * TILES + [True]
    else:
        assert ready == [False] * (TILES - 1) + [True]


def test_tiled_loss_takes_already_shifted_labels_and_a_token_count_as_sequence_parallelism_passes() -> None:
    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    enable_tiled_loss(tiled, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    shift = shifted(labels)
    reference = loss_and_grads(plain, input_ids=input_ids, labels=labels)
    # The engine's SP call: one rank's chunk, its already-shifted labels, no `labels`.
    assert_same(reference, loss_and_grads(tiled, input_ids=input_ids, shift_labels=shift, use_cache=False))
    # Untiled, transformers computes a loss only when `labels` is set; then shift_labels wins.
    assert_same(reference, loss_and_grads(plain, input_ids=input_ids, labels=shift, shift_labels=shift))
    # A share of a group's mean: summed token losses over the group's count, as transformers does.
    group = torch.tensor(3 * int((shift != -100).sum()))
    share = dict(input_ids=input_ids, labels=shift, shift_labels=shift, num_items_in_batch=group)
    assert_same(loss_and_grads(plain, **share), loss_and_grads(tiled, **share))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    chunk = dict(input_ids=input_ids, position_ids=position_ids, shift_labels=shift, use_cache=False)
    assert_same(reference, loss_and_grads(tiled, **chunk))


def test_tiled_loss_scales_every_gradient_with_the_loss_the_output_layer_included() -> None:
    # DeepSpeed divides the loss by the accumulation steps before backward (fp16 also multiplies it
    # by the loss scale): the output layer's gradient, computed tile by tile, must follow.
    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    enable_tiled_loss(tiled, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    reference = loss_and_grads(plain, scale=0.25, input_ids=input_ids, labels=labels)
    assert_same(reference, loss_and_grads(tiled, scale=0.25, input_ids=input_ids, labels=labels))


def test_tiled_loss_of_no_tokens_is_nan_with_zero_gradients_as_transformers_gives() -> None:
    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    enable_tiled_loss(tiled, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    nothing = torch.full_like(labels, -100)
    for model in (plain, tiled):
        loss, grads = loss_and_grads(model, input_ids=input_ids, labels=nothing)
        assert math.isnan(loss)
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_tiled_loss_keeps_the_model_forward_without_labels_and_drops_logits_with_them() -> None:
    plain = tiny_llama().eval()
    tiled = copy.deepcopy(plain)
    enable_tiled_loss(tiled, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    with torch.no_grad():
        assert torch.equal(tiled(input_ids=input_ids).logits, plain(input_ids=input_ids).logits)
        assert torch.equal(tiled(input_ids[:, :5], use_cache=True).logits, plain(input_ids[:, :5]).logits)
        evaluated = tiled(input_ids=input_ids, labels=labels)  # evaluation at training length: tiled too
        assert evaluated.logits is None
        assert evaluated.loss.item() == pytest.approx(
            plain(input_ids=input_ids, labels=labels).loss.item(), abs=TOL
        )
    generated = tiled.generate(input_ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, plain.generate(input_ids[:1, :4], max_new_tokens=3, do_sample=False))
    # The instance is patched, not the class; a copy of the model calls its own weights.
    clone = copy.deepcopy(tiled)
    assert type(tiled) is type(plain) and "forward" not in vars(plain) and clone.forward.__self__ is clone
    assert tiled.loss_function is plain.loss_function


def test_tiled_loss_refuses_models_that_transform_their_logits() -> None:
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0  # Gemma 2's soft-capping
    with pytest.raises(UserError, match=r"^memory\.tiled_loss: .*final_logit_softcapping=30\.0"):
        enable_tiled_loss(model)


def test_the_chunk_count_comes_from_the_most_tokens_a_forward_carries_not_the_tokens_at_hand() -> None:
    # Under ZeRO-3 every chunk gathers the output layer collectively: ranks whose padded DPO pairs
    # are shorter than another's must still cut as many chunks.
    model = tiny_llama()
    enable_tiled_loss(model, max_tokens=2 * SEQ, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    tokens = calls_of(model.lm_head)
    model(input_ids=input_ids[:, : SEQ // 4], labels=labels[:, : SEQ // 4]).loss.backward()
    assert len(tokens) == 2 * TILES and sum(tokens) == 2 * 2 * SEQ // 4
    # The constant the planner counts: 64 MiB of fp32 logits, 32 chunks for 2 x 2048 x 128k.
    assert LOSS_CHUNK_LOGITS_BYTES == 64 * 2**20 and loss_chunks(2 * 2048, 128_256) == 32


@pytest.mark.parametrize("lora", [False, True])
def test_token_logps_are_the_logits_log_probs_with_the_gradient_of_any_upstream_weighting(lora: bool) -> None:
    """What DPO and SimPO sum per sequence: equal values, and equal gradients for per-token weights."""
    plain = tiny_llama()
    chunked = copy.deepcopy(plain)
    enable_tiled_loss(chunked, chunk_bytes=CHUNK_BYTES)
    if lora:  # adapters everywhere, the output layer included: the chunks call it as PEFT wrapped it
        section = LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
        plain, chunked = lora_of(plain, section), lora_of(chunked, section)
    input_ids, labels = batch()
    weights = torch.linspace(-1.0, 2.0, 2 * SEQ).view(2, SEQ)  # an arbitrary upstream gradient

    def run(model: Any, chunked_path: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if chunked_path:
            token = model(input_ids=input_ids, labels=labels).token_logps
        else:
            logits = model(input_ids=input_ids).logits.float()
            token = torch.zeros(2, SEQ)
            token[:, :-1] = -torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none"
            )
        (token * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return token.detach(), grads

    (expected, expected_grads), (token, grads) = run(plain, False), run(chunked, True)
    assert (token - expected).abs().max() <= TOL
    assert bool((token[shifted(labels) == -100] == 0).all())
    sums, counts = sequence_logps(plain(input_ids=input_ids).logits, labels)
    # Sums of ~200 log-probs of ~-5: fp32 rounding of a sum near 1e3 is ~1e-4, so relative 1e-6.
    assert torch.allclose(token.sum(-1), sums.detach(), atol=0, rtol=1e-6) and counts.tolist() == [
        int(c) for c in (shifted(labels) != -100).sum(-1)
    ]
    assert_same((0.0, expected_grads), (0.0, grads))
    assert not lora or any("lm_head.lora_A" in n for n in grads)


@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_preference_objectives_score_the_same_through_the_chunked_loss(name: str) -> None:
    plain = tiny_llama()
    chunked = copy.deepcopy(plain)
    enable_tiled_loss(chunked, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch(rows=4)  # 2 pairs: chosen rows, then rejected rows
    attention = torch.ones_like(input_ids)
    attention[1, -20:] = 0  # a padded row
    inputs = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    settings = PreferenceSection(beta=0.1 if name == "dpo" else 2.0)
    results = []
    for model, is_chunked in ((plain, False), (chunked, True)):
        # DPO's live reference: the same model, no grad, eval mode, through the same path.
        reference = reference_forward(model, chunked=is_chunked) if name == "dpo" else None
        model.zero_grad(set_to_none=True)
        scored = Preference(name, settings, live_reference=reference, chunked=is_chunked).score(model, inputs)
        scored.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((scored.loss.item(), grads, {k: float(v) for k, v in scored.metrics.items()}))
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = results
    assert_same((loss_a, grads_a), (loss_b, grads_b))
    # The metrics include summed log-probs near -1e3: relative fp32 rounding (1e-6), as above.
    assert metrics_a == pytest.approx(metrics_b, rel=1e-6, abs=TOL)


def test_bf16_logits_give_the_dense_loss_and_gradients_but_the_output_layers_summed_per_chunk() -> None:
    """bf16: both paths take torch's fp32 log-softmax of the same bf16 logits and its backward's
    operations, so the loss (observed: bit for bit) and every logit's gradient are equal, hence every
    gradient below the output layer (within fp32 rounding of the sums: 1e-5 relative). The output layer's
    weight gradient is summed over chunks, in bf16 each time (the weight's dtype): 2^-8 relative
    rounding per addition over 8 chunks; 2% of the largest element is 3x what is seen (0.7%) and far
    below a dropped chunk (an eighth of it)."""
    plain = tiny_llama().to(torch.bfloat16)
    chunked = copy.deepcopy(plain)
    enable_tiled_loss(chunked, chunk_bytes=CHUNK_BYTES)
    input_ids, labels = batch()
    (loss_a, grads_a), (loss_b, grads_b) = (
        loss_and_grads(m, input_ids=input_ids, labels=labels) for m in (plain, chunked)
    )
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        scale = grad.float().abs().max().item()
        bound = 0.02 if name == "lm_head.weight" else 1e-5
        assert (grads_b[name].float() - grad.float()).abs().max().item() <= bound * scale, name


@pytest.mark.parametrize("tie", [False, True])
def test_the_pipeline_last_stage_loss_runs_the_output_layer_in_chunks(tie: bool) -> None:
    """chunk_the_loss moves the head into ChunkedCausalLMLoss: the loss of causal_lm_loss(head(hidden))."""
    torch.manual_seed(0)
    hidden = torch.randn(2, SEQ, 32, requires_grad=True)
    _, labels = batch()
    weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.1)
    head = (
        partial(torch.nn.functional.linear, weight=weight) if tie else torch.nn.Linear(32, VOCAB, bias=False)
    )
    if not tie:
        head.weight = weight
    calls: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return head(x)

    def loss_and_grads_of(loss_fn: Any, head_fn: Any) -> tuple[float, list[torch.Tensor]]:
        # The head's weight gradient is accumulated by the chunks' own backward (as in a model), so
        # it is read from .grad, not asked of autograd.grad.
        hidden.grad, weight.grad = None, None
        loss = loss_fn(head_fn, hidden, labels)
        loss.backward()
        return loss.item(), [hidden.grad.clone(), weight.grad.clone()]

    expected, expected_grads = loss_and_grads_of(lambda h, x, y: causal_lm_loss(h(x), y), head)
    loss, grads = loss_and_grads_of(lambda h, x, y: ChunkedCausalLMLoss(h, [weight], TILES)(x, y), counted)
    assert loss == pytest.approx(expected, abs=TOL) and len(calls) == 2 * TILES
    for a, b in zip(expected_grads, grads, strict=True):
        assert (a - b).abs().max().item() <= TOL


def test_build_model_chunks_the_loss_by_the_runs_token_count() -> None:
    model = build_model(model_section(), MemorySection(tiled_loss=True), "fp32", seed=0, loss_tokens=2 * SEQ)
    assert model._chunked_loss == (2 * SEQ, False, None)
    assert math.isfinite(model(**dict(zip(("input_ids", "labels"), batch(), strict=True))).loss.item())


def test_liger_computes_the_loss_only_where_it_can_read_a_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Liger's kernel reads `lm_head.weight` itself: CUDA, a plain nn.Linear, not ZeRO-3-partitioned, Liger
    >= 0.8.5 (per-token losses with the gradient recomputed in backward). Elsewhere the chunked loss runs."""
    from llm_train.runtime.loss import chunked as chunked_loss

    monkeypatch.setattr(chunked_loss, "version", lambda name: "0.8.5")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    head = torch.nn.Linear(8, 16, bias=False)
    assert chunked_loss.liger_runs(head, cuda) and not chunked_loss.liger_runs(head, cpu)
    partitioned = torch.nn.Linear(8, 16, bias=False)
    partitioned.weight.ds_id = 3  # what ZeRO-3 puts on a partitioned parameter
    assert not chunked_loss.liger_runs(partitioned, cuda)
    wrapped = lora_of(tiny_llama(), LoraSection(rank=2, alpha=4, target_modules=["lm_head"]))
    assert not chunked_loss.liger_runs(wrapped.get_base_model().lm_head, cuda)
    monkeypatch.setattr(chunked_loss, "version", lambda name: "0.8.4")
    assert not chunked_loss.liger_runs(head, cuda)
