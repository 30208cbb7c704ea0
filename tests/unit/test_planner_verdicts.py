"""Planner verdicts (FITS / FITS BUT IMPRACTICAL / DOES NOT FIT) against arithmetic written here.

The expected verdicts do not come from the planner's own output: they come from the bytes per
parameter of the ZeRO paper (Rajbhandari et al. 2020, section 3.1; mixed-precision Adam = 2
(16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master, m, v); stage 1 partitions the 12,
stage 2 the 12 + 2, stage 3 all 16, over dp), from what ZeRO-3's offloaded optimizer allocates on
the host (DeepSpeed 0.19.8's source, written out below: the 12 pageable; the fp32 gradient of each
optimizer sub-group and a flat 16-bit gradient buffer, pinned and so rounded up to a power of two
by torch; a 16-bit copy of one sub-group during the step), from what the final export holds (Adam's
m and v are freed first; then the gathered 16-bit model, 2), and from the hardware rules
(usable GPU = 95% of it; usable host = RAM - max(4 GiB, 5%)). Where a term is not model states
(activations, logits, buffers), the test bounds it from its paper formula and picks cases the
bound cannot flip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest

from llm_train import cli
from llm_train.config.hardware import hardware_for
from llm_train.errors import UserError
from llm_train.planning.auto.choose import choose_auto
from llm_train.planning.auto.written import render_auto
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.memory.quantized_bytes import quantized_weight_params
from llm_train.planning.model.shapes import shape_of
from llm_train.planning.report.verdict import plan_recipe, verdict_word
from llm_train.planning.search.candidate import evaluate
from llm_train.units import GiB

# Llama-2-7B from its config (vocab 32000, hidden 4096, 32 layers, MLP 11008, untied head):
# embedding + head 2*V*h, per layer 4h^2 (q, k, v, o) + 3*h*I (gate, up, down) + 2h (norms), final norm h.
V, H, L, I_MLP = 32000, 4096, 32, 11008
PSI_7B = 2 * V * H + L * (4 * H * H + 3 * H * I_MLP + 2 * H) + H  # 6,738,415,616
PROCESS = 3 * GiB  # one CUDA training process before model state (memory.PROCESS_HOST_BYTES)


def usable_host(ram_gib: float) -> float:
    return ram_gib * GiB - 3 * GiB  # what the operating system keeps


def usable_gpu(mem_gib: float) -> float:
    return 0.95 * mem_gib * GiB


def zero_paper_states(psi: float, dp: int, stage: int) -> float:
    """Bytes of model states per GPU, written out from the ZeRO paper."""
    return {
        0: (2 + 2 + 12) * psi,
        1: (2 + 2) * psi + 12 * psi / dp,
        2: 2 * psi + (2 + 12) * psi / dp,
        3: (2 + 2 + 12) * psi / dp,
    }[stage]


def plan_text(args: list[str]) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli.main(["plan", *args]) == 0
    return buffer.getvalue()


def test_llama2_7b_has_the_parameter_count_of_its_config() -> None:
    assert PSI_7B == 6_738_415_616
    assert shape_of("meta-llama/Llama-2-7b-hf").num_params == PSI_7B


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gpu_model_states_are_the_zero_paper_bytes(stage: int) -> None:
    est = evaluate(
        MemoryInputs.of(shape=shape_of("meta-llama/Llama-2-7b-hf"), world_size=8, zero_stage=stage),
        hardware_for(8, "H100", None, 1024, None, detect=False),
    ).estimate
    states = sum(est.gpu_terms[k] for k in ("parameters", "gradients", "optimizer_states"))
    assert states == pytest.approx(zero_paper_states(PSI_7B, 8, stage), rel=1e-9)


def test_zero3_states_are_the_paper_bytes_plus_the_unpartitioned_norms() -> None:
    est = evaluate(
        MemoryInputs.of(shape=shape_of("meta-llama/Llama-2-7b-hf"), world_size=8, zero_stage=3),
        hardware_for(8, "H100", None, 1024, None, detect=False),
    ).estimate
    states = sum(est.gpu_terms[k] for k in ("parameters", "gradients", "optimizer_states"))
    # ZeRO-3 keeps tensors under its persistence threshold (the 2L+1 norms of h elements) whole in
    # 16 bit on every GPU: 2 bytes x (2L+1)h x (1 - 1/dp) more than the paper's 16 Psi/dp.
    norms = (2 * L + 1) * H
    assert states == pytest.approx(zero_paper_states(PSI_7B, 8, 3) + 2 * norms * (1 - 1 / 8), rel=1e-6)


# --- GPU verdicts per ZeRO stage: 7B, 8 x RTX 4090 (24 GiB), micro-batch 1, seq 2048, checkpointing ---------

SEQ = 2048
# Everything on the GPU that is not model states, bounded from its paper formula (bytes):
#   activations with full checkpointing (Korthikanti et al. 2022): L layer inputs 2sh + one layer's 34sh;
#   logits upcast to fp32 plus their gradient: 8*V*s; ZeRO buffers: overlap_comm's 4.5 x (reduce +
#   prefetch buckets, ~2 h^2 elements, 16-bit) + the gathered largest layer and its gradient (4 x V*h);
#   then 10% allocator slack on all of it and 0.5 GiB of CUDA context.
REST_BOUND = 1.1 * (L * 2 * SEQ * H + 34 * SEQ * H + 8 * V * SEQ + 4.5 * 2 * 2 * H * H + 4 * V * H) + GiB / 2


def expected_gpu_verdict(states: float, mem_gib: float) -> str | None:
    """DOES NOT FIT when the states alone overflow; FITS when states + the bound do not; None: too close."""
    if states > usable_gpu(mem_gib):
        return "DOES NOT FIT"
    if 1.1 * states + REST_BOUND < usable_gpu(mem_gib):
        return "FITS"
    return None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_verdicts_on_eight_24gb_cards_follow_the_paper(stage: int) -> None:
    expected = expected_gpu_verdict(zero_paper_states(PSI_7B, 8, stage), 24)
    # 16 / 5.5 / 3.75 / 2 bytes per parameter: 100, 34.5, 23.5 and 12.6 GiB against 22.8 usable.
    assert expected == ("FITS" if stage == 3 else "DOES NOT FIT")
    hw = hardware_for(8, None, 24, 1024, None, detect=False)
    inp = MemoryInputs.of(
        shape=shape_of("meta-llama/Llama-2-7b-hf"),
        world_size=8,
        zero_stage=stage,
        micro_batch=1,
        seq_len=SEQ,
        activation_checkpointing=True,
    )
    ev = evaluate(inp, hw)
    assert ev.fits_host  # 1 TiB: only the GPU decides here
    assert verdict_word(ev, hw) == expected


# --- host RAM with the optimizer offloaded (ZeRO-3, one process): DeepSpeed's buffers; the export ---------

MiB = 2**20
# DeepSpeed's ZeRO-3 sub-groups of the 7B's matrices at the recipe's sub_group_size 2e8 (stage3.py
# _create_fp16_sub_groups: a group closes at the first tensor reaching 2e8 elements): the embedding with
# layer 1's q, k, v, o and gate (243,269,632), 31 of up, down, q, k, v, o, gate (202,375,168), and the
# last up, down with the head (221,249,536); the norms (266,240) are a group of their own.
LARGEST_SUB_GROUP = 243_269_632


def offloaded_host_peak(state: int) -> float:
    """The first optimizer step of 7b-rtx4090 with exact-size buffers (deepspeed.pinning=auto): master,
    m and v (3 x state bytes) and the sub-groups' gradients (state bytes), the flat bf16 gradient buffer
    (2 x PSI) and, with fp32 states, the bf16 copy of the largest sub-group on its way back to the GPU.
    Native pinning locks whole pages, and every one of these is a whole number of 4 KiB pages. The
    export (less m and v, plus 2 x PSI) is smaller."""
    step = 2 * LARGEST_SUB_GROUP if state == 4 else 0
    return PROCESS + 4 * state * PSI_7B + 2 * PSI_7B + step


@pytest.mark.parametrize(
    ("overrides", "state", "ram_gib", "expected"),
    [
        ([], 4, 128, "FITS"),  # 116.4 GiB < 125 usable
        ([], 4, 112, "DOES NOT FIT"),  # 116.4 GiB > 109 usable
        (["precision=bf16", "optim.state_dtype=bf16"], 2, 96, "FITS"),  # 65.8 GiB < 93 usable
        (["precision=bf16", "optim.state_dtype=bf16"], 2, 64, "DOES NOT FIT"),  # 65.8 GiB > 61 usable
    ],
)
def test_offloaded_optimizer_host_ram_and_verdict(
    overrides: list[str], state: int, ram_gib: float, expected: str
) -> None:
    host = offloaded_host_peak(state)
    assert ("FITS" if host <= usable_host(ram_gib) else "DOES NOT FIT") == expected
    report = plan_recipe("7b-rtx4090", overrides, gpu_mem_gib=24, host_ram_gib=ram_gib, detect=False)
    # Exact: the training phase is larger than the load phase (one 5 GB shard) and the export phase.
    assert report.evaluation.host_bytes == pytest.approx(host, rel=1e-9)
    assert report.word == expected


def test_the_export_phase_decides_when_the_optimizer_is_not_offloaded() -> None:
    # ZeRO-3 on 8 GPUs, nothing offloaded: the host holds only the gathered 16-bit model at the end.
    report = plan_recipe("7b-zero3", [], detect=False)
    assert report.evaluation.estimate.host_terms["export_peak"] == pytest.approx(2 * PSI_7B, rel=1e-9)


def test_plan_shows_what_bf16_states_would_save() -> None:
    text = plan_text(["--recipe", "7b-rtx4090", "--gpu-mem", "24", "--host-ram", "128"])
    saving = (offloaded_host_peak(4) - offloaded_host_peak(2)) / GiB  # 50.7 GiB
    assert f"bf16 optimizer states would save {saving:.1f} GiB host RAM" in text


# --- NVMe: never without --nvme-gib, and only with room for its footprint ---------------------------------


def test_nvme_configuration_needs_the_flag_and_room_for_its_footprint(tmp_path: Path) -> None:
    # ZeRO-Infinity keeps optimizer states + fp32 gradients (16) and the 16-bit weights (2) on the drive.
    footprint = (16 + 2) * PSI_7B  # 113 GiB
    args = ["deepspeed.config=zero3_offload_nvme", f"deepspeed.nvme_path={tmp_path}"]
    without = plan_recipe("7b-rtx4090", args, gpu_mem_gib=24, host_ram_gib=64, detect=False)
    # ZeRO-3 leaves the norms (2L+1)h whole on the GPU: a hair under 18 Psi.
    assert without.evaluation.estimate.nvme_bytes == pytest.approx(footprint, rel=1e-4)
    assert without.word == "DOES NOT FIT"
    small = plan_recipe("7b-rtx4090", args, gpu_mem_gib=24, host_ram_gib=64, detect=False, nvme_gib=100)
    assert small.word == "DOES NOT FIT" and not small.evaluation.fits_nvme  # 100 < 113 GiB
    enough = plan_recipe("7b-rtx4090", args, gpu_mem_gib=24, host_ram_gib=64, detect=False, nvme_gib=120)
    assert enough.evaluation.fits_nvme and enough.word != "DOES NOT FIT"
    text = plan_text(["--recipe", "7b-rtx4090", "--gpu-mem", "24", "--host-ram", "64", *args])
    assert "DOES NOT FIT (NVMe: pass --nvme-gib N" in text


def test_auto_never_picks_nvme_without_the_flag() -> None:
    hw = hardware_for(1, "RTX-4090", None, 64, None, detect=False)
    assert not choose_auto("meta-llama/Llama-2-7b-hf", hw).inputs.uses_nvme
    assert choose_auto("meta-llama/Llama-2-7b-hf", hw, lora="never", nvme_gib=1000).inputs.uses_nvme


def test_nvme_gib_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--recipe", "7b-rtx4090", "--nvme-gib", "0"]) == 2
    err = capsys.readouterr().err
    assert "--nvme-gib 0: give the free NVMe space in GiB" in err and err.count("\n") == 1


# --- the cases: 70B and 13B on one 24 GB card no longer say plain FITS ------------------------------

PSI_70B = shape_of("meta-llama/Llama-3.1-70B").num_params  # 70.6e9


def test_70b_on_one_24gb_card_fits_only_with_its_4bit_base_on_the_host_and_is_impractical(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Even in 4 bits (QLoRA) the weights are ~32 GiB: more than the card. Staged on the host (whole, while
    # it loads) and offloaded there by ZeRO-3 they fit 93 usable GiB, but one card computes 70B alone and
    # every pass fetches all of them over PCIe: under 100 tokens/s, impractical.
    packed = 0.5 * quantized_weight_params(shape_of("meta-llama/Llama-3.1-70B"))
    assert 24 * GiB < packed < usable_host(96) * GiB / 2
    args = ["--recipe", "auto", "--model", "meta-llama/Llama-3.1-70B", "--gpus", "1", "--gpu-mem", "24"]
    assert cli.main(["plan", *args, "--host-ram", "96"]) == 0
    out = capsys.readouterr().out
    assert "chosen:   QLoRA (nf4 base)" in out and "params=cpu" in out and "FITS BUT IMPRACTICAL" in out
    # With 32 GiB the staged base alone does not fit: nowhere, in one line.
    assert cli.main(["plan", *args, "--host-ram", "32"]) == 2
    err = capsys.readouterr().err
    assert "DOES NOT FIT anywhere" in err and err.count("\n") == 1


def test_70b_with_nvme_on_an_rtx3090_is_impractical() -> None:
    # Compute bound: a full fine-tune does >= 6 Psi FLOPs per token; at an MFU of 50% (the top of the
    # 35-50% typical range) an RTX 3090 (71 TFLOP/s dense bf16) trains at most this many tokens/s.
    assert 0.5 * 71e12 / (6 * PSI_70B) < 100  # ~84, before any PCIe or NVMe time
    hw = hardware_for(1, "RTX-3090", None, 512, None, detect=False)
    auto = choose_auto("meta-llama/Llama-3.1-70B", hw, lora="never", nvme_gib=4000)
    assert auto.evaluation.fits and auto.inputs.uses_nvme
    assert not auto.practicality.practical
    text = render_auto(auto, None)
    assert "needs:    FITS BUT IMPRACTICAL (" in text and "tokens/s, under 100" in text
    assert "instead:  " in text and "more GPUs (--gpus)" in text


def test_13b_on_one_24gb_card_with_128gib_is_not_a_full_finetune_that_fits() -> None:
    psi = shape_of("meta-llama/Llama-2-13b-hf").num_params
    # The 16-bit weights alone (2 Psi = 24.2 GiB) overflow the card, so they must be offloaded too;
    # then the host holds at least bf16 states (8) + weights (2) + the export (4) per parameter.
    assert 2 * psi > usable_gpu(24)
    assert (8 + 2 + 4) * psi > usable_host(128)  # 170 GiB > 125
    hw = hardware_for(1, None, 24, 128, None, detect=False)
    auto = choose_auto("meta-llama/Llama-2-13b-hf", hw)
    assert auto.inputs.lora_rank == 16 and "no full fine-tune fits" in auto.reasons[0]
    with pytest.raises(UserError, match="DOES NOT FIT anywhere"):
        choose_auto("meta-llama/Llama-2-13b-hf", hw, lora="never")


def test_auto_prefers_lora_over_an_impractical_full_finetune_unless_no_lora() -> None:
    # 8B on one H100 with 64 GiB: a full fine-tune fits only on NVMe (host: 4 Psi of export + 16 Psi of
    # states would be 150 GiB), while LoRA runs without any offload. On a slow drive (1 GB/s read,
    # 0.5 GB/s write: the 128 GB each way of every step take ~385 s) LoRA is >10x faster by the speed model.
    hw = dataclasses.replace(
        hardware_for(1, "H100", None, 64, None, detect=False),
        nvme_read_bytes_per_s=1e9,
        nvme_write_bytes_per_s=0.5e9,
    )
    auto = choose_auto("meta-llama/Llama-3.1-8B", hw, nvme_gib=4000)
    assert auto.inputs.lora_rank == 16 and not auto.inputs.uses_nvme and auto.practicality.practical
    assert "but is impractical" in auto.reasons[0] and "--no-lora" in auto.reasons[0]
    full = choose_auto("meta-llama/Llama-3.1-8B", hw, lora="never", nvme_gib=4000)
    assert full.inputs.lora_rank is None and full.inputs.uses_nvme
    assert any("the fastest configuration that fits without NVMe" in r for r in full.practicality.reasons)
    assert "LoRA adapters" in full.practicality.instead


# --- the consumer recipes: each FITS its declared hardware, and the 7B ones are the fastest that fit -------


@pytest.mark.parametrize("recipe", ["7b-rtx4090", "8b-lora-2x4090"])
def test_consumer_recipes_fit_their_declared_hardware(recipe: str) -> None:
    report = plan_recipe(recipe, [], detect=False)
    assert report.word == "FITS"
    if recipe.startswith("7b"):
        # Nothing faster fits with the same training: it is the fastest configuration (bf16 optimizer
        # states may be offered, at their measured quality cost).
        assert [f for f in report.faster if not f.changes_training] == []


def test_7b_rtx4090_optimizer_only_offload_is_faster_than_offloading_the_weights_too() -> None:
    ours = plan_recipe("7b-rtx4090", [], detect=False).evaluation
    old = plan_recipe("7b-rtx4090", ["deepspeed.config=zero3_offload"], detect=False).evaluation
    # Parameter offload moves the 16-bit weights over PCIe on every forward, backward and recompute.
    assert ours.time.total < 0.85 * old.time.total
