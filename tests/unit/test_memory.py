"""Memory estimator: DeepSpeed's estimators reproduced exactly (tests/unit/planner_reference.py), the ZeRO
paper, hand arithmetic."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llm_train.errors import UserError
from llm_train.planning.memory.estimate import MemoryEstimate, estimate_memory
from llm_train.planning.memory.formulas import (
    CUDA_CONTEXT_BYTES,
    NORM_UPCAST_BYTES_PER_HIDDEN,
    activation_bytes_per_layer,
    logits_bytes,
    mlp_intermediate_bytes_per_token,
)
from llm_train.planning.memory.inputs import MemoryInputError, MemoryInputs
from llm_train.planning.model.shapes import ModelShape, shape_of
from llm_train.units import GiB
from tests.unit.planner_reference import (
    deepspeed_zero2_model_states,
    deepspeed_zero3_model_states,
    zero_paper_model_states,
)

LLAMA2_7B = shape_of("meta-llama/Llama-2-7b-hf")  # h=4096, a=32, L=32, V=32000
GRID_PARAMS = [int(1e8), int(1.3e9), int(7e9), int(7e10)]
GRID_GPUS = [1, 2, 8]
GRID_NODES = [1, 4]


# --- DeepSpeed's convention, reproduced exactly -------------------------------------------------


def test_zero2_equals_deepspeed_over_grid() -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    for params, gpus, nodes, offload in itertools.product(GRID_PARAMS, GRID_GPUS, GRID_NODES, [True, False]):
        ours = deepspeed_zero2_model_states(params, gpus, nodes, cpu_offload=offload)
        theirs = stage_1_and_2.estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload
        )
        assert ours == tuple(theirs), (params, gpus, nodes, offload)


def test_zero3_equals_deepspeed_over_grid() -> None:
    from deepspeed.runtime.zero import stage3

    for params, gpus, nodes, offload, offload_params, zero_init in itertools.product(
        GRID_PARAMS, GRID_GPUS, GRID_NODES, [True, False], [True, False], [True, False]
    ):
        largest = params // 17  # any layer size; the embedding of a 7B Llama is ~1/50 of it
        ours = deepspeed_zero3_model_states(
            params,
            largest,
            gpus,
            nodes,
            cpu_offload=offload,
            cpu_offload_params=offload_params,
            zero_init=zero_init,
        )
        theirs = stage3.estimate_zero3_model_states_mem_needs(
            params,
            largest,
            num_gpus_per_node=gpus,
            num_nodes=nodes,
            cpu_offload=offload,
            cpu_offload_params=offload_params,
            zero_init=zero_init,
        )
        assert ours == tuple(theirs), (params, gpus, nodes, offload, offload_params, zero_init)


def test_deepspeed_functions_keep_their_defaults() -> None:
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    assert deepspeed_zero2_model_states(int(7e9)) == stage_1_and_2.estimate_zero2_model_states_mem_needs(
        int(7e9)
    )
    assert deepspeed_zero3_model_states(int(7e9), int(1.3e8)) == stage3.estimate_zero3_model_states_mem_needs(
        int(7e9), int(1.3e8)
    )


# --- the ZeRO paper's convention (16 bytes/param) -------------------------------------------------


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage: int, gb: float) -> None:
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, Nd = 64, K = 12.
    assert zero_paper_model_states(7.5e9, 64, stage) / 1e9 == pytest.approx(gb, abs=0.05)


def test_estimate_model_states_follow_the_paper() -> None:
    """With no tp/pp/offload, parameters + gradients + optimizer states are the paper's numbers."""
    n = LLAMA2_7B.num_params
    for stage in (0, 1, 2):
        terms = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=stage)).gpu_terms
        states = terms["parameters"] + terms["gradients"] + terms["optimizer_states"]
        assert states == pytest.approx(zero_paper_model_states(n, 8, stage), rel=1e-6)
    # ZeRO-3 keeps the small (persistent) tensors whole: a little above 16N/dp.
    terms = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=3)).gpu_terms
    states = terms["parameters"] + terms["gradients"] + terms["optimizer_states"]
    assert states == pytest.approx(zero_paper_model_states(n, 8, 3), rel=1e-3)


def test_fp32_is_4_4_8() -> None:
    terms = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=1, precision="fp32")).gpu_terms
    n = LLAMA2_7B.num_params
    assert (terms["parameters"], terms["gradients"], terms["optimizer_states"]) == (4 * n, 4 * n, 8 * n)


def test_host_offload_is_at_least_deepspeeds_18_bytes_per_param_without_its_buffer_factor() -> None:
    """DeepSpeed's estimator counts 18 B/param (optimizer 12, fp32 grads 4, 16-bit params 2) x 1.5.
    What its code allocates (planning/memory/offload_buffers.py, tests/unit/test_offload_buffers.py) is more than
    the 18, from a second, 16-bit copy of the gradients and torch's power-of-two pinned buffers, and
    within its 1.5x margin here."""
    n, nodes, gpus = LLAMA2_7B.num_params, 2, 8
    est = estimate_memory(
        MemoryInputs.of(
            shape=LLAMA2_7B,
            world_size=nodes * gpus,
            zero_stage=3,
            offload_optimizer="cpu",
            offload_params="cpu",
        )
    )
    ours = sum(
        est.host_terms[k]
        for k in ("offloaded_optimizer_states", "offloaded_fp32_gradients", "offloaded_parameters")
    )
    ds_cpu, _, _ = deepspeed_zero3_model_states(n, LLAMA2_7B.largest_layer_params, gpus, nodes)
    assert ds_cpu / 1.5 < ours < ds_cpu


# --- activations: Korthikanti et al. 2022 with the SwiGLU MLP's own intermediates, by hand -----------

# Llama-2-7B per token: h*(10 + 8) outside the MLP (layer norms, residual, q, k, v, attention output)
# + 8*i for the MLP (gate, up, SiLU(gate), product, 16-bit) = 73,728 + 88,064 bytes.
PER_TOKEN_7B = 18 * 4096 + 8 * 11008


def test_activation_per_layer_by_hand() -> None:
    # s=2048, b=1, h=4096, a=32, i=11008
    assert activation_bytes_per_layer(LLAMA2_7B, 2048, 1, "sdpa") == 2048 * PER_TOKEN_7B  # 331,350,016
    assert activation_bytes_per_layer(LLAMA2_7B, 2048, 1, "flash_attention_2") == 331_350_016
    # eager adds the s x s scores, softmax and dropout of every head: 5*a*s/h = 80 per token and h.
    assert activation_bytes_per_layer(LLAMA2_7B, 2048, 1, "eager") == 2048 * (PER_TOKEN_7B + 80 * 4096)
    assert activation_bytes_per_layer(LLAMA2_7B, 4096, 2, "sdpa") == 4096 * 2 * PER_TOKEN_7B
    # tp=2 without sequence parallel: 10 replicated + 8/2 attention, 8*i/2 MLP, 5as/(2h) = 40 eager.
    assert activation_bytes_per_layer(LLAMA2_7B, 2048, 1, "eager", tp=2) == 2048 * (
        (10 + 4 + 40) * 4096 + 4 * 11008
    )


def test_swiglu_intermediates_are_what_autograd_keeps() -> None:
    # The 8*i bytes per token are the MLP's saved tensors, counted by torch itself on a HF LlamaMLP
    # in bf16 (weights and the shared input left out): gate, up, SiLU(gate) and their product.
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    h, i, s = 64, 176, 96
    mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=i)).to(torch.bfloat16)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        mlp(x)
    shape = ModelShape("llama", h, 1, 4, 4, i, 100, False, s)
    assert sum(saved.values()) == s * mlp_intermediate_bytes_per_token(shape) == s * 8 * i


def test_lora_adapters_are_counted_on_the_target_modules_only() -> None:
    # r=8 on q and v of Llama-2-7B: A (8 x 4096) and B (4096 x 8) per projection and layer.
    assert LLAMA2_7B.lora_params(8, ("q_proj", "v_proj")) == 32 * 2 * 8 * (4096 + 4096)
    assert LLAMA2_7B.lora_params(8) == LLAMA2_7B.lora_params(
        8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    qv = MemoryInputs.of(shape=LLAMA2_7B, world_size=1, lora_rank=8, lora_targets=("q_proj", "v_proj"))
    every = MemoryInputs.of(shape=LLAMA2_7B, world_size=1, lora_rank=8)
    ratio = (
        estimate_memory(qv).gpu_terms["optimizer_states"]
        / estimate_memory(every).gpu_terms["optimizer_states"]
    )
    assert ratio == pytest.approx(LLAMA2_7B.lora_params(8, ("q_proj", "v_proj")) / LLAMA2_7B.lora_params(8))


def test_rms_norm_keeps_an_fp32_copy_of_its_16_bit_input() -> None:
    # NORM_UPCAST_BYTES_PER_HIDDEN: transformers' RMSNorm upcasts to fp32 and autograd keeps the upcast
    # (4 bytes per element, counted here as torch saves it), for each of a layer's two norms.
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    h, s = 64, 96
    norm = LlamaRMSNorm(h).to(torch.bfloat16)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, tuple[int, torch.dtype]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = (t.numel(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        norm(x)
    fp32_copies = [n for n, dtype in saved.values() if dtype == torch.float32 and n == s * h]
    assert len(fp32_copies) == 1 and 2 * 4 * len(fp32_copies) == NORM_UPCAST_BYTES_PER_HIDDEN


def test_estimate_activations_by_hand() -> None:
    s, b, h, n_layers = 2048, 1, 4096, 32
    # bf16 (the default): each layer's two RMSNorms also keep their fp32 inputs.
    layer = s * b * (PER_TOKEN_7B + NORM_UPCAST_BYTES_PER_HIDDEN * h)

    def acts(**kw: object) -> int:
        inp = MemoryInputs.of(shape=LLAMA2_7B, world_size=8, micro_batch=b, seq_len=s, **kw)  # type: ignore[arg-type]
        return estimate_memory(inp).gpu_terms["activations"]

    assert acts(attn_impl="eager") == n_layers * (layer + 80 * s * b * h)
    assert acts(attn_impl="sdpa") == n_layers * layer  # 10,603,200,512
    # Full checkpointing: each layer's 16-bit input + one layer recomputed in full.
    assert acts(activation_checkpointing=True) == n_layers * 2 * s * b * h + layer
    # pp=2, 1F1B: the first stage holds 16 layers x 2 micro-batches in flight.
    assert acts(pp=2, zero_stage=1) == 16 * 2 * layer


def test_logits_by_hand() -> None:
    # vocab 32000 x s 2048 x b 1 x 12 bytes (logits, fp32 copy, log-softmax, its two gradients at the
    # peak; measured in tests/unit/test_memory_lines.py) = 786,432,000
    assert logits_bytes(LLAMA2_7B, 2048, 1) == 32000 * 2048 * 1 * 12 == 786_432_000
    est = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=1, micro_batch=4, seq_len=1024))
    assert est.gpu_terms["logits_and_loss"] == 32000 * 1024 * 4 * 12


def test_context_and_slack() -> None:
    est = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=1))
    others = sum(v for k, v in est.gpu_terms.items() if k != "cuda_context_and_slack")
    assert est.gpu_terms["cuda_context_and_slack"] == pytest.approx(CUDA_CONTEXT_BYTES + 0.1 * others, abs=8)


def test_lora_trains_only_adapters() -> None:
    r = 16
    est = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=1, lora_rank=r)).gpu_terms
    adapters = LLAMA2_7B.lora_params(r)
    # Per layer: q,k,v,o: 4 x r x (4096 + 4096); gate, up, down: 3 x r x (4096 + 11008)
    assert adapters == 32 * r * (4 * 8192 + 3 * (4096 + 11008))
    assert est["parameters"] == 2 * (LLAMA2_7B.num_params + adapters)
    assert est["gradients"] == 2 * adapters
    assert est["optimizer_states"] == 12 * adapters


# --- sanity: directions --------------------------------------------------------------------------


def test_stages_order_gpu_model_states() -> None:
    for shape_id, world in itertools.product(["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B"], [2, 8, 64]):
        shape = shape_of(shape_id)
        states = []
        for stage in (0, 1, 2, 3):
            t = estimate_memory(MemoryInputs.of(shape=shape, world_size=world, zero_stage=stage)).gpu_terms
            states.append(t["parameters"] + t["gradients"] + t["optimizer_states"])
        assert states[3] < states[2] < states[1] < states[0], (shape_id, world, states)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"zero_stage": 1}, {"zero_stage": 1, "offload_optimizer": "cpu"}),
        ({"zero_stage": 2}, {"zero_stage": 2, "offload_optimizer": "cpu"}),
        ({"zero_stage": 3}, {"zero_stage": 3, "offload_optimizer": "cpu"}),
        ({"zero_stage": 3}, {"zero_stage": 3, "offload_optimizer": "nvme"}),
        (
            {"zero_stage": 3, "offload_optimizer": "cpu"},
            {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        ),
        ({"zero_stage": 3}, {"zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}),
    ],
)
@pytest.mark.parametrize("world", [1, 8])
def test_offload_moves_memory_from_gpu_to_host(before: dict, after: dict, world: int) -> None:
    a = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=world, **before))
    b = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=world, **after))
    assert b.gpu_bytes < a.gpu_bytes

    def held_on_host(e: MemoryEstimate) -> int:
        return sum(v for k, v in e.host_terms.items() if k not in ("model_load_peak", "process_overhead"))

    assert held_on_host(b) > held_on_host(a)
    # The total can tie: with 8 ranks each loading the 16-bit model (16 B/param per node)
    # the load peak equals ZeRO-Offload's 12 + 4 B/param held during training.
    assert b.host_bytes >= a.host_bytes
    if world == 1:
        assert b.host_bytes > a.host_bytes
    if "nvme" in after.values():
        assert b.nvme_bytes > a.nvme_bytes == 0


def test_checkpointing_and_sdpa_reduce_activations() -> None:
    base = MemoryInputs.of(shape=LLAMA2_7B, world_size=1, attn_impl="eager", seq_len=4096)
    eager = estimate_memory(base).gpu_bytes
    sdpa = estimate_memory(dataclasses.replace(base, attn_impl="sdpa")).gpu_bytes
    ckpt = estimate_memory(
        dataclasses.replace(base, attn_impl="sdpa", activation_checkpointing=True)
    ).gpu_bytes
    assert ckpt < sdpa < eager


def test_zero_init_avoids_full_model_per_rank_at_load() -> None:
    with_init = estimate_memory(MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=3))
    without = estimate_memory(
        MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=3, zero_init=False, direct_load=False)
    )
    assert without.host_terms["model_load_peak"] == 8 * 2 * LLAMA2_7B.num_params  # every rank, 16-bit
    assert with_init.host_terms["model_load_peak"] == 8 * 5 * 10**9  # one 5 GB shard per rank
    assert with_init.host_bytes < without.host_bytes


def test_pipeline_stages_load_only_their_share_of_the_model() -> None:
    whole = estimate_memory(
        MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=1, zero_init=False, direct_load=False)
    )
    staged = estimate_memory(
        MemoryInputs.of(shape=LLAMA2_7B, world_size=8, pp=8, zero_stage=1, zero_init=False)
    )
    stage = 2 * LLAMA2_7B.num_params / 8 + 2 * LLAMA2_7B.largest_layer_params  # 16-bit
    assert staged.host_terms["model_load_peak"] == int(8 * stage)
    assert staged.host_terms["model_load_peak"] < whole.host_terms["model_load_peak"] / 4


def test_known_budget_7b_on_a_24gb_card() -> None:
    """A 7-8B full fine-tune fits 24 GB only with offload; with the weights offloaded too,
    DeepSpeed's pinned buffers put an 8B at ~173 GiB of host RAM (planning/memory/offload_buffers.py)."""
    shape = shape_of("meta-llama/Llama-3.1-8B")
    common = {"shape": shape, "world_size": 1, "activation_checkpointing": True}
    plain = estimate_memory(MemoryInputs.of(zero_stage=2, **common))
    assert plain.gpu_bytes > 24 * GiB
    full = estimate_memory(
        MemoryInputs.of(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", **common)
    )
    assert full.gpu_bytes < 24 * GiB
    assert 160 * GiB < full.host_bytes < 185 * GiB
    # The final export gathers one 16-bit copy of the model; Adam's moments (8 of the offloaded 12
    # bytes per parameter) are freed first, so the training phase stays the larger.
    assert full.host_terms["export_peak"] == 2 * shape.num_params
    training = sum(v for k, v in full.host_terms.items() if k not in ("export_peak", "model_load_peak"))
    assert full.host_bytes == pytest.approx(training, rel=1e-9)


# --- output shape and validation -----------------------------------------------------------------


def test_estimate_structure_and_table() -> None:
    est = estimate_memory(
        MemoryInputs.of(shape=LLAMA2_7B, world_size=8, zero_stage=3, offload_optimizer="nvme")
    )
    assert list(est.gpu_terms) == [
        "parameters",
        "gradients",
        "optimizer_states",
        "activations",
        "logits_and_loss",
        "deepspeed_buffers",
        "cuda_context_and_slack",
    ]
    assert est.gpu_bytes == sum(est.gpu_terms.values())
    assert "16 B/param" in est.convention and "18" in est.convention
    rows = est.table()
    assert all(re.fullmatch(r"\d+\.\d\d GiB", value) for _, value in rows)
    labels = [label for label, _ in rows]
    assert (
        "GPU total (per GPU)" in labels
        and "host RAM total (per node)" in labels
        and "NVMe (per node)" in labels
    )


def test_auto_defaults_follow_hf() -> None:
    inp = MemoryInputs.of(shape=LLAMA2_7B, world_size=16)
    assert inp.reduce_bucket_size == 4096 * 4096
    assert inp.prefetch_bucket_size == int(0.9 * 4096 * 4096)
    assert inp.param_persistence_threshold == 40960
    assert (inp.gpus_per_node, inp.num_nodes, inp.dp) == (8, 2, 16)
    assert MemoryInputs.of(shape=LLAMA2_7B, world_size=2).gpus_per_node == 2
    assert MemoryInputs.of(shape=LLAMA2_7B, world_size=16, tp=2, pp=2).dp == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tp": 4}, "world_size 6 is not divisible by tp\\*pp = 4\\*1"),
        ({"world_size": 2, "zero_stage": 4}, "zero_stage must be"),
        ({"world_size": 2, "zero_stage": 2, "offload_params": "cpu"}, "offload_params needs zero_stage 3"),
        ({"world_size": 2, "offload_optimizer": "cpu"}, "offload_optimizer needs zero_stage 1, 2 or 3"),
        ({"world_size": 2, "zero_stage": 2, "offload_optimizer": "nvme"}, "'nvme' needs zero_stage 3"),
        ({"world_size": 4, "pp": 2, "zero_stage": 2}, "refuses ZeRO-2 with pipeline"),
        ({"world_size": 2, "precision": "fp8"}, "precision must be one of bf16, fp16, fp32"),
        ({"world_size": 2, "attn_impl": "flash"}, "attn_impl must be one of"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"world_size": 2, "lora_rank": 0}, "lora_rank must be >= 1"),
    ],
)
def test_invalid_inputs_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(MemoryInputError, match=message) as info:
        MemoryInputs.of(shape=LLAMA2_7B, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)
    assert "\n" not in str(info.value)


def test_tiny_shape_is_positive_everywhere() -> None:
    tiny = ModelShape("llama", 64, 2, 4, 2, 176, 50, True, 128)
    est = estimate_memory(MemoryInputs.of(shape=tiny, world_size=2, zero_stage=3, seq_len=16))
    assert est.gpu_bytes > CUDA_CONTEXT_BYTES and est.host_bytes > 0


def test_modules_do_not_import_torch_or_deepspeed() -> None:
    code = "import sys, llm_train.planning.memory.estimate, llm_train.planning.model.shapes; print(sorted({'torch','deepspeed','transformers'} & set(sys.modules)))"
    repo_root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root
    )
    out = run.stdout
    assert out.strip() == "[]"
