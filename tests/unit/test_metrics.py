"""Step metrics: the FLOPs formula, the meter's windowed throughput and MFU, the start-up clock."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from llm_train.data.model_inputs import SpanTally, span_sums
from llm_train.observability.console import duration, progress_line
from llm_train.observability.metrics import (
    StartupClock,
    StepMeter,
    host_rss_gib,
    model_flops_per_token,
    peak_tflops_for,
    shape_flops_per_token,
)
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.speed.flops import TokenFlops, token_flops, training_flops_per_token
from tests.helpers import tiny_llama_config


def tiny_llama(tie: bool = False):
    """Vocab 256, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads (also used by test_flops)."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), config


def test_flops_formula_is_palm_with_causal_attention_counted_as_half() -> None:
    # 6N + 6*L*H*Q*T (PaLM's 12*L*H*Q*T halved by the causal mask) with N=1e9, L=16, H=32, Q=64, T=4096
    assert training_flops_per_token(1e9, 16, 32, 64, 4096) == 6e9 + 6 * 16 * 32 * 64 * 4096
    # Frozen weights: forward + activation gradient only (4 FLOPs per parameter per token).
    assert training_flops_per_token(0, 1, 1, 1, 2, frozen=10) == 40 + 12
    # Recomputation (activation checkpointing) adds one forward: hardware work, not model FLOPs.
    assert training_flops_per_token(1, 1, 1, 1, 2, recompute=True) == (6 + 12) + (2 + 4)
    # Linear in the span: the weights' part and the attention's slope reproduce it at any T.
    for t in (1, 1000, 4096):
        assert token_flops(1e9, 16, 32, 64, frozen=2e8).at(t) == training_flops_per_token(
            1e9, 16, 32, 64, t, 2e8
        )


def test_model_flops_leave_out_the_input_embedding() -> None:
    model, config = tiny_llama()
    shape = shape_from_config(config.to_dict())
    n = shape.num_params - shape.vocab_size * shape.hidden_size  # untied: the lm_head stays, the lookup goes
    expected = 6 * n + 6 * 2 * 4 * 16 * 128
    assert model_flops_per_token(model, 128) == pytest.approx(expected)


def test_tied_embedding_counts_once_as_the_output_matmul() -> None:
    model, config = tiny_llama(tie=True)
    shape = shape_from_config({**config.to_dict(), "tie_word_embeddings": True})
    assert model_flops_per_token(model, 128) == pytest.approx(6 * shape.num_params + 6 * 2 * 4 * 16 * 128)


def test_frozen_parameters_cost_two_thirds() -> None:
    model, _ = tiny_llama()
    full = model_flops_per_token(model, 128)
    for param in model.parameters():
        param.requires_grad_(False)
    attention = 6 * 2 * 4 * 16 * 128  # weight-free, so differentiated whether or not weights are frozen
    assert model_flops_per_token(model, 128) == pytest.approx((full - attention) * 4 / 6 + attention)


def test_meter_averages_the_window_and_resets() -> None:
    meter = StepMeter(tokens_per_step=1000, samples_per_step=10, world_size=4)
    meter.record(0.5)
    meter.record(1.5)  # mean 1.0 s per step
    row = meter.flush()
    assert row["tokens_per_s"] == pytest.approx(1000.0)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(250.0)
    assert row["samples_per_s"] == pytest.approx(10.0)
    assert row["step_time_s"] == pytest.approx(1.0)
    assert "mfu" not in row  # no peak known
    assert row["host_rss_gib"] > 0
    meter.record(0.25)
    assert meter.flush()["tokens_per_s"] == pytest.approx(4000.0)  # only the new window
    assert "tokens_per_s" not in meter.flush()  # nothing recorded since


def test_mfu_against_a_given_peak() -> None:
    # 1e12 FLOPs/token, 100 tokens/s/GPU -> 1e14 FLOP/s per GPU against a 400 TFLOP/s peak = 25%.
    flops = TokenFlops(weights=1e12 - 1e8 * 1000, attention=1e8)  # 1e12 at the row width 1000
    meter = StepMeter(tokens_per_step=800, world_size=8, flops=flops, seq_len=1000, peak_tflops=400.0)
    meter.record(1.0)
    row = meter.flush()
    assert row["mfu"] == pytest.approx(0.25) and row["mfu_seq_len"] == pytest.approx(0.25)
    assert row["attention_span"] == 1000  # not measured: the row width


def test_packed_rows_count_the_attention_their_documents_span() -> None:
    """Two rows of 8: [3, 5] and [8] (position ids restart per sample); a third of 8 padded to [6 | 2]."""
    packed = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])}
    assert span_sums(packed) == (9 + 25 + 64, 16)
    padded = {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])}
    assert span_sums(padded) == (36 + 4, 8)
    assert span_sums({"input_ids": torch.zeros(2, 8, dtype=torch.long)}) == (2 * 64, 16)

    flops = TokenFlops(weights=100.0, attention=10.0)
    # Two micro-batches of 16 slots per step (rows without labels: every token is real).
    meter = StepMeter(tokens_per_step=32, flops=flops, seq_len=8, peak_tflops=1e-12)  # peak 1 FLOP/s
    tally = SpanTally(iter([packed, packed]))
    for batch in tally:
        assert batch is packed  # passed through unchanged
    meter.record(1.0, *tally.take())
    row = meter.flush()
    span = (9 + 25 + 64) / 16
    assert row["attention_span"] == pytest.approx(span)
    assert row["mfu"] == pytest.approx(32 * (100 + 10 * span))  # 32 tokens/s x FLOPs per token at the span
    assert row["mfu_seq_len"] == pytest.approx(32 * (100 + 10 * 8))
    assert tally.take() == (0, 0, 0)


def test_tokens_per_s_counts_real_tokens_not_padding_slots() -> None:
    """A packed row [3 | 5] and one [6 | tail of 2]; padded rows of 8 holding 6 and 3; DPO pairs built at width 4.

    Over 2 data-parallel ranks (each trains its own share): real tokens x 2 per second; the slot count beside.
    """
    ignore = -100
    packed = {
        "input_ids": torch.ones(2, 8, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]]),
        # A sample's first label is IGNORE; the tail's are all IGNORE.
        "labels": torch.tensor([[ignore, 1, 1, ignore, 1, 1, 1, 1], [ignore, 1, 1, 1, 1, 1, ignore, ignore]]),
    }
    padded = {
        "input_ids": torch.ones(2, 8),
        "attention_mask": torch.tensor([[1] * 6 + [0] * 2, [1] * 3 + [0] * 5]),
    }
    pairs = {
        "input_ids": torch.ones(4, 4),
        "attention_mask": torch.tensor([[1, 1, 1, 0]] * 2 + [[1, 1, 0, 0]] * 2),
    }
    for batch, real, slots in ((packed, 8 + 6, 16), (padded, 6 + 3, 16), (pairs, 3 * 2 + 2 * 2, 16)):
        tally = SpanTally(iter([batch]))
        next(tally)
        meter = StepMeter(tokens_per_step=2 * slots, world_size=2, data_parallel=2)
        meter.record(2.0, *tally.take())
        row = meter.flush()
        assert row["tokens_per_s"] == pytest.approx(real * 2 / 2.0)
        assert row["slot_tokens_per_s"] == pytest.approx(2 * slots / 2.0)


def test_peak_on_cpu_only_from_the_flag() -> None:
    assert peak_tflops_for(None, cuda=False) is None
    assert peak_tflops_for(12.5, cuda=False) == 12.5


def test_host_rss_is_this_process() -> None:
    assert 0.01 < host_rss_gib() < 64


def test_startup_clock_splits_phases_and_writes_json(tmp_path: Path) -> None:
    clock = StartupClock(tmp_path / "startup.json")
    clock.mark("imports")
    time.sleep(0.02)
    clock.mark("model build")
    meter = StepMeter(tokens_per_step=10, clock=clock)
    meter.record(0.1)  # the first step ends the start-up
    row = meter.flush()
    record = json.loads((tmp_path / "startup.json").read_text())
    assert list(record["phases_s"]) == ["imports", "model build", "first step"]
    assert record["phases_s"]["model build"] >= 0.02
    assert record["total_s"] == pytest.approx(sum(record["phases_s"].values()))
    assert row["startup_s"] == pytest.approx(record["total_s"])
    meter.record(0.1)
    assert "startup_s" not in meter.flush()  # once


def test_progress_line() -> None:
    line = progress_line(
        50, 200, {"loss": 2.5, "lr": 3e-4, "grad_norm": 0.8, "tokens_per_s": 41230.0, "mfu": 0.382}, 725
    )
    assert line.startswith("step 50/200 [#####...............]  25%")
    assert "loss 2.5000" in line and "41,230 tok/s" in line and "mfu 38.2% |" in line and "eta 12m05s" in line
    packed = progress_line(50, 200, {"mfu": 0.27, "mfu_seq_len": 0.301}, None)
    assert "mfu 27.0% (30.1% at seq_len)" in packed
    assert duration(3 * 3600 + 61) == "3h01m" and duration(59.6) == "1m00s" and duration(5) == "5s"


@pytest.mark.parametrize("tied", [True, False])
def test_flops_from_the_shape_equal_the_models(tied: bool) -> None:
    """The pipeline path counts FLOPs on the config's shape; the ZeRO path on the model: same number."""
    model, config = tiny_llama(tie=tied)
    assert shape_flops_per_token(shape_from_config(config.to_dict()), 128) == model_flops_per_token(
        model, 128
    )
