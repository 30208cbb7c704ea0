"""MFU and tokens/s of llm_train's speed switches on one GPU, against the Hugging Face Trainer on the same job.

A list of cases on bench/cases.py: one process per variant, in order of value, each line written the
moment it ends. bench/gpu_run.py runs them with the time its parts leave; alone:

    python -m bench.mfu_matrix [--cpu-tiny] [--only baseline hf_trainer] [--out DIR]

ends with llm_train's and the Trainer's tokens/s side by side. The job: a Llama-3.2-1B-shaped model
(random init, drawn on the GPU), bf16, seq 4096, ZeRO-2 (ds_configs/zero2.json), micro-batch 4, one GPU.

Data: the bundled corpus (real text), tokenised by the bundled tokenizer and cut into documents:
- `mix`: log-normal lengths (median 600, sigma 1: mean ~990 tokens, a long tail, like web text), the
  longer ones split at seq_len, packed by llm_train (best-fit decreasing, position ids restarting per
  document): ~4 documents per row;
- `full`: documents of exactly seq_len tokens: every row one sequence, no boundary.

Variants (`VARIANTS`, in order of value):
  baseline        mix,  memory.attention=sdpa: the dense [b,1,s,s] mask (the first H200 run's setup)
  hf_trainer      mix,  transformers.Trainer on the same rows, init, DS JSON and batch (bench/hf_trainer_peer.py)
  doc_isolation   not a speed run: per-document logits of a packed row against each document alone, for
                  every kernel the matrix uses, and a planted cross-document leak that must be seen
                  (bench/doc_isolation.py): the check that a fast kernel is also an exact one
  document_aware  mix,  memory.attention=auto (flash_attention_2 where installed, else sdpa_flex)
  liger           mix,  + memory.liger_kernels=true
  liger_compile   mix,  + memory.torch_compile=layers (regional: each decoder layer compiled in place)
  best_micro8     mix,  the fastest exact variant above at micro-batch 8
  full_baseline   full, memory.attention=sdpa (is_causal: no mask to build)
  full_best       full, the fastest exact combination
  compile_model   mix,  document_aware + liger + memory.torch_compile=model (whole model)

Each speed line: predicted step time (GPU_PREDICTIONS, written before the first GPU run), step time and
tokens/s (medians after the warm-up steps), `mfu` (attention over the documents the rows hold) and
`mfu_seq_len` (over the whole row), the GPU's peak, the kernel the run used, `compile_s` (first step
minus a steady one), the first losses, and `checks`: `ran`; `exact` (the first LOSS_STEPS losses equal
the baseline's within LOSS_RTOL: catches a broken kernel, NaN or a wrong loss scale; the masks are
doc_isolation's); `peak_not_above_baseline` (at the baseline's micro-batch). Then `llm_train_vs_hf_trainer`
(baseline tokens/s over the Trainer's: llm_train's step must be no slower), `target_mfu` (the best exact
variant's document-aware MFU >= 45%) and `target_vs_hf_trainer` (the best exact variant >= 1.3x the
Trainer). The targets are judged on a GPU only; a target whose inputs were not measured in this run is a
deferred line, not a failure.

`--cpu-tiny` runs the same cases on CPU with the tiny-cpu model (seq 128, micro 2, fp32, a nominal
--peak-tflops): CUDA-only switches (Liger) are dropped, a variant that is then the same run as an
earlier one is skipped, and auto picks sdpa on CPU. Its numbers say nothing about a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cases import Budget, Case, Context, check_arguments, injected, run_cases
from bench.environment import CORPUS, REPO, TOKENIZER, TRAIN, module_cmd
from bench.hf_trainer_peer import command, flags, save_job
from bench.launch import launch
from bench.result_files import Results
from bench.verdicts import Judging, judge
from bench.watch import GpuMemorySampler, median, metrics_rows, peak

DS_CONFIG = REPO / "ds_configs" / "zero2.json"
MFU_TARGET = 0.45
PEER_RATIO_TARGET = 1.3
# bf16 weights and activations round at 2^-8 relative; kernels that add in another order (flex vs.
# flash, Liger's chunked cross-entropy, inductor's fusions) move a mean loss of ~8 by ~1e-3 relative at
# the first step, and two small updates (constant lr, Adam) keep it there. 1% is ten times that, and far
# below what a broken kernel does (NaN, a loss off by a constant factor).
LOSS_RTOL = 0.01
LOSS_STEPS = 3
# Two runs of the same job on the first H200 reached the same allocator peak within 1e-4 GiB
# (bench/results/gpu_check-h200-20261130-1904.jsonl, b_mfu_zero2 and c_zero0): 0.5% covers block rounding.
PEAK_SLACK = 0.005
MIX_MEDIAN_FRACTION = 600 / 4096  # log-normal median of the mix's document lengths, as a fraction of seq_len
MIX_SIGMA = 1.0

COMMON = [  # a speed probe of a few steps over the corpus, not a fine-tune
    "output.log_every=1", "eval.every=0", "data.eval_fraction=0", "output.sample_prompt=null",
    "tracking.mode=disabled", "checkpoint.at_end=false", "data.max_epochs=1000", "optim.grad_accum=1",
    "optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0.0",
]  # fmt: skip
GPU_MODEL = [
    "hardware.device=cuda",
    "model.init=random",
    "model.name_or_path=meta-llama/Llama-3.2-1B",  # shape known offline; the bundled tokenizer stays
    "model.config={}",
    "optim.lr=1e-4",
]
CPU_MODEL = ["optim.lr=1e-3"]  # tiny-cpu's own model


SDPA = ("memory.attention=sdpa",)  # the baselines' attention: the dense [b,1,s,s] mask on packed rows


@dataclass(frozen=True)
class Sizes:
    gpu: bool
    model: list[str]
    seq_len: int
    micro: int  # the best variant also runs at twice this
    steps: int
    warmup: int  # steps left out of the medians: allocator warm-up, compilation, autotuning
    documents: int  # per data set: enough rows for the longest variant, with room
    extra_args: list[str] = field(default_factory=list)
    precision: str = "bf16"
    skip: dict[str, str] = field(default_factory=dict)  # variants this size does not run, and why


GPU_SIZES = Sizes(gpu=True, model=GPU_MODEL, seq_len=4096, micro=4, steps=12, warmup=4, documents=600)
CPU_SIZES = Sizes(
    gpu=False,
    model=CPU_MODEL,
    seq_len=128,
    micro=2,
    steps=4,
    warmup=1,
    documents=300,
    extra_args=["--peak-tflops", "1.0"],  # nominal: MFU is computed, and means nothing
    # fp32: torch's bf16 kernels on CPU are several times slower, and this size checks the script only
    # (bf16 training on CPU has its own e2e tests).
    precision="fp32",
    # The whole-model compile differs from liger_compile only in the switch, and costs a minute more of CPU.
    skip={"compile_model": "measured on GPUs only (the same launch as liger_compile, another switch)"},
)

# Predicted step times on one H200 (seconds), written before the first GPU run of this matrix. Basis:
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
GPU_PREDICTIONS: dict[str, float] = {
    "baseline": 0.45, "document_aware": 0.32, "hf_trainer": 0.46, "liger": 0.29, "liger_compile": 0.28,
    "best_micro8": 0.55, "full_baseline": 0.33, "full_best": 0.29, "compile_model": 0.28,
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One llm_train launch; its losses and peak are compared with `baseline` (or `full_baseline` on the
    full rows) at the same micro-batch."""

    name: str
    data: str  # "mix" | "full"
    overrides: tuple[str, ...] = ()
    big: bool = False  # at twice the micro-batch
    best: bool = False  # takes the fastest exact combination measured before it
    cost_s: float = 60.0  # on the H200: start-up (~15 s), 14 steps, compilation
    box_s: float = 120.0


DOC = ("memory.attention=auto",)
LIGER = (*DOC, "memory.liger_kernels=true")
VARIANTS = [
    Variant("baseline", "mix", SDPA, cost_s=40, box_s=80),
    Variant("document_aware", "mix", DOC, cost_s=70),
    Variant("liger", "mix", LIGER),
    Variant("liger_compile", "mix", (*LIGER, "memory.torch_compile=layers"), cost_s=100, box_s=150),
    Variant("best_micro8", "mix", big=True, best=True),
    Variant("full_baseline", "full", SDPA, cost_s=40, box_s=80),
    Variant("full_best", "full", best=True, cost_s=70),
    Variant("compile_model", "mix", (*LIGER, "memory.torch_compile=model"), cost_s=120, box_s=150),
]
BEST_CANDIDATES = ("document_aware", "liger", "liger_compile")
CUDA_ONLY = ("memory.liger_kernels=true",)


# --- the runs and what the peer processes read --------------------------------------------------------


def job(sizes: Sizes, micro: int | None = None, switches: Sequence[str] = SDPA) -> list[str]:
    """A matrix run's overrides of the tiny-cpu recipe, its data aside."""
    micro_batch, precision = f"optim.micro_batch_size={micro or sizes.micro}", f"precision={sizes.precision}"
    return [*COMMON, *sizes.model, f"data.seq_len={sizes.seq_len}", micro_batch, precision, *switches]


def train_cmd(run_dir: Path, steps: int, extra_args: list[str], overrides: list[str]) -> list[str]:
    """train.py on tiny-cpu for `steps` logged steps and two more: stopped once they are logged, so never
    in its last step nor in its export."""
    given = {"recipe": "tiny-cpu", "output-dir": run_dir, "max-steps": steps + 2, "ds-config": DS_CONFIG}
    return [sys.executable, str(TRAIN), *flags(given), "--overwrite", *extra_args, *overrides]


def resolve(sizes: Sizes, overrides: list[str]) -> Any:
    """The resolved run (recipe tiny-cpu + `overrides`), as a worker resolves it."""
    from llm_train.config.hardware import Device
    from llm_train.config.resolution import resolve_run

    device = "cuda" if sizes.gpu else "cpu"
    return resolve_run("tiny-cpu", overrides, 1, Device(kind=device, name=device, bf16=True), str(DS_CONFIG))


@dataclass
class Matrix:
    """What the matrix's cases share in one run: the sizes, the data, the baseline's resolved run, and the
    peer's inputs (bench/hf_trainer_peer.py save_job's folder, made once)."""

    sizes: Sizes
    data: dict[str, Path]
    cache: Path
    baseline: Any = None
    peer: Path | None = None

    def overrides(
        self, data: str = "mix", micro: int | None = None, switches: Sequence[str] = SDPA
    ) -> list[str]:
        train = f"data.train=[{{path: {self.data[data]}, format: tokenized, overlong: split}}]"
        return [*job(self.sizes, micro, switches), train, f"data.cache_dir={self.cache}"]


def state(ctx: Context) -> Matrix:
    if "mfu" not in ctx.state:
        sizes = GPU_SIZES if ctx.gpu else CPU_SIZES
        matrix = Matrix(sizes, generate_data(ctx.work / "mfu_data", sizes), ctx.work / "mfu_cache")
        matrix.baseline = resolve(sizes, matrix.overrides())
        ctx.state["mfu"] = matrix
    found: Matrix = ctx.state["mfu"]
    return found


def peer_inputs(ctx: Context) -> Path:
    """The Trainer's and doc_isolation's inputs: the baseline's model config and the rows it trains on."""
    matrix = state(ctx)
    if matrix.peer is None:
        save_job(matrix.baseline, ctx.work / "mfu_peer", matrix.sizes.steps + 2)
        matrix.peer = ctx.work / "mfu_peer"
    return matrix.peer


def generate_data(folder: Path, sizes: Sizes, seed: int = 0) -> dict[str, Path]:
    """The two corpora as parquet of token ids (format: tokenized), cut from the bundled text."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    stream = np.array([i for encoding in tokenizer.encode_batch(lines) for i in encoding.ids], dtype=np.int64)
    rng = np.random.default_rng(seed)
    median_len = MIX_MEDIAN_FRACTION * sizes.seq_len
    lengths = np.maximum(8, rng.lognormal(np.log(median_len), MIX_SIGMA, sizes.documents)).astype(np.int64)
    corpora = {"mix": lengths, "full": np.full(sizes.documents // 4, sizes.seq_len, dtype=np.int64)}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, lens in corpora.items():
        ends = np.cumsum(lens)
        # Documents are consecutive slices of the corpus, which is repeated as often as they need.
        text = np.tile(stream, int(ends[-1] // len(stream)) + 1)
        ids = [text[end - n : end].tolist() for n, end in zip(lens, ends, strict=True)]
        path = folder / f"{name}.parquet"
        pq.write_table(pa.table({"input_ids": ids}), path)
        paths[name] = path
    return paths


# --- one variant ------------------------------------------------------------------------------------------


def best_switches(ctx: Context) -> tuple[str, ...] | None:
    """The switches of the fastest exact variant among BEST_CANDIDATES measured so far (None: none passed)."""
    passed = [ctx.done[n] for n in BEST_CANDIDATES if ctx.done.get(n, {}).get("passed")]
    if not passed:
        return None
    return tuple(max(passed, key=lambda r: r.get("tokens_per_s") or 0.0)["switches"])


def kernel_used(output: str) -> str | None:
    """The start-up summary's `attention    KERNEL (why)` line (observability/console.py)."""
    match = re.search(r"^\s+attention\s+(\S+) \((.*)\)$", output, re.MULTILINE)
    return f"{match.group(1)} ({match.group(2)})" if match else None


MEDIANS = ("step_time_s", "tokens_per_s", "slot_tokens_per_s", "mfu", "mfu_seq_len", "attention_span")


def measure(name: str, ctx: Context, record: dict[str, Any], cmd: list[str], run_dir: Path) -> str:
    """Launch, stop after `steps` logged rows, and add the medians and first losses to `record`; the
    launch's output."""
    sizes = state(ctx).sizes
    log = ctx.work / f"{name}.log"
    run = launch(cmd, ctx.timeout(), log, kill_when=lambda: len(metrics_rows(run_dir)) >= sizes.steps)
    ctx.results.log_launch(name, run)
    rows = metrics_rows(run_dir)[: sizes.steps]
    steady = [r for r in rows if r["step"] > sizes.warmup]
    record["steps"] = len(rows)
    record.update({k: median(steady, k) for k in MEDIANS})
    step_time, first = record["step_time_s"], rows[0]["step_time_s"] if rows else None
    record.update(
        gpu_mem_peak_gib=peak(rows, "gpu_mem_peak_gib"),
        compile_s=first - step_time if first is not None and step_time else None,
        first_losses=[r["loss"] for r in rows[:LOSS_STEPS]],
        wall_s=run.wall_s,
        stopped=run.action,
    )
    if len(rows) < sizes.steps or not steady:
        record.update(error=run.failure(len(rows), sizes.steps), tail=run.tail)
    return run.output


# The matrix was sized on the H200 (141 GiB). At micro-batch 4 the baseline's allocator peak was 69.9 GiB
# (ZeRO-3: 72.3; bench/results/gpu_check-h200-20261130-1904.jsonl): about 18.5 GiB of model states (1.24B
# parameters x 16 B) and 12.8 GiB a row, so micro 4 fits an 80 GB H100 (79.1 GiB) and twice that does not
# (~120 GiB). On a smaller card the big variant runs at 1.5x: the best variant drops the dense [b,1,s,s] mask
# and, with Liger, the fp32 logits and their gradient (~4 GiB a row), ~8.8 GiB a row: ~72 GiB at micro 6.
BIG_MICRO_MIN_GIB = 120.0


def big_micro(sizes: Sizes, card_gib: float | None) -> tuple[int, str | None]:
    """The big variant's micro-batch on this card, and why it differs from twice the matrix's, if it does."""
    if not sizes.gpu or card_gib is None or card_gib >= BIG_MICRO_MIN_GIB:
        return 2 * sizes.micro, None
    micro = sizes.micro * 3 // 2
    return micro, (
        f"resized: micro {micro}, not {2 * sizes.micro}, on this {card_gib:.0f} GiB card (the matrix was sized "
        f"for the H200's 141 GiB; twice micro {sizes.micro} needs ~120 GiB)"
    )


def run_variant(variant: Variant, ctx: Context) -> dict[str, Any]:
    matrix = state(ctx)
    sizes = matrix.sizes
    micro, resized = sizes.micro, None
    if variant.big:
        micro, resized = big_micro(sizes, ctx.done.get("probe", {}).get("device_memory_gib"))
    predicted = GPU_PREDICTIONS.get(variant.name) if sizes.gpu and resized is None else None
    record: dict[str, Any] = {"data": variant.data, "micro_batch": micro, "predicted_step_time_s": predicted}
    if resized:
        record["resized"] = resized
    if variant.name in sizes.skip:
        return {**record, "passed": None, "skipped": sizes.skip[variant.name]}
    switches = list(variant.overrides)
    if variant.best:
        best = best_switches(ctx)
        if best is None:
            return {**record, "passed": None, "deferred": f"none of {', '.join(BEST_CANDIDATES)} passed yet"}
        switches = list(best)
    dropped = [] if sizes.gpu else [s for s in switches if s in CUDA_ONLY]
    switches = [s for s in switches if s not in dropped]
    record["switches"] = switches
    if dropped:
        record["dropped"] = [f"{s} (needs CUDA)" for s in dropped]
        same = next((n for n, r in ctx.done.items() if r.get("switches") == switches and r.get("data") == variant.data
                     and r.get("micro_batch") == micro), None)  # fmt: skip
        if same is not None:
            return {**record, "passed": None, "skipped": f"without CUDA the same run as {same}"}
    run_dir = ctx.work / variant.name
    cmd = train_cmd(run_dir, sizes.steps, sizes.extra_args, matrix.overrides(variant.data, micro, switches))
    output = measure(variant.name, ctx, record, cmd, run_dir)
    record["kernel"] = kernel_used(output)
    notices = ("Liger kernels on", "torch.compile on")
    record["notices"] = [line.strip() for line in output.splitlines() if line.startswith(notices)]
    return checks(variant.name, record, ctx)


def run_peer(ctx: Context) -> dict[str, Any]:
    """The HF Trainer on llm_train's own rows, init and optimizer settings (bench/hf_trainer_peer.py)."""
    matrix = state(ctx)
    sizes, out = matrix.sizes, ctx.work / "hf_trainer"
    cmd = command(matrix.baseline, peer_inputs(ctx), out, sizes.steps + 2, sizes.gpu)
    record: dict[str, Any] = {
        "data": "mix",
        "micro_batch": sizes.micro,
        "predicted_step_time_s": GPU_PREDICTIONS["hf_trainer"] if sizes.gpu else None,
        "switches": ["transformers.Trainer"],
    }
    measure("hf_trainer", ctx, record, cmd, out)
    record["kernel"] = "sdpa (transformers' default)"
    record.update(peer_mfu(record, ctx))
    return checks("hf_trainer", record, ctx, memory=False)


def peer_mfu(record: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The Trainer logs no MFU: llm_train's formula on its step time and the same rows' span."""
    from llm_train.config.hardware import peak_tflops
    from llm_train.observability.metrics import shape_token_flops
    from llm_train.planning.model.shapes import shape_from_config

    matrix = state(ctx)
    span = ctx.done.get("baseline", {}).get("attention_span")
    tokens_per_s = record.get("tokens_per_s")
    flops = shape_token_flops(shape_from_config(matrix.baseline.model_fields))
    device = ctx.done.get("probe", {}).get("device") or GpuMemorySampler().name()
    device_peak = peak_tflops(device) if matrix.sizes.gpu and device else 1.0  # --cpu-tiny: the nominal 1.0
    if not (tokens_per_s and span and device_peak):
        return {}
    per_s = tokens_per_s / (device_peak * 1e12)
    return {
        "attention_span": span,
        "mfu": per_s * flops.at(span),
        "mfu_seq_len": per_s * flops.at(matrix.sizes.seq_len),
    }


def checks(name: str, record: dict[str, Any], ctx: Context, memory: bool = True) -> dict[str, Any]:
    """The line's checks; `passed` is all of them. Losses and (with `memory`) the peak are compared with the
    baseline on the same rows (`full_baseline` on the full ones) at the same micro-batch."""
    predicted = record.get("predicted_step_time_s")
    if predicted and record.get("step_time_s"):
        record["measured_over_predicted"] = record["step_time_s"] / predicted
    checked: dict[str, bool] = {"ran": "error" not in record}
    base_name = "full_baseline" if record["data"] == "full" else "baseline"
    same_micro = record["micro_batch"] == state(ctx).sizes.micro
    base = ctx.done.get(base_name, {}) if name != base_name and same_micro else {}
    if base.get("first_losses"):
        ours, theirs = record.get("first_losses") or [], base["first_losses"]
        checked["exact"] = len(ours) == len(theirs) and all(
            abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(ours, theirs, strict=True)
        )
        record["baseline_first_losses"] = theirs
    ours_peak, base_peak = record.get("gpu_mem_peak_gib"), base.get("gpu_mem_peak_gib")
    if memory and ours_peak is not None and base_peak is not None:
        checked["peak_not_above_baseline"] = ours_peak <= base_peak * (1 + PEAK_SLACK)
        record["baseline_gpu_mem_peak_gib"] = base_peak
    record["checks"] = checked
    record["passed"] = all(checked.values())
    if not record["passed"] and "error" not in record:
        record["error"] = "failed checks: " + ", ".join(k for k, ok in checked.items() if not ok)
    return record


def isolation_problem(found: dict[str, Any]) -> str | None:
    """What is wrong with one kernel's doc_isolation result (None: nothing)."""
    if "error" in found:
        return str(found["error"])
    if not found["isolated"]:
        return "documents see each other"
    return None if found["leak_seen"] else "the planted leak is not seen"


def doc_isolation(ctx: Context) -> dict[str, Any]:
    """Every kernel the matrix uses keeps packed documents apart, and the check sees a planted leak."""
    sizes, folder = state(ctx).sizes, peer_inputs(ctx)
    kernels = ["sdpa"]
    if sizes.gpu:
        kernels.append("sdpa_flex")
        if importlib.util.find_spec("flash_attn") is not None:
            kernels.append("flash_attention_2")
    given = {"model-dir": folder / "model", "rows": folder / "rows.pt", "precision": sizes.precision}
    cpu = [] if sizes.gpu else ["--cpu"]
    cmd = module_cmd("bench.doc_isolation", *flags(given), "--kernels", *kernels, *cpu)
    run = launch(cmd, ctx.timeout(), ctx.work / "doc_isolation.log")
    ctx.results.log_launch("doc_isolation", run)
    line = next((ln for ln in reversed(run.output.splitlines()) if ln.startswith("ISOLATION ")), None)
    if line is None:
        return {"passed": False, "error": f"{run.ended} before a result", "tail": run.tail}
    found = json.loads(line.removeprefix("ISOLATION "))
    bad = [f"{k}: {why}" for k, v in found.items() if isinstance(v, dict) and (why := isolation_problem(v))]
    record = {**found, "kernels": kernels, "wall_s": run.wall_s, "passed": not bad}
    if bad:
        record["error"] = "; ".join(bad)
    return record


# --- the comparison lines ---------------------------------------------------------------------------------


def exact_mix(ctx: Context) -> list[dict[str, Any]]:
    """Passed llm_train variants on the mix, other than the baseline."""
    variants = {v.name for v in VARIANTS} - {"baseline"}
    return [r for n, r in ctx.done.items() if n in variants and r.get("passed") and r.get("data") == "mix"]


def side_by_side(ctx: Context) -> dict[str, Any] | str:
    """llm_train's baseline against the HF Trainer on the same rows: llm_train's step must be no slower."""
    ours, theirs = ctx.done.get("baseline", {}), ctx.done.get("hf_trainer", {})
    if not (ours.get("passed") and theirs.get("passed")):
        return "baseline and hf_trainer were not both measured"
    # The same rows on both sides: the step times compare directly. Tokens/s as slots on both sides
    # (llm_train's tokens_per_s counts real tokens, leaving out a packed row's unused tail; the
    # Trainer's peer counts micro-batch x row width), so the two figures measure the same thing.
    return {
        "llm_train_tokens_per_s": ours.get("slot_tokens_per_s") or ours["tokens_per_s"],
        "hf_trainer_tokens_per_s": theirs["tokens_per_s"],
        "ratio": theirs["step_time_s"] / ours["step_time_s"],
        "llm_train_step_time_s": ours["step_time_s"],
        "hf_trainer_step_time_s": theirs["step_time_s"],
    }


def best_mfu(ctx: Context) -> dict[str, Any] | str:
    """The best exact variant's document-aware MFU."""
    best = max(exact_mix(ctx), key=lambda r: r.get("mfu") or 0.0, default=None)
    if best is None:
        return "no document-aware variant measured in this run"
    return {"best": best["measurement"], "mfu": best["mfu"], "mfu_seq_len": best.get("mfu_seq_len")}


def best_vs_peer(ctx: Context) -> dict[str, Any] | str:
    """The fastest exact variant at the Trainer's micro-batch, over the Trainer's tokens/s."""
    peer, micro = ctx.done.get("hf_trainer", {}), state(ctx).sizes.micro
    ours = [r for r in exact_mix(ctx) if r["micro_batch"] == micro]
    fastest = max(ours, key=lambda r: r["tokens_per_s"], default=None)
    if fastest is None or not peer.get("passed"):
        return "no exact variant and the Trainer measured in this run"
    ratio = fastest["tokens_per_s"] / peer["tokens_per_s"]
    return {"best": fastest["measurement"], "tokens_per_s": fastest["tokens_per_s"], "ratio": ratio}


# --- the cases ------------------------------------------------------------------------------------------


def variant_case(variant: Variant) -> Case:
    def run(ctx: Context) -> dict[str, Any]:
        return run_variant(variant, ctx)

    return Case(variant.name, run, cost_s=variant.cost_s, box_s=variant.box_s, optional=True)


def line(name: str, inputs: Callable[[Context], dict[str, Any] | str], quantity: str, target: float) -> Case:
    """A line computed from the others (no launch: it costs nothing), its `quantity` judged against `target`;
    a deferred line where `inputs` finds what it compares not measured in this run (it says so)."""

    def run(ctx: Context) -> dict[str, Any]:
        record = inputs(ctx)
        if isinstance(record, str):
            return {"passed": None, "deferred": record}
        verdict = ctx.judging.against(name, quantity, record[quantity], target=target)
        return judge({**record, "passed": True}, [verdict])

    return Case(name, run, cost_s=0.0, box_s=0.0, optional=True)


BY_NAME: dict[str, Case] = {
    "baseline": variant_case(VARIANTS[0]),
    "hf_trainer": Case("hf_trainer", run_peer, cost_s=45, box_s=90, optional=True),
    "llm_train_vs_hf_trainer": line("llm_train_vs_hf_trainer", side_by_side, "ratio", 1.0),
    "doc_isolation": Case("doc_isolation", doc_isolation, cost_s=40, box_s=80, optional=True),
    **{v.name: variant_case(v) for v in VARIANTS[1:]},
    "target_mfu": line("target_mfu", best_mfu, "mfu", MFU_TARGET),
    "target_vs_hf_trainer": line("target_vs_hf_trainer", best_vs_peer, "ratio", PEER_RATIO_TARGET),
}
ORDER = list(BY_NAME)  # in order of value


def cases(names: list[str] | None = None) -> list[Case]:
    """The matrix's cases, in order of value (`names`: only these, in that order)."""
    return [BY_NAME[n] for n in (names or ORDER)]


def main() -> None:
    parser = check_arguments(__doc__.splitlines()[0])
    args = parser.parse_args()
    names = args.only or ORDER
    if unknown := [n for n in names if n not in BY_NAME]:
        parser.error(f"--only {unknown[0]}: not a case of the matrix; the cases are {', '.join(ORDER)}")
    gpu = not args.cpu_tiny
    results = Results("mfu_matrix", args.out, "" if gpu else "_cpu_tiny")
    results.stop_on_signals()
    budget = Budget(args.budget_s or (480.0 if gpu else 1800.0))
    with tempfile.TemporaryDirectory(prefix="llm_train_mfu_matrix_") as tmp:
        ctx = Context(gpu, Path(tmp), budget, results, Judging(gpu, injected(parser, args.expect)))
        run_cases(cases(names), ctx)
    results.write_summary()
    side = ctx.done.get("llm_train_vs_hf_trainer", {})
    if side.get("ratio"):
        print(
            f"mfu_matrix: llm_train {side['llm_train_tokens_per_s']:,.0f} tokens/s, HF Trainer "
            f"{side['hf_trainer_tokens_per_s']:,.0f} tokens/s on the same job: {side['ratio']:.2f}x",
            flush=True,
        )
    sys.exit(1 if results.failed else 0)


if __name__ == "__main__":
    main()
