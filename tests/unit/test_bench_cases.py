"""The GPU cases' verdicts can fail: a number off the planner, a peak past the real card, an export that does
not verify, locked bytes that are not the planner's, a packed row that leaks across documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import consumer, doc_isolation, full_ft
from bench.cases import Budget, Context
from bench.result_files import Results
from bench.verdicts import Judging
from tests.helpers import tiny_llama_config


def context(tmp_path: Path, gpu: bool = True) -> Context:
    return Context(gpu, tmp_path, Budget(60), Results("check", tmp_path / "out"), Judging(enforce=gpu))


# --- the consumer cards -------------------------------------------------------------------------------------


def consumer_record(**changes: object) -> dict:
    base = {
        "measurement": "qlora_12",
        "finish": True,
        "card_memory_gib": 11.99,
        "est_gpu_gib": 10.0,
        "gpu_device_used_peak_gib": 10.5,
        "est_gpu_allocated_gib": 8.8,
        "gpu_mem_peak_gib": 9.0,
        "est_host_train_gib": 7.0,
        "host_pss_train_peak_gib": 6.5,
        "est_host_gib": 8.0,
        "export_host_pss_peak_gib": 6.0,
        "export_verified": "exported 291 tensors to final (verified: loads with no missing ...)",
        "passed": True,
    }
    return {**base, **changes}


def misses(record: dict) -> set[str]:
    return {v["quantity"] for v in record["verdicts"] if not v["passed"]}


def test_a_consumer_case_within_the_planners_15_percent_passes(tmp_path: Path) -> None:
    checked = consumer.judge_consumer(consumer_record(), context(tmp_path))
    assert checked["passed"] and misses(checked) == set()


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        ({"gpu_device_used_peak_gib": 11.6}, "gpu_device_used_peak_gib"),  # 16% over the estimate
        (
            {"gpu_device_used_peak_gib": 8.4},
            "gpu_device_used_peak_gib",
        ),  # 16% under: the planner wastes a card
        ({"gpu_mem_peak_gib": 10.2}, "gpu_mem_peak_gib"),
        # Within the estimate yet past the real card: the cap bounds the allocator, not the context.
        ({"est_gpu_gib": 11.5, "gpu_device_used_peak_gib": 12.2}, "gpu_device_used_peak_gib_on_the_card"),
        ({"host_pss_train_peak_gib": 8.1}, "host_pss_train_peak_gib"),
        ({"export_host_pss_peak_gib": 8.3}, "export_host_pss_peak_gib"),
        ({"export_verified": None}, "export_verified"),
        ({"gpu_device_used_peak_gib": None}, "gpu_device_used_peak_gib"),  # not measured is not a pass
    ],
)
def test_each_consumer_miss_fails_the_line(tmp_path: Path, changes: dict, failed: str) -> None:
    checked = consumer.judge_consumer(consumer_record(**changes), context(tmp_path))
    assert not checked["passed"] and failed in misses(checked)


def test_on_cpu_the_planner_is_recorded_but_the_export_still_decides(tmp_path: Path) -> None:
    cpu = context(tmp_path, gpu=False)
    assert consumer.judge_consumer(consumer_record(gpu_device_used_peak_gib=None), cpu)["passed"]
    assert not consumer.judge_consumer(consumer_record(export_verified=None), cpu)["passed"]


def test_each_consumer_case_runs_the_recipe_of_its_card() -> None:
    # The caps are the recipes' own cards (issue 33: 12 GiB for QLoRA, 24 GiB for LoRA).
    assert consumer.hardware("8b-qlora-rtx4070")["gpu_cap_gib"] == 12
    assert consumer.hardware("8b-lora-rtx4090")["gpu_cap_gib"] == 24
    assert consumer.hardware("8b-qlora-rtx4070")["card_memory_gib"] == pytest.approx(12282 / 1024)


# --- the full fine-tunes --------------------------------------------------------------------------------------


def full_ft_record(**changes: object) -> dict:
    # The 7B case as planned (116.4 GiB host, 37.65 GiB locked) and measured within it.
    record = {
        "fits": True,
        "est_host_train_gib": 116.4,
        "host_pss_peak_gib": 110.0,
        "est_gpu_allocated_gib": 19.0,
        "gpu_mem_peak_gib": 20.0,
        "est_gpu_gib": 21.0,
        "gpu_device_used_peak_gib": 21.5,
        "est_locked_gib": 37.65,
        "locked_peak_gib": 37.7,
    }
    return {**record, **changes}


def full_ft_misses(tmp_path: Path, record: dict, case: int = 0, gpu: bool = True) -> set[str]:
    verdicts = full_ft.verdicts(record, full_ft.CASES[case], context(tmp_path, gpu))
    return {v["quantity"] for v in verdicts if not v["passed"]}


def test_the_7b_case_passes_inside_the_estimate_and_fails_outside_it(tmp_path: Path) -> None:
    assert full_ft_misses(tmp_path, full_ft_record()) == set()
    above = full_ft_misses(tmp_path, full_ft_record(host_pss_peak_gib=117.0))
    assert above == {"host_pss_peak_gib_at_most_planned"}  # an estimate the run exceeds is an OOM
    assert full_ft_misses(tmp_path, full_ft_record(host_pss_peak_gib=90.0)) == {"host_pss_peak_gib"}
    assert full_ft_misses(tmp_path, full_ft_record(gpu_mem_peak_gib=23.0)) == {"gpu_mem_peak_gib"}
    # The allocator stays under the 24 GiB cap; the device as a whole does not fit a real RTX 4090.
    past_the_card = full_ft_record(est_gpu_gib=23.5, gpu_device_used_peak_gib=24.5)
    assert full_ft_misses(tmp_path, past_the_card) == {"gpu_device_used_peak_gib_on_the_card"}
    assert full_ft_misses(tmp_path, full_ft_record(gpu_device_used_peak_gib=17.0)) == {
        "gpu_device_used_peak_gib"
    }
    assert full_ft_misses(tmp_path, full_ft_record(locked_peak_gib=0.0)) == {"locked_peak_gib"}  # not pinned
    assert full_ft_misses(tmp_path, full_ft_record(locked_peak_gib=40.0)) == {"locked_peak_gib_at_most"}
    over = full_ft_record(est_host_train_gib=125.0, host_pss_peak_gib=121.0)
    assert full_ft_misses(tmp_path, over) == {"host_pss_peak_gib_ceiling"}
    assert full_ft_misses(tmp_path, full_ft_record(fits=False)) == {"planner_fits"}


def test_on_cpu_the_locked_bytes_are_exact_and_the_pss_only_recorded(tmp_path: Path) -> None:
    cpu = full_ft_record(
        est_host_train_gib=1.09, host_pss_peak_gib=4.3, est_locked_gib=0.01418, locked_peak_gib=0.01418
    )
    assert full_ft_misses(tmp_path, cpu, gpu=False) == set()
    assert full_ft_misses(tmp_path, {**cpu, "locked_peak_gib": 0.0142}, gpu=False) == {"locked_peak_gib"}


def test_the_nvme_case_checks_drive_bytes_and_losses(tmp_path: Path) -> None:
    record = full_ft_record(
        est_nvme_read_gb_per_step=24.7, est_nvme_write_gb_per_step=24.7,
        nvme_read_gb_per_step=24.7, nvme_write_gb_per_step=30.0,
    )  # fmt: skip
    assert full_ft_misses(tmp_path, record, case=2) == {"nvme_write_gb_per_step"}
    nvme = {"losses": [8.0, 7.5], "passed": True}
    full_ft.compare_losses(nvme, {"losses": [8.0, 7.5]})
    assert nvme["passed"] and nvme["loss_max_rel_diff_vs_cpu_offload"] == 0.0
    full_ft.compare_losses(nvme, {"losses": [8.0, 7.4]})
    assert nvme["passed"] is False and "loss_max_rel_diff_vs_cpu_offload" in nvme["error"]


def test_without_libaio_both_nvme_lines_say_so(tmp_path: Path) -> None:
    ctx = context(tmp_path, gpu=False)
    ctx.done["build_ops"] = {"async_io": False}
    for case in full_ft.CASES[1:]:
        line = full_ft.run_full_ft(case, ctx)
        assert line["passed"] is None and line["skipped"].startswith("skipped: no libaio"), line


# --- packed rows ------------------------------------------------------------------------------------------------


def test_a_packed_rows_documents_are_where_its_positions_restart() -> None:
    import torch

    positions = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    assert doc_isolation.segments(positions) == [(0, 3), (3, 5), (5, 6), (6, 10)]


def test_the_isolation_check_passes_a_masked_row_and_sees_a_planted_leak() -> None:
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in (12, 20, 8)])
    found = doc_isolation.compare(model, input_ids, positions, torch.float32)
    assert found["documents"] == 3 and found["isolated"] and found["leak_seen"], found
    # Far apart: the tolerance sits between the two (fp32 here: rounding ~1e-7 of the scale).
    assert found["isolation_error"] < found["tolerance"] < found["planted_leak_error"] / 100, found


@pytest.mark.parametrize("case", consumer.CONSUMERS, ids=lambda c: c.name)
def test_every_consumer_case_trains_on_the_bundled_corpus_alone(case: consumer.Consumer) -> None:
    # The device machine reaches no dataset hub: a recipe's hub train or eval set left in fails at start.
    from llm_train.config.recipe import load_recipe

    data = load_recipe(case.recipe, [*consumer.COMMON, *case.overrides]).data
    paths = [s if isinstance(s, str) else s.path for s in (*data.train, *data.eval)]
    assert paths and all(Path(p).is_file() for p in paths), paths


def test_the_big_speed_variant_is_resized_on_an_80_gb_card_and_says_so() -> None:
    from bench.mfu_matrix import CPU_SIZES, GPU_SIZES, big_micro

    assert big_micro(GPU_SIZES, 139.8) == (8, None)  # the H200 it was sized for
    micro, why = big_micro(GPU_SIZES, 79.1)  # an 80 GB H100, the device tool's default kind
    assert micro == 6 and why is not None and "79 GiB" in why
    assert big_micro(GPU_SIZES, None) == (8, None)  # no probe line: as sized
    assert big_micro(CPU_SIZES, 24.0) == (4, None)  # --cpu-tiny: the script's logic only


# --- the image-text case (bench/vlm.py) ---------------------------------------------------------------------


def test_the_image_text_case_is_planned_to_fit_the_card_it_emulates(tmp_path: Path) -> None:
    """The GPU case's checkpoint (LLaVA-1.5-7B's shape, 336-pixel CLIP: 576 image tokens) under the recipe's
    24 GiB card with the case's overrides: the planner sizes it, says FITS, and counts 576 image tokens."""
    import json

    from bench import vlm
    from bench.estimates import plan

    config = vlm.base_config(gpu=True)
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["LlavaForConditionalGeneration"]})
    )
    planned = plan(vlm.RECIPE, [f"model.name_or_path={tmp_path}", *vlm.OVERRIDES], "RTX 4090", 24, 16)
    assert planned["planner_verdict"] == "FITS", planned
    assert planned["est_image_tokens_per_image"] == (336 // 14) ** 2 == 576
    assert 14 < planned["est_gpu_gib"] < 24
    assert all(case.optional for case in vlm.cases())  # part B's required boxes are unchanged
