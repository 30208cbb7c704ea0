"""Training FLOPs at the real sequence length: attention's share at long and short context, and MFU by hand.

The numbers are written out as arithmetic so that a change to the formula in planning/speed/flops.py
has to be a change to these lines too.
"""

from __future__ import annotations

import pytest
from transformers import LlamaForCausalLM

from llm_train.observability.metrics import (
    StepMeter,
    model_flops_per_token,
    model_token_flops,
    shape_flops_per_token,
)
from llm_train.planning.model.shapes import shape_of
from llm_train.planning.speed.flops import attention_flops_per_token, training_flops_per_token
from tests.helpers import tiny_llama_config
from tests.unit.test_metrics import tiny_llama

# Llama-3.1-8B: 8,030,261,248 parameters; the input embedding (128256 x 4096, untied) is a lookup.
LLAMA_8B_MATMUL_PARAMS = 8_030_261_248 - 128_256 * 4_096  # 7,504,924,672
LLAMA_8B_LAYERS, LLAMA_8B_HEADS, LLAMA_8B_HEAD_DIM = 32, 32, 128


def _attention_share_8b(seq_len: int) -> float:
    flops = shape_flops_per_token(shape_of("meta-llama/Llama-3.1-8B"), seq_len)
    return 1 - 6 * LLAMA_8B_MATMUL_PARAMS / flops


def test_the_8b_shape_is_the_one_the_arithmetic_assumes() -> None:
    shape = shape_of("meta-llama/Llama-3.1-8B")
    assert shape.num_params - shape.vocab_size * shape.hidden_size == LLAMA_8B_MATMUL_PARAMS
    assert (shape.num_layers, shape.num_heads, shape.head_dim) == (32, 32, 128)


def test_attention_dominates_an_8b_at_128k_tokens() -> None:
    # Dense: 6 * 7.505e9 = 4.503e10 per token. Attention, causal: 6 * 32 * 32 * 128 * 131072 = 1.031e11.
    dense = 6 * LLAMA_8B_MATMUL_PARAMS
    attention = 6 * LLAMA_8B_LAYERS * LLAMA_8B_HEADS * LLAMA_8B_HEAD_DIM * 131_072
    assert attention == 103_079_215_104
    share = attention / (dense + attention)  # 0.696
    assert _attention_share_8b(131_072) == pytest.approx(share, rel=1e-12)
    assert 0.69 < share < 0.70
    # So an MFU from 6N alone would read 3.29x too low at 128k.
    assert (dense + attention) / dense == pytest.approx(3.289, abs=1e-3)


def test_attention_is_a_small_share_of_an_8b_at_2k_tokens() -> None:
    # 6 * 32 * 32 * 128 * 2048 = 1.611e9 against 4.503e10: 3.5%, the size of run-to-run noise in MFU.
    attention = 6 * LLAMA_8B_LAYERS * LLAMA_8B_HEADS * LLAMA_8B_HEAD_DIM * 2_048
    share = attention / (6 * LLAMA_8B_MATMUL_PARAMS + attention)
    assert _attention_share_8b(2_048) == pytest.approx(share, rel=1e-12)
    assert 0.034 < share < 0.035


def test_causal_attention_costs_half_of_the_full_score_matrix() -> None:
    # PaLM's full-matrix count is 12*L*H*Q*T per token for forward + backward; causal is half of it.
    full = 12 * 2 * 4 * 16 * 128
    assert 3 * attention_flops_per_token(2, 4, 16, 128) == full / 2
    # Linear in T: doubling the sequence doubles attention's cost per token, not the dense part's.
    assert training_flops_per_token(0, 2, 4, 16, 256) == 2 * training_flops_per_token(0, 2, 4, 16, 128)


def test_attention_counts_query_heads_whatever_the_kv_heads() -> None:
    # Grouped-query attention shares keys and values, but every query head still computes its own scores.
    def attention_only(kv_heads: int) -> float:
        config = tiny_llama_config(
            vocab_size=64, intermediate_size=64, num_hidden_layers=1, num_key_value_heads=kv_heads
        )
        model = LlamaForCausalLM(config)
        for param in model.parameters():
            param.requires_grad_(False)
        frozen = sum(p.numel() for p in model.parameters()) - 64 * 64  # less the input embedding
        return model_flops_per_token(model, 128) - 4 * frozen

    assert attention_only(4) == attention_only(1) == 3 * 2 * 1 * 4 * 16 * 128


def test_mfu_of_a_known_step_is_the_formula_by_hand() -> None:
    # Vocab 256, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, untied head.
    model, _ = tiny_llama()
    # Per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + MLP 3*64*128 + 2 norms of 64 = 36,992.
    # Two layers, the final norm (64) and the lm_head (256*64): 90,432 weights in matmuls.
    n = 2 * 36_992 + 64 + 256 * 64
    assert n == 90_432
    attention = 3 * 2 * 2 * 4 * 16 * 128  # forward 2*L*H*Q*T, x3 with the backward: 98,304
    per_token = 6 * n + attention
    assert per_token == 640_896
    assert model_flops_per_token(model, 128) == per_token

    # 8 sequences of 128 tokens on 2 ranks in 0.5 s, against a 1 TFLOP/s peak per rank.
    flops = model_token_flops(model)
    meter = StepMeter(tokens_per_step=8 * 128, world_size=2, flops=flops, seq_len=128, peak_tflops=1.0)
    meter.record(0.5)
    mfu = meter.flush()["mfu"]
    assert mfu == pytest.approx(1024 / 0.5 / 2 * 640_896 / 1e12, rel=1e-12)  # 6.563e-4


@pytest.mark.parametrize("recompute", [False, True])
def test_lora_trains_the_adapters_of_its_target_modules_only(recompute: bool) -> None:
    from llm_train.planning.memory.inputs import MemoryInputs
    from llm_train.planning.speed.step_time import flops_per_token

    shape = shape_of("meta-llama/Llama-3.1-8B")
    every = MemoryInputs.of(shape, 1, lora_rank=16, activation_checkpointing=recompute)
    two = every.vary(lora_targets=("q_proj", "v_proj"))
    # q and v of 32 layers: A (16 x 4096) and B (4096 x 16 for q, 1024 x 16 for v).
    assert shape.lora_params(16, ("q_proj", "v_proj")) == 32 * 16 * (4096 + 4096 + 4096 + 1024)
    fewer = shape.lora_params(16) - shape.lora_params(16, ("q_proj", "v_proj"))
    # 6 FLOPs per trained weight (forward, input and weight gradients), 2 more when recomputed.
    assert flops_per_token(every) - flops_per_token(two) == pytest.approx((6 + 2 * recompute) * fewer)
