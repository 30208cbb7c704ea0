"""GRPO's generation as the planner counts it (planning/memory/generation.py): each term checked against what
runtime/rl/grpo.py's generate call holds, measured where a CPU can measure it, and the plan's phases and time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm_train.config.hardware import hardware_for
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.generation import (
    DECODE_SECONDS_PER_LAYER,
    GenerationInputs,
    kv_cache_bytes,
)
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import shape_from_config, shape_of
from llm_train.planning.report.verdict import plan_recipe, render
from llm_train.planning.search.candidate import evaluate

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
GRPO = GenerationInputs(num_generations=8, completion_tokens=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_key_value_cache_is_the_bytes_of_a_real_dynamic_cache_after_generate(dtype: torch.dtype) -> None:
    # runtime/rl/grpo.py's call: left-padded prompts, sampling, max_new_tokens; the cache holds prompt + new - 1
    # positions (the last sampled token is never fed back).
    config = LlamaConfig(
        **{k: v for k, v in TINY.items() if k != "model_type"}, pad_token_id=0, eos_token_id=2
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    rows, prompt, new = 6, 10, 7
    ids = torch.randint(3, 256, (rows, prompt))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a shorter prompt, left-padded as grpo.left_pad does
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        top_k=0,
        max_new_tokens=new,
        min_new_tokens=new,  # every row at the maximum, as the estimate counts them
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    assert measured == kv_cache_bytes(shape_from_config(TINY), rows, prompt + new - 1, dtype_bytes)


def _grpo_8b(zero_stage: int, world: int, micro: int = 4, accum: int = 8, **rest: object) -> MemoryInputs:
    return MemoryInputs.of(
        shape=shape_of("meta-llama/Llama-3.1-8B"),
        world_size=world,
        zero_stage=zero_stage,
        micro_batch=micro,
        grad_accum=accum,
        seq_len=512,
        activation_checkpointing=True,
        **{"generation": GRPO, **rest},
    )


def test_a_rank_generates_its_whole_step_in_one_call_with_the_cache_of_every_row() -> None:
    inp = _grpo_8b(2, 1, lora_rank=16)
    est = estimate_memory(inp)
    # 32 rows x (256 + 256 - 1) positions x 128 KiB (2 x 32 layers x 8 kv heads x 128 x 2 bytes).
    assert est.generation_terms["generation_kv_cache"] == 32 * 511 * 2 * 32 * 8 * 128 * 2
    assert "generation_gathered_parameters" not in est.generation_terms  # ZeRO-2: every weight already whole
    assert est.gpu_bytes == max(sum(est.gpu_terms.values()), est.generation_bytes)


def test_under_zero3_the_whole_model_is_gathered_for_generation_and_can_be_the_peak() -> None:
    inp = _grpo_8b(3, 8)
    est = estimate_memory(inp)
    gathered = est.generation_terms["generation_gathered_parameters"]
    # compat.gathered_for_generation gathers every partitioned parameter: the 16-bit model, less the small
    # tensors ZeRO-3 keeps whole anyway (norms).
    assert 0.999 * inp.shape.num_params * 2 < gathered <= inp.shape.num_params * 2
    assert est.generation_bytes > sum(est.gpu_terms.values())  # checkpointed training holds less
    assert est.gpu_bytes == est.generation_bytes
    plain = estimate_memory(dataclasses.replace(inp, generation=None))
    assert plain.generation_terms == {} and plain.gpu_bytes == sum(plain.gpu_terms.values())


def test_layer_by_layer_gathering_holds_one_layer_and_moves_the_model_per_token() -> None:
    """grpo.ds3_gather_for_generation false: ZeRO-3's hooks gather each layer for every forward of the call."""
    hw = hardware_for(8, "H100-80GB", None, 512, None, detect=False)
    whole = _grpo_8b(3, 8)
    layered = _grpo_8b(3, 8, generation=dataclasses.replace(GRPO, gather_whole=False))
    whole_terms = estimate_memory(whole).generation_terms
    layered_terms = estimate_memory(layered).generation_terms
    gathered = whole_terms["generation_gathered_parameters"]
    assert layered_terms["generation_gathered_parameters"] == pytest.approx(gathered / 32)  # 32 layers
    assert estimate_memory(layered).generation_bytes < estimate_memory(whole).generation_bytes
    once, per_token = evaluate(whole, hw).time.generation_call, evaluate(layered, hw).time.generation_call
    assert once is not None and per_token is not None and once.gather > 0
    assert per_token.gather == pytest.approx(once.gather * (256 + 1))  # the prefill and each of 256 tokens


def test_grpo_keeps_the_logits_of_the_completion_positions_only() -> None:
    with_generation = estimate_memory(_grpo_8b(2, 1, lora_rank=16)).gpu_terms["logits_and_loss"]
    without = estimate_memory(_grpo_8b(2, 1, lora_rank=16, generation=None)).gpu_terms["logits_and_loss"]
    assert with_generation == without * 257 // 512


def test_decode_is_bound_by_launch_overhead_for_few_rows_and_a_4bit_base_streams_more() -> None:
    hw = hardware_for(1, "RTX 4090", None, 64, None, detect=False)
    lora = evaluate(_grpo_8b(2, 1, lora_rank=16), hw).time.generation_call
    qlora = evaluate(_grpo_8b(2, 1, lora_rank=16, quantize="nf4"), hw).time.generation_call
    assert lora is not None and qlora is not None
    assert lora.bound == "launch overhead" and lora.decode_step == pytest.approx(
        32 * DECODE_SECONDS_PER_LAYER
    )
    # Each QLoRA decode step reads the packed base, writes its 16-bit copy and reads that: past the overhead.
    assert qlora.bound == "memory bandwidth" and qlora.decode_step > lora.decode_step
    assert lora.decode == pytest.approx(256 * lora.decode_step) and lora.tokens == 32 * 256


def test_one_generation_serves_num_iterations_steps_and_adds_the_old_log_probs() -> None:
    hw = hardware_for(1, "RTX 4090", None, 64, None, detect=False)
    once = evaluate(_grpo_8b(2, 1, lora_rank=16), hw).time
    twice_inp = _grpo_8b(2, 1, lora_rank=16, generation=dataclasses.replace(GRPO, num_iterations=2))
    twice = evaluate(twice_inp, hw).time
    assert once.generation_call is not None and twice.generation_call is not None
    assert once.generation_call.old_logps == 0 < twice.generation_call.old_logps
    assert twice.generation == pytest.approx(twice.generation_call.total / 2)
    assert once.total == pytest.approx(once.training + once.generation)


def test_the_plan_of_the_rtx4090_recipe_names_the_dominant_part_with_both_times() -> None:
    report = plan_recipe("8b-grpo-lora-rtx4090", [], detect=False)
    text = render(report)
    t = report.evaluation.time
    assert report.word == "FITS" and t.generation > 0 and t.training > 0
    larger = "generation" if t.generation >= t.training else "training"
    assert f"{larger} dominates the step: ~{max(t.generation, t.training):.2f}s" in text
    assert "GPU generation: key-value cache" in text and "a rough model until measured" in text


def test_the_fix_search_tries_qlora_for_a_lora_grpo_run_on_a_12_gib_card() -> None:
    """The issue's case: it said 'does not fit anywhere' while lora.quantize=nf4 fits (10.9 of 12 GiB)."""
    report = plan_recipe("8b-grpo-lora-rtx4090", [], gpu="RTX-4070", host_ram_gib=16, detect=False)
    assert report.word.startswith("DOES NOT FIT") and report.fixes
    qlora = [f for f in report.fixes if "lora.quantize=nf4" in f.overrides]
    assert qlora and qlora[0].evaluation.fits
    # The fix's own plan agrees: the recipe with its overrides fits.
    again = plan_recipe(
        "8b-grpo-lora-rtx4090", qlora[0].overrides, gpu="RTX-4070", host_ram_gib=16, detect=False
    )
    assert again.evaluation.fits


def test_the_fix_search_tries_layer_by_layer_generation_under_zero3() -> None:
    """8 x 12 GiB cards: gathering the whole 8B model to generate cannot fit; ZeRO-3's layer-by-layer gathering
    (grpo.ds3_gather_for_generation=false) can, with the optimizer offloaded."""
    hardware = {"gpus": 8, "gpu": "RTX-4070", "host_ram_gib": 512, "detect": False}
    report = plan_recipe("8b-grpo-zero3", [], **hardware)  # type: ignore[arg-type]
    layered = [f for f in report.fixes if "grpo.ds3_gather_for_generation=false" in f.overrides]
    assert layered and all("lora.rank" not in " ".join(f.overrides) for f in layered[:1])
    again = plan_recipe("8b-grpo-zero3", layered[0].overrides, **hardware)  # type: ignore[arg-type]
    assert again.evaluation.fits


def test_the_plan_names_the_generation_engine() -> None:
    engines = {}
    for flag in ("false", "true"):
        report = plan_recipe(
            "8b-grpo-lora-rtx4090", [f"grpo.use_transformers_continuous_batching={flag}"], detect=False
        )
        engines[flag] = (render(report), report.evaluation.inputs.generation)
    assert "one generate call" in engines["false"][0]
    assert "one continuous-batching generate_batch call" in engines["true"][0]
    assert engines["true"][1] is not None and engines["true"][1].engine == "continuous batching"
