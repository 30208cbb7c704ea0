"""The consumer-card cases: 8B LoRA and QLoRA recipes on one big GPU, capped to the cards they are written for.

Each case runs its recipe through bench/capped_train.py, which caps the training process's CUDA
allocator at the recipe's card (hardware.gpu_mem_gib) and makes it see the recipe's desktop RAM
(hardware.host_ram_gib), so every decision the run takes is the one it takes there (the export's
verification reloads final/ only where the RAM holds it). The settings are torchtune's published
single-card ones (issue 33; its README: Llama-3.1-8B on an RTX 4090, 2048-token packed rows, micro-batch
2, activation checkpointing), the attention as the recipes ship it (`auto`):

    qlora_12   8b-qlora-rtx4070, NF4 base, r=8 on attention and MLP, under a 12 GiB cap, to the end:
               training, the merged 16-bit export written shard by shard, its verification
    lora_24    8b-lora-rtx4090, 16-bit base, r=8 on q and v, under a 24 GiB cap, to the end
    qlora_64k  8b-qlora-64k-rtx4090 (long context on one 24 GiB card) under its cap, stopped after its
               steps; a line "skipped: ..." while that recipe is not in recipes/
    grpo_24    8b-grpo-lora-rtx4090 (online RL on one 24 GiB card) under its cap on the bundled prompts
               with a digit format reward, stopped after its steps: generation's and training's tokens/s
               apart (the step's time split, metrics.jsonl), the peaks; optional (the part's time left)

The base is a randomly initialised Llama-3.1-8B-shaped model written with save_pretrained (5 GB shards,
as the hub's) by a first case (`base`), so every run loads a checkpoint the way a user's does:
bitsandbytes quantises as it loads, 16-bit weights go straight to the GPU. It is removed after the
last case (a 64 GiB disk holds it and one export). Data: the bundled corpus as text.

Per case: tokens/s, the GPU peak two ways (NVML's device-wide used memory above the idle device, CUDA
context included, and the allocator's max allocated from metrics.jsonl), the host peak (the process
tree's PSS) of the load and training phases and of the export. Verdicts: each GPU number within +-15%
of the planner's matching estimate; the device-wide peak at most the real card's memory (the cap bounds
only the allocator); the training-phase host peak within +-15% of the planner's; the export's host peak
at most the planner's total; the export verified. Under --cpu-tiny (the tiny-cpu shape, fp32, 128
tokens) the planner's numbers mean nothing: the comparisons are recorded, not judged; the steps and the
export's verification are judged everywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cases import Case, Context
from bench.environment import ASSETS, CORPUS, REPO, TOKENIZER, capped_train, module_cmd
from bench.estimates import plan
from bench.launch import launch
from bench.verdicts import judge, verdict
from bench.watch import median, metrics_rows, peak
from llm_train.units import GiB

BASE_SHAPE = "meta-llama/Llama-3.1-8B"
LONG_RECIPE = "8b-qlora-64k-rtx4090"  # issue 33's long-context recipe (branch "lean" creates it)
STEPS = 4
CPU_STEPS = 2  # --cpu-tiny: the first step (left out of the medians) and one more
# torchtune's single-card settings (issue 33): 2 x 2048 tokens per micro-batch, activation checkpointing.
TORCHTUNE = (
    "data.seq_len=2048",
    "optim.micro_batch_size=2",
    "memory.activation_checkpointing=true",
    "lora.rank=8",
    "lora.alpha=16",
)
COMMON = (  # the recipes' hub datasets are not on that machine: the bundled corpus, a few steps
    f"data.train=[{CORPUS}]", "data.eval=[]", "data.max_epochs=1000", "data.eval_fraction=0", "eval.every=0",
    "optim.warmup_steps=0", "output.log_every=1", "output.sample_prompt=null", "tracking.mode=disabled",
    "checkpoint.at_end=false",
)  # fmt: skip
CPU_TINY = ("data.seq_len=128", "precision=fp32")
# GRPO on the bundled prompts (the hub's GSM8K is not on that machine) with a reward every completion gets.
# A step is one prompt's group (8 completions: micro 4 x accum 2), not the recipe's four: a GRPO step cannot
# be one micro-batch (its completions come in whole groups), and one group per step keeps the case short.
GRPO_DATA = (
    f"data.train=[{{path: '{ASSETS / 'prompts.jsonl'}', format: prompt}}]",
    "grpo.rewards=[{kind: format, name: has_digit, pattern: '\\d', match: search}]",
    "optim.grad_accum=2",
)


@dataclass(frozen=True)
class Consumer:
    name: str
    recipe: str
    overrides: tuple[str, ...]
    finish: bool  # run to the end (export + verification), or stop once the steps are logged
    steps: int = STEPS
    on_gpu: tuple[
        str, ...
    ] = ()  # only on the GPU: --cpu-tiny runs CPU_TINY instead (flex cannot train on CPU)
    on_cpu: tuple[str, ...] = ()  # only under --cpu-tiny, after CPU_TINY
    optional: bool = False  # run only while the part's time left holds its cost
    base: str = "consumer_base"  # the work folder of the checkpoint it loads (bench/vlm.py writes its own)


# The attention kernel is pinned to what the emulated card runs, so the plan (made for that card) and the
# run on the H200 (whose auto would take sdpa_flex) use the same one: sdpa on an RTX 40 card without
# flash-attn (config/attention_kernel.py: flex's backward at head_dim 128 does not fit its shared memory);
# for the 64k recipe, which needs flash-attn's varlen kernel on such a card (its header), sdpa_flex stands in
# for it (flash-attn is not on that machine; both compute only each document's causal blocks).
ON_RTX_40 = ("memory.attention=sdpa",)
CONSUMERS = (
    Consumer(
        "qlora_12", "8b-qlora-rtx4070", TORCHTUNE, finish=True, on_gpu=ON_RTX_40
    ),  # 7 targets: attn + MLP
    Consumer(
        "lora_24",
        "8b-lora-rtx4090",
        (*TORCHTUNE, "lora.target_modules=[q_proj,v_proj]"),
        finish=True,
        on_gpu=ON_RTX_40,
    ),
    Consumer("qlora_64k", LONG_RECIPE, (), finish=False, steps=2, on_gpu=("memory.attention=sdpa_flex",)),
    Consumer(
        "grpo_24",
        "8b-grpo-lora-rtx4090",
        GRPO_DATA,
        finish=False,
        steps=3,
        on_gpu=ON_RTX_40,
        on_cpu=("grpo.max_completion_length=16",),  # prompt + completion within CPU_TINY's 128 tokens
        optional=True,
    ),
)


def base_dir(ctx: Context, name: str = "consumer_base") -> Path:
    return ctx.work / name  # not the case's name: run_cases removes that folder after it


def make_base(out: Path, gpu: bool) -> None:
    """A random model of the consumer recipes' shape, saved as the hub's checkpoints are (its own process)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llm_train.config.recipe import load_recipe
    from llm_train.planning.model.shapes import to_hf_config

    fields = dict(to_hf_config(BASE_SHAPE)) if gpu else dict(load_recipe("tiny-cpu").model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):  # drawn on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(out, max_shard_size="5GB")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out)


def base_case(ctx: Context) -> dict[str, Any]:
    out = base_dir(ctx)
    cmd = module_cmd("bench.consumer", "--make-base", str(out), *([] if ctx.gpu else ["--cpu-tiny"]))
    run = launch(cmd, ctx.timeout(), ctx.work / "base.log")
    ctx.results.log_launch("base", run)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / GiB if out.is_dir() else 0.0
    record: dict[str, Any] = {"shape": BASE_SHAPE if ctx.gpu else "tiny-cpu", "base_gib": size}
    record.update(wall_s=run.wall_s, passed=run.rc == 0 and size > 0)
    if not record["passed"]:
        record.update(error=f"{run.ended} writing the base", tail=run.tail)
    return record


def hardware(recipe: str) -> dict[str, Any]:
    """The card and desktop a recipe is written for (its hardware section), and the card's real memory."""
    from llm_train.config.hardware import find_gpu
    from llm_train.config.recipe import load_recipe

    hw = load_recipe(recipe).hardware
    spec = find_gpu(hw.gpu_name) if hw.gpu_name else None
    return {
        "card": hw.gpu_name,
        "gpu_cap_gib": hw.gpu_mem_gib,
        "card_memory_gib": spec.memory_gib if spec else hw.gpu_mem_gib,
        "host_ram_gib": hw.host_ram_gib,
    }


def one_micro_batch_per_step(recipe: str, overrides: list[str]) -> str:
    """The override that makes a step one micro-batch: memory is per micro-batch, and the recipes'
    accumulation (16 micro-batches of 64k tokens for the long-context one) would only multiply the time."""
    from llm_train.config.recipe import load_recipe

    optim = load_recipe(recipe, overrides).optim
    if optim.grad_accum is not None:
        return "optim.grad_accum=1"
    return f"optim.global_batch_size={optim.micro_batch_size}"


def consumer_case(case: Consumer) -> Case:
    def run(ctx: Context) -> dict[str, Any]:
        return run_consumer(case, ctx)

    # grpo_24: the 8B base loaded as lora_24's (~15 s), then per step one generate call (8 completions of up
    # to 256 tokens: ~29 ms per decode step bound by eager launches, the planner's rough model: ~8 s) and the
    # training of its two micro-batches (~3 s); 3 steps and the start-up.
    # vlm_lora_24 (bench/vlm.py): the 14 GB LLaVA base loaded (~15 s), the bundled rows through the processor,
    # three steps of two 640-token rows with 576 image tokens each; assumed, not measured.
    costs = {"qlora_12": (110, 150), "lora_24": (90, 120), "qlora_64k": (100, 130), "grpo_24": (75, 130)}
    cost, box = {**costs, "vlm_lora_24": (70, 110)}[case.name]
    # The base goes after the last case that reads it.
    last = case.name == CONSUMERS[-1].name or case.base != "consumer_base"
    return Case(
        case.name,
        run,
        cost_s=cost,
        box_s=box,
        optional=case.optional,
        cleanup=(case.base,) if last else (),
    )


def run_consumer(case: Consumer, ctx: Context) -> dict[str, Any]:
    if not (REPO / "recipes" / f"{case.recipe}.yaml").is_file():
        return {
            "recipe": case.recipe,
            "passed": None,
            "skipped": f"recipe {case.recipe} is not in recipes/ yet",
        }
    hw = hardware(case.recipe)
    overrides = [
        f"model.name_or_path={base_dir(ctx, case.base)}",
        *COMMON,
        *case.overrides,
        *(case.on_gpu if ctx.gpu else (*CPU_TINY, *case.on_cpu)),
    ]
    if not any(o.startswith("optim.grad_accum=") for o in case.overrides):  # the case sizes its own step
        overrides.append(one_micro_batch_per_step(case.recipe, overrides))
    record: dict[str, Any] = {
        "measurement": case.name,
        "recipe": case.recipe,
        **hw,
        "finish": case.finish,
        "overrides": [*case.overrides, *(case.on_gpu if ctx.gpu else ())],
    }
    card, cap = (hw["card"], hw["gpu_cap_gib"]) if ctx.gpu else (None, None)  # CPU: the planner's CPU numbers
    record.update(plan(case.recipe, overrides, card, cap, hw["host_ram_gib"]))
    run_dir = ctx.work / case.name
    steps = case.steps if ctx.gpu else min(case.steps, CPU_STEPS)
    cmd = [
        *capped_train(hw["gpu_cap_gib"] or 24.0, hw["host_ram_gib"]),
        *("--recipe", case.recipe, "--output-dir", str(run_dir)),
        f"--max-steps={steps if case.finish else steps + 2}",  # a stopped run is killed mid-step, never in its export
        *overrides,
    ]

    def steps_done() -> bool:
        return len(metrics_rows(run_dir)) >= steps

    run = launch(
        cmd,
        ctx.timeout(),
        ctx.work / f"{case.name}.log",
        kill_when=None if case.finish else steps_done,
        second_phase_when=steps_done if case.finish else None,
        gpu=ctx.gpu,
    )
    ctx.results.log_launch(case.name, run)
    rows = metrics_rows(run_dir)[:steps]
    verified = next((line for line in run.output.splitlines() if line.startswith("exported ")), None)
    export_peak = re.search(r"export: merged shard by shard, host peak ([\d.]+) GiB", run.output)
    record.update(
        steps=len(rows),
        tokens_per_s=median(rows[1:] or rows, "tokens_per_s"),  # the first step compiles and warms up
        step_time_s=median(rows[1:] or rows, "step_time_s"),
        first_losses=[r["loss"] for r in rows],
        gpu_mem_peak_gib=peak(rows, "gpu_mem_peak_gib"),  # the allocator's max allocated
        gpu_mem_reserved_peak_gib=peak(rows, "gpu_mem_reserved_gib"),
        gpu_device_used_peak_gib=run.gpu_used_delta_gib,  # NVML, the whole device above its idle use
        host_pss_train_peak_gib=run.first_phase_host_pss_peak_gib,  # load + training
        host_pss_peak_gib=run.host_pss_peak_gib,
        export_host_pss_peak_gib=run.second_phase_host_pss_peak_gib,
        export_reported_host_peak_gib=float(export_peak.group(1)) if export_peak else None,
        export_verified=verified,
        wall_s=run.wall_s,
        rc=run.rc,
        notes=[line for line in run.output.splitlines() if line.startswith("capped_train:")],
    )
    if rows and "generation_tokens_per_s" in rows[0]:
        record.update(generation_split(rows[1:] or rows))
        # Which engine wrote the completions (runtime/rl/: generate, or continuous batching when the case's
        # overrides set grpo.use_transformers_continuous_batching): the tokens/s above are that engine's.
        batching = "grpo.use_transformers_continuous_batching=true" in overrides
        record["generation_engine"] = "continuous batching" if batching else "generate"
        # Recorded, not judged: the planner's generation time is a rough model this line is there to measure.
        if record.get("est_time_generate_s") and record["time_generate_s"]:
            record["time_generate_over_estimate"] = record["time_generate_s"] / record["est_time_generate_s"]
    ended_ok = run.rc == 0 if case.finish else len(rows) >= steps
    if run.timed_out or not ended_ok:
        record.update(error=run.failure(len(rows), steps), tail=run.tail)
    record["passed"] = "error" not in record
    return judge_consumer(record, ctx)


def generation_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A GRPO run's step apart (runtime/rl/grpo.py's metrics): generation's tokens/s and share of the step, and
    training's tokens/s over the rest of the step (its forward, backward and update), medians over steps."""

    def training_tokens_per_s(r: dict[str, Any]) -> float:
        training_s = r["step_time_s"] - r["time_generate_s"] - r["time_score_s"]
        return r["tokens_per_s"] * r["step_time_s"] / training_s  # the step's tokens over its training time

    return {
        "generation_tokens_per_s": median(rows, "generation_tokens_per_s"),
        "training_tokens_per_s": statistics.median(training_tokens_per_s(r) for r in rows),
        "time_generate_s": median(rows, "time_generate_s"),
        "time_score_s": median(rows, "time_score_s"),
        "generation_share": statistics.median(r["time_generate_s"] / r["step_time_s"] for r in rows),
        "completion_length_mean": median(rows, "completions/mean_length"),  # TRL's name since issue 51
    }


def judge_consumer(record: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The case's verdicts (module docstring): the planner's against the GPU's, enforced on a GPU."""

    name, against = record["measurement"], ctx.judging.against
    verdicts = [
        against(
            name, "gpu_device_used_peak_gib", record["gpu_device_used_peak_gib"], record.get("est_gpu_gib")
        ),
        against(name, "gpu_mem_peak_gib", record["gpu_mem_peak_gib"], record.get("est_gpu_allocated_gib")),
        # The cap bounds the allocator only: the context and kernels on top must fit the real card too.
        against(
            name,
            "gpu_device_used_peak_gib_on_the_card",
            record["gpu_device_used_peak_gib"],
            target=record["card_memory_gib"],
            higher_is_better=False,
        ),
        against(
            name,
            "host_pss_train_peak_gib",
            record["host_pss_train_peak_gib"],
            record.get("est_host_train_gib"),
        ),
    ]
    if record["finish"]:
        verdicts.append(
            against(
                name,
                "export_host_pss_peak_gib",
                record["export_host_pss_peak_gib"],
                target=record.get("est_host_gib"),
                higher_is_better=False,
            )
        )
        # Judged everywhere: an export that does not verify is broken on any machine.
        verdicts.append(verdict("export_verified", 1.0 if record["export_verified"] else 0.0, target=1.0))
    return judge(record, verdicts)


# The staged QLoRA load (bench/qlora_staged_load.py): Llama-3.1-8B's shape on the GPU, a tiny one on CPU.
STAGED_LOAD_GPU = ("--layers", "32", "--hidden", "4096", "--intermediate", "14336", "--vocab", "128256")
STAGED_LOAD_CPU = ("--layers", "2", "--hidden", "256", "--intermediate", "512", "--vocab", "1024")


def staged_load(ctx: Context) -> dict[str, Any]:
    """The 4-bit base of a ZeRO-3 QLoRA run, loaded as the run loads it (runtime/model/quantized_base.py `quantizing_on`):
    each weight quantised on the GPU, its codes back to the host. On the GPU: the allocator's peak during the
    load and the state left there, each within +-15% of the planner's (quantized.staged_quantize_gpu_bytes,
    quantization_state_bytes); the host's anonymous peak against the planner's `model_load_peak` for one
    rank (its freed-temporaries term is the CPU path's, an upper bound this line measures); the codes on the
    host, the state on the GPU; the load's weights/s, at least 10x bitsandbytes' CPU quantiser's (what made
    the 70B recipe's start-up hours). Its time against the planner's is recorded, not judged: the planner
    reads the checkpoint from a drive, here it was just written and is in the page cache."""
    from llm_train.planning.speed.step_time import CPU_QUANTIZE_WEIGHTS_PER_S

    out = ctx.work / "qlora_staged_load"
    staging = ("--staging", "cuda", *STAGED_LOAD_GPU) if ctx.gpu else ("--staging", "cpu", *STAGED_LOAD_CPU)
    run = launch(
        module_cmd("bench.qlora_staged_load", *staging, "--out", str(out)),
        ctx.timeout(),
        ctx.work / "qlora_staged_load.log",
    )
    ctx.results.log_launch("qlora_staged_load", run)
    path = out / "qlora-staged-load.json"
    if run.rc != 0 or not path.is_file():
        failed = run.ended
        return {"passed": False, "error": f"{failed} before its result", "tail": run.tail}
    found = json.loads(path.read_text())
    record: dict[str, Any] = {
        key: found[key]
        for key in (
            "model", "staging", "quantized_weights", "base_written_s", "load_seconds", "quantize_weights_per_s",
            "planned_load_seconds", "codes_on", "state_on", "anonymous_rss_peak_added_bytes",
            "planned_model_load_peak_bytes", "gpu_allocated_peak_bytes", "planned_gpu_load_peak_bytes",
            "gpu_allocated_after_bytes", "planned_gpu_state_bytes",
        )
    }  # fmt: skip
    record["passed"] = True
    name, against = "qlora_staged_load", ctx.judging.against
    verdicts = [
        against(
            name,
            "host_anonymous_peak_gib",
            found["anonymous_rss_peak_added_bytes"] / GiB,
            found["planned_model_load_peak_bytes"] / GiB,
        ),
        verdict("codes_on_the_host", 1.0 if found["codes_on"] == ["cpu"] else 0.0, target=1.0),
    ]
    if ctx.gpu:
        verdicts += [
            against(
                name,
                "gpu_load_allocated_peak_gib",
                found["gpu_allocated_peak_bytes"] / GiB,
                found["planned_gpu_load_peak_bytes"] / GiB,
            ),
            against(
                name,
                "gpu_state_after_load_gib",
                found["gpu_allocated_after_bytes"] / GiB,
                found["planned_gpu_state_bytes"] / GiB,
            ),
            verdict("state_on_the_gpu", 1.0 if found["state_on"] == ["cuda"] else 0.0, target=1.0),
            verdict(
                "quantize_weights_per_s",
                found["quantize_weights_per_s"],
                target=10 * CPU_QUANTIZE_WEIGHTS_PER_S,
            ),
            verdict(
                "load_seconds",
                found["load_seconds"],
                found["planned_load_seconds"],
                judged=False,
                why_not_judged="the planner reads the checkpoint from a drive; here it is in the page cache",
            ),
        ]
    return judge(record, verdicts)


def staged_load_case() -> Case:
    # On the GPU: writing the 16 GB base (drawn on the GPU, ~15-25 s at the disk's speed), a fresh
    # interpreter importing transformers and bitsandbytes (~10 s), the load (~10-20 s). Assumed, not measured.
    return Case("qlora_staged_load", staged_load, cost_s=75, box_s=150, optional=True, cpu_box_s=300)


def cases() -> list[Case]:
    """The consumer section: the base, then the cases in order of value."""
    return [Case("base", base_case, cost_s=50, box_s=75), *(consumer_case(c) for c in CONSUMERS)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write the consumer cases' random base (a case's own process)."
    )
    parser.add_argument("--make-base", type=Path, required=True)
    parser.add_argument("--cpu-tiny", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    make_base(args.make_base, gpu=not args.cpu_tiny)
    print(f"consumer: base written to {args.make_base} in {time.perf_counter() - started:.1f}s", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
