"""The longest sequence that fits: how long a context a model can be trained on, per number of GPUs.

`longest_sequence` bisects data.seq_len (in steps of SEQ_STEP tokens) for the largest length at which
one configuration of a fixed family fits the hardware (planning.search.candidate.evaluate: GPU memory within its
headroom, host RAM within its reserve). The family, the assumptions docs/long-context.md's table states:

- a full fine-tune in bf16, micro-batch 1 (one sequence per step and data-parallel rank), activation
  checkpointing on, flash-attention-class kernels (sdpa / flash_attention_2: no s x s matrix);
- ZeRO-3, with whichever shipped offload level fits longest: none, the optimizer on the CPU, or the
  optimizer and the weights (ds_configs/zero3, zero3_offload_optimizer, zero3_offload);
- without ALST: nothing else; with ALST: Ulysses sequence parallelism over the largest degree that
  divides the GPUs per node and the attention and KV heads, and whichever of the tiled MLP, the
  tiled loss and the activation checkpoints offloaded to host RAM fit longest (offloading the
  checkpoints trades GPU memory for host RAM, so where host RAM is the limit it can cost length).

The memory of a configuration grows with the sequence in every term, so fitting is monotone in
seq_len and bisection finds the boundary. `bench/long_context_table.py` prints `long_context_table()`,
the table in docs/long-context.md ("The longest sequence per GPU count").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llm_train.config.hardware import Hardware, hardware_for
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import ModelShape, shape_of
from llm_train.planning.search.candidate import SHIPPED_DS_CONFIGS, Evaluation, evaluate
from llm_train.planning.search.fixes import long_context_text, sequence_parallel_degrees
from llm_train.units import GiB

# Sequence lengths are multiples of this: divisible by every Ulysses degree up to 8 (and 1024 is
# how context lengths are quoted).
SEQ_STEP = 1024
# Bisection ceiling: 16M tokens, far past what any configuration here fits.
MAX_SEQ = 1 << 24
ZERO3_MODES = ((3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"))

# The table's rows: (GPUs, GPU model, host RAM GiB per node). H100 rows get a share of an 8-GPU
# node's 2 TiB (DGX H100, AWS p5.48xlarge: 256 GiB per GPU); the 24 GB card a 192 GiB desktop (a full
# 8B fine-tune keeps ~120 GiB of fp32 optimizer states on the host).
TABLE_ROWS: tuple[tuple[int, str, float], ...] = (
    (1, "H100", 256),
    (2, "H100", 512),
    (4, "H100", 1024),
    (8, "H100", 2048),
    (1, "RTX-4090", 192),
)


@dataclass(frozen=True)
class LongestFit:
    """The longest sequence one family of configurations fits on `hardware` (seq_len 0: none fits)."""

    hardware: Hardware
    alst: bool
    seq_len: int
    evaluation: Evaluation | None


def candidates(shape: ModelShape, hw: Hardware, seq_len: int, alst: bool) -> list[MemoryInputs]:
    """The family of the module docstring at one sequence length: each ZeRO-3 offload level (and with
    ALST each combination of the memory switches)."""
    out = []
    switches = list(itertools.product((False, True), repeat=3)) if alst else [(False, False, False)]
    for (stage, optimizer, params), (tiled_mlp, tiled_loss, offload) in itertools.product(
        ZERO3_MODES, switches
    ):
        inp = MemoryInputs.of(
            shape=shape,
            world_size=hw.gpus,
            zero_stage=stage,
            offload_optimizer=optimizer,
            offload_params=params,
            precision="bf16",
            micro_batch=1,
            gpus_per_node=hw.gpus_per_node,
            seq_len=seq_len,
            activation_checkpointing=True,
            attn_impl="sdpa",
        )
        if alst:
            sp = max(sequence_parallel_degrees(inp))
            inp = inp.vary(sp=sp, tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, offload_checkpoints=offload)
        out.append(inp)
    return out


def best_fit(shape: ModelShape, hw: Hardware, seq_len: int, alst: bool) -> Evaluation | None:
    """The fastest candidate that fits at `seq_len`, or None."""
    fitting = [e for e in (evaluate(c, hw) for c in candidates(shape, hw, seq_len, alst)) if e.fits]
    return min(fitting, key=lambda e: e.time.total) if fitting else None


def longest_sequence(shape: ModelShape, hw: Hardware, alst: bool) -> LongestFit:
    """The largest multiple of SEQ_STEP (up to MAX_SEQ) at which a candidate fits."""
    if best_fit(shape, hw, SEQ_STEP, alst) is None:
        return LongestFit(hw, alst, 0, None)
    lo, hi = 1, MAX_SEQ // SEQ_STEP + 1  # in steps: lo fits, hi does not (or is past the ceiling)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if best_fit(shape, hw, mid * SEQ_STEP, alst) is None:
            hi = mid
        else:
            lo = mid
    return LongestFit(hw, alst, lo * SEQ_STEP, best_fit(shape, hw, lo * SEQ_STEP, alst))


def long_context_table(
    model: str = "meta-llama/Llama-3.1-8B", rows: tuple[tuple[int, str, float], ...] = TABLE_ROWS
) -> list[tuple[LongestFit, LongestFit]]:
    """(without ALST, with ALST) for each row of (GPUs, GPU model, host RAM GiB per node)."""
    shape = shape_of(model)
    out = []
    for gpus, gpu, host_gib in rows:
        hw = hardware_for(gpus, gpu, None, host_gib, None, detect=False)
        out.append((longest_sequence(shape, hw, alst=False), longest_sequence(shape, hw, alst=True)))
    return out


def _tokens(n: int) -> str:
    return f"{n // 1024:,}k" if n else "none"


def _how(fit: LongestFit) -> str:
    if fit.evaluation is None:
        return "-"
    c, ev = fit.evaluation.inputs, fit.evaluation
    ds = SHIPPED_DS_CONFIGS[c.ds_key]
    parts = [ds] + ([long_context_text(c)] if c.uses_long_context else [])
    return f"{', '.join(parts)}: GPU {ev.device_bytes / GiB:.1f} GiB, host {ev.host_bytes / GiB:.0f} GiB"


def render_table(model: str, table: list[tuple[LongestFit, LongestFit]]) -> str:
    """docs/long-context.md's Markdown table: the longest sequence per hardware row, without and with ALST."""
    lines = [
        f"| GPUs ({model}) | host RAM | longest without ALST | longest with ALST | with ALST: configuration, memory |",
        "|---|---|---|---|---|",
    ]
    for plain, alst in table:
        hw = alst.hardware
        lines.append(
            f"| {hw.gpus} x {hw.name} ({hw.gpu_mem_bytes / GiB:.0f} GiB) | {hw.host_ram_bytes / GiB:,.0f} GiB "
            f"| {_tokens(plain.seq_len)} | {_tokens(alst.seq_len)} | {_how(alst)} |"
        )
    return "\n".join(lines)
