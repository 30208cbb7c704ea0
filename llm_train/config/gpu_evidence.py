"""Which parts of a CUDA run have ever run on a GPU, and which never have: the dry run and the start say so.

Everything llm_train does is tested on CPU (gloo, bf16, bitsandbytes' CPU backend); a GPU changes the
kernels, NCCL and memory, so a part that has only run on CPU is a part whose first GPU run is the user's.
A run whose parts are not all in `RAN_ON_GPU` gets one line, in `--dry-run` and at the start, naming the
parts that have not, so a user knows which road is untrodden before spending hours on it.

`RAN_ON_GPU` lists what a GPU check in bench/results/ ran and passed, each part with the result file that
shows it. It grows only with such a file (bench/gpu_run.sh on a lent GPU); a part is never listed on the
strength of its CPU tests. `FAILED_ON_GPU` lists the combinations of parts a GPU check ran and saw fail,
with what it saw, until a later check passes them: a run made of them says so in a second line. Decided
from the resolved recipe and layout alone (config/ never imports torch).
"""

from __future__ import annotations

from llm_train.config.layout import Layout
from llm_train.config.recipe import Recipe

# The first GPU check: one H200, world of one, bf16, a ~100M and a 1B-shaped Llama with random weights, full
# fine-tune, sdpa on packed rows; ZeRO-0, 2, 3 and 3 with the optimizer and parameters on the host (CPU
# Adam), each ZeRO-2/3 case taking a checkpoint, stopping on SIGTERM, resuming and exporting a verified final/.
H200_2026_11_30 = "bench/results/gpu_check-h200-20261130-1904.jsonl"

# bench/gpu_run.sh A on one H100 80 GB: the speed matrix of a 1B-shaped Llama (ZeRO-2, bf16, seq 4096, world
# of one) with attention auto (-> sdpa_flex on packed rows with document boundaries) and Liger's kernels.
H100_2026_12_06 = "bench/results/gpu_run_A-h100-20261206-0955.jsonl"

# part -> (result file, the measurement in it that ran the part and passed)
RAN_ON_GPU: dict[str, tuple[str, str]] = {
    "ZeRO-0": (H200_2026_11_30, "c_zero0"),
    "ZeRO-2": (H200_2026_11_30, "a_zero2"),
    "ZeRO-3": (H200_2026_11_30, "a_zero3"),
    "optimizer offload to CPU": (H200_2026_11_30, "a_zero3_offload"),
    "parameter offload to CPU": (H200_2026_11_30, "a_zero3_offload"),
    "bf16": (H200_2026_11_30, "a_zero2"),
    "attention sdpa": (H200_2026_11_30, "b_mfu_zero2"),
    "objective lm": (H200_2026_11_30, "a_zero2"),
    "attention sdpa_flex": (H100_2026_12_06, "document_aware"),
    "Liger kernels": (H100_2026_12_06, "liger"),
}

# (parts that failed together, result file, the measurement that failed, what it saw)
FAILED_ON_GPU: list[tuple[frozenset[str], str, str, str]] = [
    (
        frozenset({"Liger kernels", "torch.compile (layers)"}),
        H100_2026_12_06,
        "liger_compile",
        # Liger alone passed (measurement `liger`), the compiled layers were the only change; the cause is
        # not isolated (kernels-community marks Liger's RMSNorm as not compile-friendly).
        "gradient norm inf at step 2, non-finite loss at step 3 (one H100, 2026-12-06)",
    ),
]


OFFLOAD_NAMES = {"cpu": "CPU", "nvme": "NVMe"}


def run_parts(recipe: Recipe, layout: Layout) -> list[str]:
    """The parts of this run a GPU could prove or break, in the order a reader thinks of them."""
    parts = [f"ZeRO-{layout.zero_stage}"]
    for what, where in (("optimizer", layout.offload_optimizer), ("parameter", layout.offload_params)):
        if where != "none":
            parts.append(f"{what} offload to {OFFLOAD_NAMES.get(where, where)}")
    parts.append(layout.precision)
    parts.append(f"attention {recipe.memory.attention}")
    parts.append(f"objective {recipe.objective}")
    if recipe.lora is not None:
        parts.append(
            "LoRA adapters" if recipe.lora.quantize == "none" else f"QLoRA {recipe.lora.quantize} base"
        )
    if recipe.optim.name != "adamw":
        parts.append(f"optimizer {recipe.optim.name}")
    if recipe.optim.state_dtype != "fp32":
        parts.append(f"{recipe.optim.state_dtype} optimizer states")
    for degree, name in ((layout.tp, "tensor"), (layout.pp, "pipeline"), (layout.sp, "sequence")):
        if degree > 1:
            parts.append(f"{name} parallelism")
    if layout.world_size > 1:
        parts.append("more than one GPU (NCCL)")
    if recipe.hardware.nodes > 1:
        parts.append("more than one node")
    memory = recipe.memory
    switches = (
        ("activation checkpointing", memory.activation_checkpointing),
        ("Liger kernels", memory.liger_kernels),
        (f"torch.compile ({memory.torch_compile})", memory.torch_compile != "off"),
        ("tiled MLP", memory.tiled_mlp),
        ("tiled loss", memory.tiled_loss),
        ("checkpoint offload", memory.offload_checkpoints),
    )
    parts += [name for name, on in switches if on]
    return parts


def unverified_on_gpu(recipe: Recipe, layout: Layout) -> list[str]:
    """The parts of a CUDA run that no GPU check has run yet (none on CPU: the suite runs every part there)."""
    if layout.device == "cpu":
        return []
    return [part for part in run_parts(recipe, layout) if part not in RAN_ON_GPU]


def failed_line(recipe: Recipe, layout: Layout) -> str | None:
    """One line for the dry run and the start-up summary when this CUDA run holds parts a GPU check saw fail
    together, or None."""
    if layout.device == "cpu":
        return None
    parts = set(run_parts(recipe, layout))
    seen = [(both, saw) for both, _, _, saw in FAILED_ON_GPU if both <= parts]
    if not seen:
        return None
    return "; ".join(
        f"{' with '.join(sorted(both))} failed llm_train's GPU check: {saw}; turn one off if your run does too"
        for both, saw in seen
    )


def unverified_line(recipe: Recipe, layout: Layout) -> str | None:
    """One line for the dry run and the start-up summary, or None when every part has run on a GPU."""
    parts = unverified_on_gpu(recipe, layout)
    if not parts:
        return None
    return (
        f"not yet run on a GPU by llm_train's own checks (tested on CPU only): {', '.join(parts)}; "
        "try a short run first (optim.max_steps=20)"
    )


def evidence_lines(recipe: Recipe, layout: Layout) -> list[tuple[str, str]]:
    """(label, line) for the dry run and the start-up summary: the parts no GPU check has run, and the
    combinations one saw fail; empty when there is nothing to say."""
    lines = (("unverified", unverified_line(recipe, layout)), ("failed", failed_line(recipe, layout)))
    return [(label, line) for label, line in lines if line]
