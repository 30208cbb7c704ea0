"""The planner's numbers for one configuration on one device, asked as `llm-train plan` is: what a case's
measured numbers are judged against (bench/verdicts.py).
"""

from __future__ import annotations

from typing import Any

from llm_train.units import GiB


def plan(
    recipe: str,
    overrides: list[str],
    gpu: str | None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    nvme: bool = False,
) -> dict[str, Any]:
    """The planner's numbers for one configuration on one device (`gpu` None: this CPU).

    est_gpu_gib includes the CUDA context and allocator slack (compare NVML's device-wide peak);
    est_gpu_allocated_gib leaves them out (compare torch's max_memory_allocated); est_host_train_gib is
    the host peak of the load and training phases (the processes included), without the final export.
    """
    from llm_train.errors import UserError
    from llm_train.planning.memory.host import host_peak_bytes
    from llm_train.planning.report.verdict import plan_recipe

    try:
        report = plan_recipe(
            recipe,
            overrides,
            gpus=1,
            gpu=gpu,
            gpu_mem_gib=gpu_mem_gib,
            host_ram_gib=host_ram_gib,
            detect=False,
            nvme_gib=10_000 if nvme else None,  # the drive's space is checked by the run itself
        )
    except UserError as exc:
        return {"planner_error": str(exc)}
    ev = report.evaluation
    est = ev.estimate
    allocated = sum(v for k, v in est.gpu_terms.items() if k != "cuda_context_and_slack")
    # The export copy left out: what the host holds until the steps are logged (planning/memory/estimate.py).
    train = host_peak_bytes(ev.inputs, {**est.host_terms, "export_peak": 0}, 0.0)
    return {
        "config": report.config_line,
        "planner_verdict": report.word,
        "fits": ev.fits,
        "est_gpu_gib": ev.device_bytes / GiB,
        "est_gpu_allocated_gib": allocated / GiB if gpu else None,
        "est_host_gib": ev.host_bytes / GiB,
        "est_host_train_gib": (train + ev.host_bytes - est.host_bytes) / GiB,
        "est_locked_gib": est.locked_per_rank / GiB,
        "est_step_time_s": ev.time.total,
        "est_tokens_per_s": ev.time.tokens_per_s,
        "est_nvme_read_gb_per_step": ev.time.nvme_read_bytes / 1e9,
        "est_nvme_write_gb_per_step": ev.time.nvme_write_bytes / 1e9,
        # objective grpo: the generate call's seconds (a rough model until measured, planning/memory/generation.py)
        "est_time_generate_s": ev.time.generation_call.total if ev.time.generation_call else None,
        # an image-text model's image rows: the planner's image tokens per image (planning/model/vision_shapes.py)
        "est_image_tokens_per_image": _image_tokens(ev.inputs),
    }


def _image_tokens(inp: Any) -> int | None:
    vision = inp.shape.vision
    if vision is None or not inp.vision.images_per_sample:
        return None
    return int(inp.vision.geometry(vision).max_tokens)
