"""MFU and tokens/s of llm_train's speed switches on one GPU, against the Hugging Face Trainer on the same job.

One prepared run of at most 8 minutes (its own deadline, --budget-s): one process per variant, the
most important first, one JSON line each in OUT/mfu_matrix.jsonl the moment it is known (a kill
leaves what was done), then OUT/mfu_matrix_summary.json; OUT/mfu_matrix.log holds each launch's
command and output tail. The job is gpu_check's MFU shape: a Llama-3.2-1B-shaped model (random
init), bf16, seq 4096, ZeRO-2 (ds_configs/zero2.json), micro-batch 4, one GPU.

Data, generated here (no download), token ids drawn uniformly from the bundled tokenizer's 4,096:
- `mix`: documents with log-normal lengths (median 600, sigma 1: mean ~990 tokens, a long tail, like
  web text), the longer ones split at seq_len, packed by llm_train (best-fit decreasing, position ids
  restarting per sample): ~4 documents per row;
- `full`: documents of exactly seq_len tokens: every row one sequence, no boundary.

Variants, in this order (`VARIANTS`):
  baseline        mix,  memory.attention=sdpa: the dense [b,1,s,s] mask (the first H200 run's setup)
  document_aware  mix,  memory.attention=auto (flash_attention_2 where installed, else sdpa_flex)
  hf_trainer      mix,  transformers.Trainer on the same rows, init, DS JSON and batch (bench/hf_trainer_peer.py)
  liger           mix,  + memory.liger_kernels=true
  liger_compile   mix,  + memory.torch_compile=layers (regional: each decoder layer compiled in place)
  best_micro8     mix,  the fastest exact variant above at micro-batch 8
  full_baseline   full, memory.attention=sdpa (is_causal: no mask to build)
  full_best       full, the fastest exact combination
  compile_model   mix,  document_aware + liger + memory.torch_compile=model (whole model), if time is
                        left (optional: a deadline that leaves none fails nothing)

Each line: predicted step time (written in the `predictions` line before anything runs, and repeated),
step time and tokens/s (medians after the warm-up steps), `mfu` (attention over the documents the
rows really hold) and `mfu_seq_len` (over the whole row, as most tools count), the attention span,
the GPU's peak, the kernel the run used, `compile_s` (first step minus a steady one: flex, Liger's
Triton and torch.compile graphs), the first losses, and `checks`:
- `ran`: all steps logged;
- `exact`: the first LOSS_STEPS losses equal the baseline's on the same data within LOSS_RTOL (the
  same rows, the same initial weights). With random weights and tokens this catches a broken kernel
  (NaN, a wrong loss scale, lost tokens), not a subtle mask leak; the masks themselves are proven on
  CPU (tests/unit/test_attention.py). Not checked at another micro-batch (other rows per step).
- `peak_not_above_baseline`: at the baseline's micro-batch, GPU peak <= baseline's + PEAK_SLACK.
Then two target lines: `target_mfu` (the best exact variant's document-aware MFU >= 45%) and
`target_vs_hf_trainer` (the best exact variant at the Trainer's batch, tokens/s >= 1.3x the Trainer's,
measured in this run). Neither target is checked by a timed test: they live here. A miss is a failed line; the exit code is 1 when any line failed (a variant the
deadline left no time for is a failed "not run" line), 0 otherwise.

`--cpu-tiny` runs the same script end to end on CPU with the tiny-cpu model (seq 128, micro 2, a
nominal --peak-tflops): CUDA-only switches (Liger) are dropped from the variants that name them, a
variant that is then the same as an earlier one is skipped, and flex kernels are not chosen (auto ->
sdpa on CPU); it trains in fp32 and leaves out compile_model (CPU_SIZES says why). Its numbers say
nothing about a GPU, and its MFU target line fails by construction.

    WHEELS=.whl OUT=$OUT bash bench/mfu_matrix.sh   # on the GPU machine (bench/gpu_env.sh: the wheels)
    bash bench/mfu_matrix.sh --cpu-tiny --out DIR    # here (tests/e2e/test_mfu_matrix.py)
"""

from __future__ import annotations

import json
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, check_arguments, require_cuda, versions  # bench/ is this script's folder
from gpu_check import (
    RUNNING,
    Budget,
    Results,
    _on_stop_signal,
    launch,
    median,
    metrics_rows,
    peak,
    round_floats,
)

TRAIN = REPO / "llm_train" / "train.py"
PEER = REPO / "bench" / "hf_trainer_peer.py"
DS_CONFIG = REPO / "ds_configs" / "zero2.json"
MFU_TARGET = 0.45
PEER_RATIO_TARGET = 1.3
# bf16 weights and activations round at 2^-8 relative; kernels that add in another order (flex vs.
# flash, Liger's chunked cross-entropy, inductor's fusions) move a mean loss of ~11 by ~1e-3
# relative at the first step, and two small updates (constant lr, Adam) keep it there. 1% is ten
# times that, and far below what a broken kernel does (NaN, a loss off by a constant factor).
LOSS_RTOL = 0.01
LOSS_STEPS = 3
# Two runs of the same job on the first H200 reached the same allocator peak within 1e-4 GiB
# (bench/results/gpu_check-h200-20261130-1904.jsonl, b_mfu_zero2 and c_zero0): 0.5% covers block rounding.
PEAK_SLACK = 0.005
MIX_MEDIAN_FRACTION = 600 / 4096  # log-normal median of the mix's document lengths, as a fraction of seq_len
MIX_SIGMA = 1.0
MIN_TIME_S = 30.0  # less than this left of the budget: the variant is reported as not run

COMMON = [
    "output.log_every=1",
    "eval.every=0",
    "data.eval_fraction=0",
    "output.sample_prompt=null",
    "tracking.mode=disabled",
    "checkpoint.at_end=false",
    "data.max_epochs=1000",  # a speed probe of a few steps over generated rows, not a fine-tune
    "optim.grad_accum=1",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.weight_decay=0.0",
]
GPU_MODEL = [
    "hardware.device=cuda",
    "model.init=random",
    "model.name_or_path=meta-llama/Llama-3.2-1B",  # shape known offline; the bundled tokenizer stays
    "model.config={}",
    "optim.lr=1e-4",
]
CPU_MODEL = ["optim.lr=1e-3"]  # tiny-cpu's own model


@dataclass(frozen=True)
class Sizes:
    gpu: bool
    model: list[str]
    seq_len: int
    micro: int
    big_micro: int
    steps: int
    warmup: int  # steps left out of the medians: allocator warm-up, compilation, autotuning
    documents: int  # per data set: enough rows for the longest variant, with room
    timeout_s: float  # per variant
    budget_s: float
    extra_args: list[str]
    predictions: dict[str, float | None]
    precision: str = "bf16"
    skip: dict[str, str] = field(default_factory=dict)  # variants this size does not run, and why


# Predicted step times on one H200 (seconds), written before the first GPU run of this script. Basis:
# the first H200 run's 0.453 s for this job with sdpa on packed rows (30.1% MFU at seq_len); ~150 ms of
# it attributed to the dense-mask attention (the whole 4096^2 square, K/V repeated to 32 heads), the
# other ~0.30 s to the weights' matmuls, the fp32 logits and loss, and the optimizer.
# - document_aware: the mix spans ~1.5k tokens per document (sum n^2 / sum n), so flex computes ~1/5 of
#   the causal half: ~15 ms of attention and the block mask -> 0.32 s.
# - hf_trainer: the same dense-mask sdpa as the baseline, plus the Trainer's own per-step work -> 0.46 s.
# - liger: the 2.1e9 fp32 logits and their cross-entropy (~8 GiB each way) and the unfused RMSNorm /
#   SwiGLU / RoPE traffic -> -10%: 0.29 s. liger_compile: inductor fuses the rest of each layer's
#   elementwise work -> -4%: 0.28 s (45.6% document-aware MFU: just over the target).
# - best_micro8: twice the tokens, slightly fuller matmuls -> 0.55 s.
# - full rows: sdpa is_causal over the whole row (805 MFLOP per token of attention at T=4096, on
#   flash/cuDNN at ~60% of peak: ~22 ms) -> 0.33 s; with Liger and compile -> 0.29 s.
# - compile_model: like liger_compile, with a longer compile -> 0.28 s.
GPU_PREDICTIONS: dict[str, float | None] = {
    "baseline": 0.45,
    "document_aware": 0.32,
    "hf_trainer": 0.46,
    "liger": 0.29,
    "liger_compile": 0.28,
    "best_micro8": 0.55,
    "full_baseline": 0.33,
    "full_best": 0.29,
    "compile_model": 0.28,
}

GPU_SIZES = Sizes(
    gpu=True,
    model=GPU_MODEL,
    seq_len=4096,
    micro=4,
    big_micro=8,
    steps=12,
    warmup=4,
    documents=600,
    timeout_s=150,
    budget_s=480,
    extra_args=[],
    predictions=GPU_PREDICTIONS,
)
CPU_SIZES = Sizes(
    gpu=False,
    model=CPU_MODEL,
    seq_len=128,
    micro=2,
    big_micro=4,
    steps=4,
    warmup=1,
    documents=300,
    timeout_s=300,
    budget_s=1200,
    extra_args=["--peak-tflops", "1.0"],  # nominal: MFU is computed, and means nothing
    predictions=dict.fromkeys(
        GPU_PREDICTIONS
    ),  # a CPU step says nothing a GPU prediction could be checked on
    # fp32: torch's bf16 kernels on CPU are several times slower, and this size checks the script only
    # (bf16 training on CPU has its own e2e tests). The whole-model compile differs from liger_compile
    # only in the switch, and costs a minute more of CPU compilation.
    precision="fp32",
    skip={"compile_model": "measured on GPUs only (the same launch as liger_compile, another switch)"},
)


@dataclass(frozen=True)
class Variant:
    name: str
    data: str  # "mix" | "full"
    overrides: tuple[str, ...] = ()
    big: bool = False  # the larger micro-batch
    peer: bool = False  # the HF Trainer instead of llm_train
    best: bool = False  # takes the fastest exact combination measured before it
    baseline: str | None = None  # the variant its losses and peak are compared with
    optional: bool = False  # run only if the budget leaves time: not running it is no failure


DOC = ("memory.attention=auto",)
LIGER = (*DOC, "memory.liger_kernels=true")
VARIANTS = [
    Variant("baseline", "mix", ("memory.attention=sdpa",)),
    Variant("document_aware", "mix", DOC, baseline="baseline"),
    Variant("hf_trainer", "mix", peer=True, baseline="baseline"),
    Variant("liger", "mix", LIGER, baseline="baseline"),
    Variant("liger_compile", "mix", (*LIGER, "memory.torch_compile=layers"), baseline="baseline"),
    Variant("best_micro8", "mix", big=True, best=True),
    Variant("full_baseline", "full", ("memory.attention=sdpa",)),
    Variant("full_best", "full", best=True, baseline="full_baseline"),
    Variant(
        "compile_model", "mix", (*LIGER, "memory.torch_compile=model"), baseline="baseline", optional=True
    ),
]
BEST_CANDIDATES = ("document_aware", "liger", "liger_compile")
CUDA_ONLY = ("memory.liger_kernels=true",)


# --- the data -----------------------------------------------------------------------------------------------


def generate_data(folder: Path, sizes: Sizes, vocab: int, seed: int = 0) -> dict[str, Path]:
    """The two token-id corpora as parquet (format: tokenized); returns {"mix": path, "full": path}."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    median_len = MIX_MEDIAN_FRACTION * sizes.seq_len
    lengths = np.maximum(8, rng.lognormal(np.log(median_len), MIX_SIGMA, sizes.documents)).astype(np.int64)
    corpora = {"mix": lengths, "full": np.full(sizes.documents // 4, sizes.seq_len, dtype=np.int64)}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, lens in corpora.items():
        ids = [rng.integers(3, vocab, n).tolist() for n in lens]  # 0-2: the bundled tokenizer's pad/bos/eos
        path = folder / f"{name}.parquet"
        pq.write_table(pa.table({"input_ids": ids}), path)
        paths[name] = path
    return paths


def data_overrides(path: Path, sizes: Sizes, cache: Path) -> list[str]:
    return [
        f"data.train=[{{path: {path}, format: tokenized, overlong: split}}]",
        f"data.seq_len={sizes.seq_len}",
        f"data.cache_dir={cache}",
    ]


# --- one variant ---------------------------------------------------------------------------------------------


@dataclass
class Context:
    sizes: Sizes
    work: Path
    data: dict[str, Path]
    results: Results
    budget: Budget
    done: dict[str, dict[str, Any]] = field(default_factory=dict)


def effective_overrides(variant: Variant, ctx: Context) -> tuple[list[str], list[str]]:
    """(the variant's switches, the ones dropped: CUDA-only switches under --cpu-tiny)."""
    switches = list(variant.overrides)
    if variant.best:
        switches = list(best_switches(ctx) or [])
    if ctx.sizes.gpu:
        return switches, []
    return [s for s in switches if s not in CUDA_ONLY], [s for s in switches if s in CUDA_ONLY]


def best_switches(ctx: Context) -> tuple[str, ...] | None:
    """The switches of the fastest exact variant among BEST_CANDIDATES measured so far (None: none passed)."""
    passed = [ctx.done[n] for n in BEST_CANDIDATES if ctx.done.get(n, {}).get("passed")]
    if not passed:
        return None
    fastest = max(passed, key=lambda r: r["tokens_per_s"] or 0.0)
    return tuple(fastest["switches"])


def llm_train_cmd(variant: Variant, switches: list[str], ctx: Context, run_dir: Path) -> list[str]:
    sizes = ctx.sizes
    micro = sizes.big_micro if variant.big else sizes.micro
    return [
        sys.executable,
        str(TRAIN),
        "--recipe",
        "tiny-cpu",
        "--output-dir",
        str(run_dir),
        f"--max-steps={sizes.steps + 2}",  # stopped once `steps` are logged: never in its export
        "--ds-config",
        str(DS_CONFIG),
        *sizes.extra_args,
        *COMMON,
        *sizes.model,
        *data_overrides(ctx.data[variant.data], sizes, ctx.work / "cache"),
        f"optim.micro_batch_size={micro}",
        f"precision={sizes.precision}",
        *switches,
    ]


def kernel_used(output: str) -> str | None:
    """The start-up summary's `attention    KERNEL (why)` line (observability/console.py)."""
    match = re.search(r"^\s+attention\s+(\S+) \((.*)\)$", output, re.MULTILINE)
    return f"{match.group(1)} ({match.group(2)})" if match else None


def measure(variant: Variant, ctx: Context, cmd: list[str], run_dir: Path, log: str) -> dict[str, Any]:
    """Launch, stop after `steps` logged rows, and read the medians and first losses."""
    sizes = ctx.sizes
    run = launch(
        cmd,
        ctx.budget.timeout(sizes.timeout_s),
        ctx.work / f"{variant.name}.log",
        kill_when=lambda: len(metrics_rows(run_dir)) >= sizes.steps,
    )
    ctx.results.log_launch(log, run)
    rows = metrics_rows(run_dir)[: sizes.steps]
    steady = [r for r in rows if r["step"] > sizes.warmup]
    step_time = median(steady, "step_time_s")
    first = rows[0]["step_time_s"] if rows else None
    record: dict[str, Any] = {
        "steps": len(rows),
        "step_time_s": step_time,
        "tokens_per_s": median(steady, "tokens_per_s"),
        "mfu": median(steady, "mfu"),
        "mfu_seq_len": median(steady, "mfu_seq_len"),
        "attention_span": median(steady, "attention_span"),
        "gpu_mem_peak_gib": peak(rows, "gpu_mem_peak_gib"),
        "compile_s": first - step_time if first is not None and step_time else None,
        "first_losses": [r["loss"] for r in rows[:LOSS_STEPS]],
        "wall_s": run.wall_s,
        "stopped": run.action,
    }
    if len(rows) < sizes.steps or not steady:
        what = "timed out" if run.timed_out else f"exit {run.rc}"
        record["error"] = f"{what} after {len(rows)} of {sizes.steps} steps"
        record["tail"] = run.tail
    record["output"] = run.output
    return record


def run_llm_train(variant: Variant, switches: list[str], ctx: Context) -> dict[str, Any]:
    run_dir = ctx.work / variant.name
    record = measure(variant, ctx, llm_train_cmd(variant, switches, ctx, run_dir), run_dir, variant.name)
    output = record.pop("output")
    record["kernel"] = kernel_used(output)
    record["notices"] = [
        line.strip()
        for line in output.splitlines()
        if line.startswith(("Liger kernels on", "torch.compile on"))
    ]
    return record


def run_peer(variant: Variant, ctx: Context) -> dict[str, Any]:
    """The HF Trainer on llm_train's own rows, init and optimizer settings (bench/hf_trainer_peer.py)."""
    sizes = ctx.sizes
    model_dir, rows, optim = prepare_peer(ctx)
    out = ctx.work / variant.name
    cmd = [
        sys.executable,
        str(PEER),
        "--model-dir",
        str(model_dir),
        "--rows",
        str(rows),
        "--ds-config",
        str(DS_CONFIG),
        "--out",
        str(out),
        f"--micro-batch={sizes.micro}",
        f"--steps={sizes.steps + 2}",
        f"--lr={optim.lr}",
        "--betas",
        *map(str, optim.betas),
        f"--eps={optim.eps}",
        f"--weight-decay={optim.weight_decay}",
        f"--grad-clip={optim.grad_clip}",
        f"--seed={optim.seed}",
        f"--precision={sizes.precision}",
        *([] if sizes.gpu else ["--cpu"]),
    ]
    record = measure(variant, ctx, cmd, out, variant.name)
    record.pop("output")
    record["kernel"] = "sdpa (transformers' default)"
    record.update(peer_mfu(record, ctx))
    return record


def baseline_run(ctx: Context) -> Any:
    """The baseline's resolved run (recipe tiny-cpu + the matrix's overrides), as a worker resolves it."""
    from llm_train.config.hardware import Device
    from llm_train.config.resolution import resolve_run

    sizes = ctx.sizes
    overrides = [
        *COMMON,
        *sizes.model,
        *data_overrides(ctx.data["mix"], sizes, ctx.work / "cache"),
        f"optim.micro_batch_size={sizes.micro}",
        f"precision={sizes.precision}",
        "memory.attention=sdpa",
    ]
    device = "cuda" if sizes.gpu else "cpu"
    return resolve_run("tiny-cpu", overrides, 1, Device(kind=device, name=device, bf16=True), str(DS_CONFIG))


def prepare_peer(ctx: Context) -> tuple[Path, Path, Any]:
    """(model config folder, the rows rank 0 trains on in llm_train's order, the optimizer section)."""
    import torch

    from llm_train.data import BatchStream, load_blocks
    from llm_train.runtime.model import load_tokenizer, model_config

    run = baseline_run(ctx)
    recipe, sizes = run.recipe, ctx.sizes
    model_dir = ctx.work / "peer_model"
    model_config(recipe.model).save_pretrained(model_dir)
    train, _ = load_blocks(recipe.data, load_tokenizer(recipe.model), recipe.optim.seed)
    stream = BatchStream(train, sizes.micro, 0, 1, recipe.optim.seed, workers=0, pin_memory=False)
    batches = [next(stream) for _ in range(sizes.steps + 2)]
    keys = [k for k, v in batches[0].items() if isinstance(v, torch.Tensor)]
    rows = ctx.work / "peer_rows.pt"
    torch.save({k: torch.cat([b[k] for b in batches]) for k in keys}, rows)
    return model_dir, rows, recipe.optim


def peer_mfu(record: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The Trainer logs no MFU: llm_train's formula on its step time and the same rows' span."""
    from llm_train.config.hardware import peak_tflops
    from llm_train.observability.metrics import shape_token_flops
    from llm_train.planning.shapes import shape_from_config

    baseline = ctx.done.get("baseline", {})
    span = baseline.get("attention_span")
    tokens_per_s = record.get("tokens_per_s")
    run = baseline_run(ctx)
    flops = shape_token_flops(shape_from_config(run.model_fields))
    device_peak = 1.0 if not ctx.sizes.gpu else gpu_peak_tflops(peak_tflops)  # --cpu-tiny: the nominal 1.0
    if not (tokens_per_s and span and device_peak):
        return {}
    per_s = tokens_per_s / (device_peak * 1e12)
    return {
        "attention_span": span,
        "mfu": per_s * flops.at(span),
        "mfu_seq_len": per_s * flops.at(ctx.sizes.seq_len),
    }


def gpu_peak_tflops(table: Callable[[str], float | None]) -> float | None:
    import torch

    return table(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def judge(variant: Variant, record: dict[str, Any], ctx: Context, micro: int) -> dict[str, Any]:
    """The line's checks; `passed` is all of them."""
    predicted = record.get("predicted_step_time_s")
    if predicted and record.get("step_time_s"):
        record["measured_over_predicted"] = record["step_time_s"] / predicted
    checks: dict[str, bool] = {"ran": "error" not in record}
    base = ctx.done.get(variant.baseline or "")
    if base and not variant.big and base.get("first_losses"):
        ours, theirs = record.get("first_losses") or [], base["first_losses"]
        checks["exact"] = len(ours) == len(theirs) and all(
            abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(ours, theirs, strict=True)
        )
        record["baseline_first_losses"] = theirs
    if base and micro == ctx.sizes.micro and not variant.peer:
        ours_peak, base_peak = record.get("gpu_mem_peak_gib"), base.get("gpu_mem_peak_gib")
        if ours_peak is not None and base_peak is not None:
            checks["peak_not_above_baseline"] = ours_peak <= base_peak * (1 + PEAK_SLACK)
            record["baseline_gpu_mem_peak_gib"] = base_peak
    record["checks"] = checks
    record["passed"] = all(checks.values())
    if not record["passed"] and "error" not in record:
        record["error"] = "failed checks: " + ", ".join(k for k, ok in checks.items() if not ok)
    return record


def run_variant(variant: Variant, ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    micro = sizes.big_micro if variant.big else sizes.micro
    predicted = sizes.predictions.get(variant.name)
    record: dict[str, Any] = {
        "measurement": variant.name,
        "data": variant.data,
        "micro_batch": micro,
        "predicted_step_time_s": predicted,
    }
    if variant.name in sizes.skip:
        return {**record, "passed": None, "skipped": sizes.skip[variant.name]}
    if ctx.budget.left() < MIN_TIME_S:
        left = f"not run: {max(0.0, ctx.budget.left()):.0f}s of the budget left"
        if variant.optional:
            return {**record, "passed": None, "skipped": left}
        return {**record, "passed": False, "error": left}
    if variant.peer:
        record["switches"] = ["transformers.Trainer"]
        record.update(run_peer(variant, ctx))
        return judge(variant, record, ctx, micro)
    switches, dropped = effective_overrides(variant, ctx)
    if variant.best and best_switches(ctx) is None:
        return {**record, "passed": False, "error": f"not run: none of {', '.join(BEST_CANDIDATES)} passed"}
    record["switches"] = switches
    if dropped:
        record["dropped"] = [f"{s} (needs CUDA)" for s in dropped]
        same = next((n for n, r in ctx.done.items() if r.get("switches") == switches and r["data"] == variant.data
                     and r["micro_batch"] == micro), None)  # fmt: skip
        if same is not None:
            return {**record, "passed": None, "skipped": f"without CUDA the same run as {same}"}
    record.update(run_llm_train(variant, switches, ctx))
    return judge(variant, record, ctx, micro)


# --- the targets -----------------------------------------------------------------------------------------------


def target_lines(ctx: Context) -> list[dict[str, Any]]:
    exact = [
        r
        for n, r in ctx.done.items()
        if r.get("passed") and r["data"] == "mix" and n not in ("baseline", "hf_trainer")
    ]
    best_mfu = max(exact, key=lambda r: r.get("mfu") or 0.0, default=None)
    mfu = best_mfu.get("mfu") if best_mfu else None
    lines = [
        {
            "measurement": "target_mfu",
            "target": MFU_TARGET,
            "best": best_mfu["measurement"] if best_mfu else None,
            "mfu": mfu,
            "mfu_seq_len": best_mfu.get("mfu_seq_len") if best_mfu else None,
            "passed": mfu is not None and mfu >= MFU_TARGET,
        }
    ]
    peer = ctx.done.get("hf_trainer", {})
    same_batch = [r for r in exact if r["micro_batch"] == ctx.sizes.micro]
    fastest = max(same_batch, key=lambda r: r.get("tokens_per_s") or 0.0, default=None)
    ratio = None
    if fastest and fastest.get("tokens_per_s") and peer.get("passed") and peer.get("tokens_per_s"):
        ratio = fastest["tokens_per_s"] / peer["tokens_per_s"]
    lines.append(
        {
            "measurement": "target_vs_hf_trainer",
            "target": PEER_RATIO_TARGET,
            "best": fastest["measurement"] if fastest else None,
            "tokens_per_s": fastest.get("tokens_per_s") if fastest else None,
            "hf_trainer_tokens_per_s": peer.get("tokens_per_s"),
            "ratio": ratio,
            "passed": ratio is not None and ratio >= PEER_RATIO_TARGET,
        }
    )
    for line in lines:
        if not line["passed"]:
            line["error"] = (
                "target missed" if line.get("mfu") or line.get("ratio") else "nothing to measure it on"
            )
    return lines


# --- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = check_arguments(
        __doc__.splitlines()[0],
        [v.name for v in VARIANTS],
        "Run only these, in order.",
        "Deadline for the whole matrix (default 480 GPU, 1200 CPU).",
    )
    args = parser.parse_args()
    sizes = CPU_SIZES if args.cpu_tiny else GPU_SIZES
    require_cuda("mfu_matrix", args.cpu_tiny)
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    started = time.time()
    budget = Budget(args.budget_s or sizes.budget_s)
    suffix = "_cpu_tiny" if args.cpu_tiny else ""
    results = Results.for_check("mfu_matrix", args.out, args.cpu_tiny)
    wanted = [v for v in VARIANTS if args.only is None or v.name in args.only]
    results.add(
        {
            "measurement": "predictions",
            "predicted_step_time_s": {v.name: sizes.predictions.get(v.name) for v in wanted},
            "basis": "module source, GPU_PREDICTIONS" if sizes.gpu else "none on CPU",
        }
    )
    with tempfile.TemporaryDirectory(prefix="llm_train_mfu_matrix_") as tmp:
        work = Path(tmp)
        data = generate_data(work / "data", sizes, vocab=4096)
        ctx = Context(sizes, work, data, results, budget)
        for variant in wanted:
            try:
                record = run_variant(variant, ctx)
            except Exception as exc:  # a broken variant must not take the others with it
                record = {
                    "measurement": variant.name,
                    "data": variant.data,
                    "passed": False,
                    "error": repr(exc),
                }
            ctx.done[variant.name] = record
            results.add(record)
        for line in target_lines(ctx):
            results.add(line)
        assert not RUNNING
    failed = [r["measurement"] for r in results.records if r.get("passed") is False]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "benchmark": f"mfu_matrix{suffix}",
        "setup": "CPU script check: tiny-cpu model, bf16, seq 128 (numbers say nothing about a GPU)"
        if args.cpu_tiny
        else "one GPU: Llama-3.2-1B shape, random init, bf16, seq 4096, ZeRO-2, micro 4 (8 for best_micro8)",
        "passed": not failed,
        "failed": failed,
        "wall_s": round(time.time() - started, 1),
        "budget_s": args.budget_s or sizes.budget_s,
        "lines": {
            r["measurement"]: {
                k: r.get(k)
                for k in (
                    "step_time_s",
                    "predicted_step_time_s",
                    "tokens_per_s",
                    "mfu",
                    "mfu_seq_len",
                    "gpu_mem_peak_gib",
                    "kernel",
                    "passed",
                )
            }
            for r in results.records
            if r["measurement"] != "predictions"
        },  # fmt: skip
        "versions": versions(),
    }
    results.summary.write_text(json.dumps(round_floats(summary), indent=2) + "\n")
    print(f"mfu_matrix: wrote {results.jsonl}, {results.summary.name}, {results.log.name}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
