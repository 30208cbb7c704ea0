"""`--recipe auto`: the recipe it writes is the plan it printed, and every line it prints is true.

The invariant, over a grid of hardware (where a full fine-tune wins, where 16-bit LoRA wins, where only QLoRA
fits) and every class of override: the written recipe, read back and planned from scratch like any recipe, is
the configuration the search chose (the same estimate inputs, memory and step time), or the command refuses in
one line. Then the issue's commands, each with its corrected output or one line, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_train import cli
from llm_train.config.hardware import hardware_for
from llm_train.errors import UserError
from llm_train.planning.auto.choose import choose_auto
from llm_train.planning.auto.written import auto_recipe_yaml, check_written, written_evaluation

# Where each kind wins with no override (checked by the first test): 8B on 2 x H100 with 512 GiB trains every
# weight, on one RTX 4090 with 128 GiB 16-bit LoRA, and on an RTX 3060 with 16 GiB of host RAM only a 4-bit
# base fits.
HARDWARE = {
    "full": ("meta-llama/Llama-3.1-8B", 2, "H100", 512),
    "lora": ("meta-llama/Llama-3.1-8B", 1, "RTX-4090", 128),
    "qlora": ("meta-llama/Llama-3.1-8B", 1, "RTX-3060", 16),
}

# One or more overrides of each class: the search's knobs, lora.*, parallel degrees, memory switches, the
# optimizer, the data.
OVERRIDES = {
    "knob": [
        "optim.micro_batch_size=1",
        "memory.activation_checkpointing=true",
        "deepspeed.config=zero3",
        "data.seq_len=1024",
        "optim.global_batch_size=32",
        "deepspeed.pinning=off",
    ],
    "lora": [
        "lora.dropout=0.0",
        "lora.alpha=64",
        "lora.export=adapter",
        "lora.rank=8",
        "lora.quantize=nf4",
        "lora.quantize=none",
        "lora.target_modules=[q_proj,v_proj]",
    ],
    "parallel": ["deepspeed.pipeline_stages=2", "deepspeed.sequence_parallel=2"],
    "memory": ["memory.tiled_mlp=true", "memory.tiled_loss=true", "memory.attention=sdpa"],
    "optimizer": ["optim.name=adamw_8bit", "optim.state_dtype=bf16", "optim.lr=1e-4"],
    "data": ["data.loader_workers=0", "data.packing=padded"],
}


def _hardware(where: str) -> tuple[str, object]:
    model, gpus, gpu, ram = HARDWARE[where]
    return model, hardware_for(gpus, gpu, None, ram, None, detect=False)


def _kind(auto: object) -> str:
    c = auto.inputs  # type: ignore[attr-defined]
    return "full" if not c.lora_rank else "qlora" if c.quantize != "none" else "lora"


@pytest.mark.parametrize("where", sorted(HARDWARE))
def test_each_hardware_point_is_won_by_its_kind(where: str) -> None:
    model, hw = _hardware(where)
    assert _kind(choose_auto(model, hw)) == where


@pytest.mark.parametrize("where", sorted(HARDWARE))
@pytest.mark.parametrize(
    "override", [pytest.param(o, id=f"{cls}:{o}") for cls, group in OVERRIDES.items() for o in group]
)
def test_the_written_recipe_plans_as_the_search_chose_or_auto_refuses(
    where: str, override: str, tmp_path: Path
) -> None:
    model, hw = _hardware(where)
    try:
        auto = choose_auto(model, hw, overrides=[override])
    except UserError as exc:
        assert "\n" not in str(exc) and "Traceback" not in str(exc)
        return
    if override.startswith("lora."):
        assert auto.inputs.lora_rank  # an override that configures adapters plans adapters
    path = tmp_path / "auto.yaml"
    path.write_text(auto_recipe_yaml(auto))
    check_written(auto, path)  # the file, resolved from scratch: the same inputs, memory and step time
    written = written_evaluation(auto, path)
    chosen = auto.evaluation
    assert written.inputs == chosen.inputs
    assert (written.device_bytes, written.host_bytes, written.time) == (
        chosen.device_bytes,
        chosen.host_bytes,
        chosen.time,
    )
    assert written.inputs.layout.global_batch_size == auto.global_batch


def test_a_mismatch_between_the_choice_and_the_written_recipe_is_refused_in_one_line() -> None:
    # The guard itself, on the first bug: a full fine-tune chosen, a lora section in what is written.
    model, hw = _hardware("full")
    auto = choose_auto(model, hw)
    assert not auto.inputs.lora_rank
    auto.recipe_data = {**auto.recipe_data, "lora": {"dropout": 0.0}}
    with pytest.raises(UserError, match="plans differently from its choice") as exc:
        check_written(auto)
    assert "lora_rank: chosen None, written 16" in str(exc.value) and "\n" not in str(exc.value)


# --- the commands -------------------------------------------------------------------------------

H100_PAIR = ["--model", "meta-llama/Llama-3.1-8B", "--gpus", "2", "--gpu", "H100", "--host-ram", "512"]


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["plan", "--recipe", "auto", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("override", ["lora.dropout=0.0", "lora.alpha=64", "lora.export=adapter"])
def test_a_lora_override_where_full_wins_plans_and_writes_adapters(
    override: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.yaml"
    code, out = _plan(capsys, *H100_PAIR, "--write", str(path), override)
    assert code == 0
    assert "chosen:   LoRA" in out
    # The why names the override that asked for adapters, never a full fine-tune it did not evaluate.
    assert f"{override} configures adapters" in out and "no full fine-tune fits" not in out
    assert "lora:" in path.read_text()


@pytest.mark.parametrize("override", ["deepspeed.pipeline_stages=2", "deepspeed.config=zero1_tp"])
def test_a_parallel_override_keeps_the_global_batch(
    override: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.yaml"
    code, out = _plan(capsys, *H100_PAIR, "--write", str(path), override)
    assert code == 0, out
    assert "x dp 1," in out  # 2 GPUs, both in one pipeline (or tensor-parallel group)
    micro = int(out.split("micro ")[1].split(" ")[0])
    accum = int(out.split("accum ")[1].split(" ")[0])
    assert micro * accum == 64
    assert "global_batch_size: 64" in path.read_text()


def test_the_global_batch_splits_over_the_layouts_data_parallel_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 GPUs in pipelines of 2: 2 data-parallel ranks, so 6 sequences per step split (3 per rank) and 5 do not.
    four = ["--model", "meta-llama/Llama-3.1-8B", "--gpus", "4", "--gpu", "H100", "--host-ram", "512"]
    code, out = _plan(capsys, *four, "--global-batch", "6", "deepspeed.pipeline_stages=2")
    assert code == 0 and "x dp 2," in out
    code, out = _plan(capsys, *four, "--global-batch", "5", "deepspeed.pipeline_stages=2")
    assert code == 2 and out.strip().count("\n") == 0
    assert "--global-batch 5 does not split over 2 data-parallel ranks (4 GPUs / (tp 1 x pp 2 x sp 1))" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--no-lora", "lora.rank=8"],
            "--no-lora plans a full fine-tune, but lora.rank=8 configures adapters",
        ),
        (["--gpus", "0"], "--gpus 0: give the number of GPUs (>= 1)"),
        (["--seq-len", "0"], "--seq-len 0: give the tokens per sequence (>= 1)"),
        (["--global-batch", "0"], "--global-batch 0: give the sequences per optimizer step (>= 1)"),
        (["--host-ram", "0"], "--host-ram 0: give the memory in GiB (> 0)"),
        # float() takes nan and inf: each is refused like 0, not a ValueError or OverflowError traceback.
        (["--host-ram", "nan"], "--host-ram nan: give the memory in GiB (> 0)"),
        (["--host-ram", "inf"], "--host-ram inf: give the memory in GiB (> 0)"),
        (["--gpu-mem", "inf"], "--gpu-mem inf: give the memory in GiB (> 0)"),
        (["--nvme-gib", "nan"], "--nvme-gib nan: give the free NVMe space in GiB (> 0)"),
        (["--nvme-read-gbs", "inf"], "--nvme-read-gbs inf: give the drive's speed in GB/s (> 0)"),
        # A flag and an override of the same key that disagree: neither is silently dropped.
        (
            ["--seq-len", "2048", "data.seq_len=4096"],
            "--seq-len 2048 and data.seq_len=4096 disagree; give the sequence length once",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _plan(capsys, "--model", "meta-llama/Llama-3.2-1B", "--gpu", "H100", *argv)
    assert code == 2 and says in out and out.strip().count("\n") == 0 and "Traceback" not in out


def test_why_names_the_pinned_rank_and_never_a_full_fine_tune_it_did_not_evaluate() -> None:
    # lora.rank=8 on an 80 GB H100 with a 1B: adapters because the override asks for them, at rank 8.
    hw = hardware_for(1, "H100", None, 64, None, detect=False)
    why = choose_auto("meta-llama/Llama-3.2-1B", hw, overrides=["lora.rank=8"]).reasons
    assert why[0].startswith("lora.rank=8 configures adapters: this trains LoRA adapters (rank 8)")
    assert not any("no full fine-tune fits" in r or "rank 16" in r for r in why)


def test_qlora_where_no_16_bit_base_fits_says_so_and_claims_no_margin() -> None:
    # 70B on 2 x 24 GB with 128 GiB: only the 4-bit base fits, so there is no 16-bit base to be 5% faster than.
    hw = hardware_for(2, "RTX-4090", None, 128, None, detect=False)
    auto = choose_auto("meta-llama/Llama-3.1-70B", hw)
    four_bit = next(r for r in auto.reasons if r.startswith("the frozen base loads in 4 bits"))
    assert auto.inputs.quantize == "nf4" and "no configuration with a 16-bit base fits" in four_bit
    assert "by more than" not in four_bit and "nvme" not in four_bit  # the closest the user can run as told


def test_a_pinned_sequence_parallel_degree_is_planned_with_the_kernel_and_rows_it_needs(
    tmp_path: Path,
) -> None:
    # sdpa_flex is auto's own choice on the plain ZeRO path; with sp it plans sdpa and padded rows instead.
    model, hw = _hardware("full")
    auto = choose_auto(model, hw, seq_len=8192, overrides=["deepspeed.sequence_parallel=2"])
    assert auto.inputs.sp == 2 and auto.inputs.attn_impl == "sdpa"
    assert not any("needs DeepSpeed ALST" in r for r in auto.reasons)  # the user asked for it
    path = tmp_path / "sp.yaml"
    path.write_text(auto_recipe_yaml(auto))
    assert "packing: padded" in path.read_text()
    check_written(auto, path)


def test_lora_target_modules_are_planned() -> None:
    model, hw = _hardware("lora")
    auto = choose_auto(model, hw, overrides=["lora.target_modules=[q_proj,v_proj]"])
    assert auto.inputs.lora_targets == ("q_proj", "v_proj")


@pytest.mark.parametrize(("gpu", "full", "lora"), [("RTX-4090", 158.6, 109.0), ("H100", 28.9, 12.0)])
def test_a_full_fine_tune_preferred_over_faster_adapters_says_what_it_costs(
    gpu: str, full: float, lora: float
) -> None:
    # The item 6: 128 -> 192 GiB lets a full fine-tune fit; the policy prefers it and says so.
    hw = hardware_for(1, gpu, None, 192, None, detect=False)
    auto = choose_auto("meta-llama/Llama-3.1-8B", hw)
    assert not auto.inputs.lora_rank
    line = next(r for r in auto.reasons if r.startswith("full fine-tune preferred"))
    assert f"~{full} s/step against LoRA's ~{lora}" in line and "--lora for adapters" in line
    assert choose_auto("meta-llama/Llama-3.1-8B", hw, lora="always").evaluation.time.total == pytest.approx(
        lora, abs=0.05
    )


# --- one source of truth for the adapters' defaults ---------------------------------------------------------


def test_the_planners_lora_defaults_are_the_recipe_schemas() -> None:
    # A default moved in config/recipe_sections.py moves in the planner too; a copy kept in planning/ would fail here.
    from llm_train.config.recipe_sections import LoraSection
    from llm_train.planning.auto.request import suggested_lora
    from llm_train.planning.memory.inputs import MemoryInputs
    from llm_train.planning.model import shapes
    from llm_train.planning.search import candidate

    schema = LoraSection()
    default_targets = MemoryInputs.__dataclass_fields__["lora_targets"].default
    assert shapes.LORA_TARGETS == tuple(schema.target_modules) == default_targets
    assert (schema.rank, schema.dropout) == (candidate.SUGGESTED_LORA_RANK, candidate.SUGGESTED_LORA_DROPOUT)
    assert (
        LoraSection(**suggested_lora()) == schema
    )  # auto writes the schema's section, target modules included


def test_a_flag_and_an_override_that_agree_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "meta-llama/Llama-3.2-1B", "--gpu", "H100", "--seq-len", "1024", "data.seq_len=1024"]
    code, out = _plan(capsys, *argv)
    assert code == 0 and ", seq 1024, " in out, out[-2000:]


def test_an_int8_base_is_said_to_load_in_8_bits() -> None:
    hw = hardware_for(1, "RTX-4090", None, 64, None, detect=False)
    why = choose_auto("meta-llama/Llama-3.1-8B", hw, overrides=["lora.quantize=int8"]).reasons
    (line,) = [r for r in why if r.startswith("the frozen base loads in")]
    assert line.startswith("the frozen base loads in 8 bits (QLoRA, lora.quantize=int8;"), line
    assert "4 bits" not in " ".join(why)
