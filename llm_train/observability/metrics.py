"""Step metrics: throughput, MFU, memory and start-up time, measured on every logged step.

The loop hands the meter each step's wall time (`record`) and asks for a row of metrics
at log steps (`flush`). Throughput is averaged over the steps since the last log, so a
logged number describes the whole window, not one possibly unlucky step, and time spent
in evaluation, checkpointing or logging never counts as training time.

MFU counts model FLOPs per token with llm_train.planning.speed.flops: 6N + 6*L*H*Q*T, with N the
parameters that take part in matmuls (the input embedding is a lookup, so it is left out
unless the output head shares it), L layers, H heads, Q head dim, T the span attention really
covers, causal attention counted as half of PaLM's (appendix B) full 12*L*H*Q*T, as Megatron-LM
does; planning/speed/flops.py says why. T is measured on the micro-batches this rank trained on since the last
log (data/model_inputs.span_sums: sum(n^2) / sum(n) over packed samples, or T = seq_len for rows that
hold one sequence): `mfu`. `mfu_seq_len` counts T = data.seq_len, the row width, as most tools do
(and as llm_train did before), so the two can be compared. It is measured against the device's
dense bf16 peak (llm_train.config.hardware) or `--peak-tflops`; without a known peak (CPU) there
is no MFU. Activation recomputation is not counted: that is hardware FLOPs utilisation, not MFU.

Tokens are the rows' real tokens, not their slots (data/model_inputs.real_tokens: padding and a packed row's
unused tail are not trained on; preference pairs count at the width they were built to): `tokens_per_s`
and `mfu` count those, this rank's times the data-parallel ranks (each trains its own share of the global
batch). `slot_tokens_per_s` beside them counts global batch x seq_len, as most tools report throughput.
A bitsandbytes 4-bit weight counts by its logical shape, `quant_state.shape` (its packed storage holds a
fraction of the weights' elements: a quarter with bf16 storage, an eighth with fp32, measured with
bitsandbytes 0.50.2), so a QLoRA run's MFU is comparable with the same model's 16-bit one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llm_train.config.hardware import peak_tflops
from llm_train.planning.speed.flops import TokenFlops, attention_span, token_flops
from llm_train.units import GiB

if TYPE_CHECKING:
    import psutil
    import torch
    from transformers import PreTrainedModel

    from llm_train.config.resolution import Resolved
    from llm_train.planning.model.shapes import ModelShape


def shape_token_flops(shape: ModelShape) -> TokenFlops:
    """`model_token_flops` from the config's shape alone (no model needed): every weight trained,
    the input embedding (a lookup, not a matmul) left out unless it is tied to the output head. Per token: the
    language model's weights only (an image-text model's vision part runs per image, not per token)."""
    embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return token_flops(
        shape.language_model_params - embedding, shape.num_layers, shape.num_heads, shape.head_dim
    )


def shape_flops_per_token(shape: ModelShape, seq_len: float) -> float:
    return shape_token_flops(shape).at(seq_len)


def _numel(param: torch.nn.Parameter) -> int:
    # A bitsandbytes Params4bit stores packed codes (a quarter of the weights' elements in bf16 storage); its
    # logical shape is quant_state.shape (bitsandbytes 0.50). Under ZeRO-3 the local tensor is an empty
    # shard; DeepSpeed keeps the full size in ds_numel.
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    if shape is not None:
        return math.prod(shape)
    return int(getattr(param, "ds_numel", 0) or param.numel())


def model_token_flops(model: PreTrainedModel) -> TokenFlops | None:
    """FLOPs per token of a Hugging Face causal LM as a function of the span, or None when its config lacks the shape."""
    config = getattr(model, "config", None)
    if config is not None:
        config = config.get_text_config()  # an image-text model's language model (its vision tower aside)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    embedding = None
    try:
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        if head is not None and head.weight is embedding:
            embedding = None  # tied: the same matrix is the output projection, a real matmul
    except (AttributeError, NotImplementedError):
        pass
    trainable = frozen = 0
    for param in model.parameters():
        if param is embedding:
            continue
        if param.requires_grad:
            trainable += _numel(param)
        else:
            frozen += _numel(param)
    return token_flops(trainable, int(layers), int(heads), int(head_dim), frozen=frozen)


def model_flops_per_token(model: PreTrainedModel, seq_len: float) -> float | None:
    """FLOPs per token of a Hugging Face causal LM trained on spans of `seq_len`, or None without a shape."""
    flops = model_token_flops(model)
    return flops.at(seq_len) if flops is not None else None


def peak_tflops_for(flag: float | None, cuda: bool) -> float | None:
    """The per-device peak for MFU: --peak-tflops wins, else the GPU table; None on CPU or unknown GPUs."""
    if flag:
        return float(flag)
    if not cuda:
        return None
    import torch

    return peak_tflops(torch.cuda.get_device_name(0))


def host_rss_gib() -> float:
    """Resident memory of this process (the host RAM it really holds), GiB."""
    try:
        return _process(os.getpid()).memory_info().rss / GiB
    except ImportError:  # psutil is a dependency, but a stripped environment should still train
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


@functools.cache
def _process(pid: int) -> psutil.Process:
    """psutil's handle of a process, made once per pid (a forked worker makes its own): making one reads
    /proc/PID/stat, ~64 of the ~90 us that `StepMeter.flush` took per logged step (psutil 7.2)."""
    import psutil

    return psutil.Process(pid)


def gpu_memory_gib() -> dict[str, float]:
    """This rank's CUDA allocator: live tensors, memory the allocator holds, and the peak since start."""
    import torch

    return {
        "gpu_mem_allocated_gib": torch.cuda.memory_allocated() / GiB,
        "gpu_mem_reserved_gib": torch.cuda.memory_reserved() / GiB,
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / GiB,
    }


class StartupClock:
    """Wall-clock marks from process start to the first optimizer step, written to startup.json.

    Marks are epoch seconds so that whoever launched the run in another process (a scheduler's log, a
    benchmark) can line them up with the moment it launched it.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.process_start = _process_start()
        self.marks: list[tuple[str, float]] = []

    @classmethod
    def start(cls, run_dir: Path) -> StartupClock:
        """Begin after the heavy imports, which are done here so that their cost is one phase.

        They would be imported a few lines later anyway (tokenizer, Accelerate, DeepSpeed);
        importing them up front only makes the start-up split readable.
        """
        import accelerate  # noqa: F401
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401

        clock = cls(run_dir / "startup.json" if os.environ.get("RANK", "0") == "0" else None)
        clock.mark("imports")
        return clock

    def mark(self, phase: str) -> None:
        """Record that `phase` (everything since the previous mark) has just ended."""
        self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        out: dict[str, float] = {}
        previous = self.process_start
        for phase, at in self.marks:
            out[phase] = out.get(phase, 0.0) + at - previous
            previous = at
        return out

    def total(self) -> float:
        return self.marks[-1][1] - self.process_start if self.marks else 0.0

    def save(self) -> None:
        if self.path is None:
            return
        record = {
            "process_start": self.process_start,
            "marks": dict(self.marks),
            "phases_s": self.phases(),
            "total_s": self.total(),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=2) + "\n")


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except ImportError:
        return time.time()


class StepMeter:
    """Turns per-step wall times into the throughput, MFU and memory fields of a metrics row."""

    def __init__(
        self,
        tokens_per_step: int,
        samples_per_step: int = 0,
        world_size: int = 1,
        flops: TokenFlops | None = None,
        seq_len: int = 0,
        peak_tflops: float | None = None,
        cuda: bool = False,
        clock: StartupClock | None = None,
        data_parallel: int = 1,
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.data_parallel = max(1, data_parallel)
        """Ranks that each train their own share of the batch: this rank's real tokens x this is the world's."""
        self.samples_per_step = samples_per_step
        self.world_size = max(1, world_size)
        self.flops = flops
        self.seq_len = seq_len
        self.peak_flops = peak_tflops * 1e12 if peak_tflops else None
        self.cuda = cuda
        self.clock = clock
        self.started = time.perf_counter()
        self._steps = 0
        self._seconds = 0.0
        self._squared = 0
        self._span_tokens = 0
        self._real_tokens = 0
        self._first_step_seen = False
        self._startup_logged = False

    @classmethod
    def for_run(
        cls,
        run: Resolved,
        flops: TokenFlops | None,
        peak_tflops: float | None = None,
        clock: StartupClock | None = None,
    ) -> StepMeter:
        """The meter of a training run: its batch arithmetic, the model's FLOPs and the device's peak."""
        import torch

        layout = run.layout
        cuda = torch.cuda.is_available()
        return cls(
            # A preference pair trains two sequences (chosen and rejected).
            tokens_per_step=layout.global_batch_size
            * run.recipe.sequences_per_sample
            * run.recipe.data.seq_len,
            samples_per_step=layout.global_batch_size,
            world_size=layout.world_size,
            flops=flops,
            seq_len=run.recipe.data.seq_len,
            peak_tflops=peak_tflops_for(peak_tflops, cuda),
            cuda=cuda,
            clock=clock,
            data_parallel=layout.dp,
        )

    def record(
        self, step_time: float, squared_lengths: int = 0, span_tokens: int = 0, real_tokens: int = 0
    ) -> None:
        """One optimizer step took `step_time` seconds (forward, backward and update; nothing else) on
        micro-batches whose documents' lengths n give sum(n^2) = `squared_lengths`, sum(n) = `span_tokens`
        (data/model_inputs.span_sums; 0, 0 when not measured: the span is then seq_len), `real_tokens` of them
        not padding (data/model_inputs.real_tokens; 0 when not measured: every slot counts)."""
        if not self._first_step_seen:
            self._first_step_seen = True
            if self.clock is not None:
                self.clock.mark("first step")
                self.clock.save()
        self._steps += 1
        self._seconds += step_time
        self._squared += squared_lengths
        self._span_tokens += span_tokens
        self._real_tokens += real_tokens

    def flush(self) -> dict[str, float]:
        """Metrics over the steps recorded since the last flush (throughput), and now (memory)."""
        row: dict[str, float] = {}
        if self._steps and self._seconds > 0:
            step_time = self._seconds / self._steps
            slot_tokens_per_s = self.tokens_per_step / step_time
            tokens_per_s = (
                self._real_tokens * self.data_parallel / self._seconds
                if self._real_tokens
                else slot_tokens_per_s
            )
            row["tokens_per_s"] = tokens_per_s
            row["slot_tokens_per_s"] = slot_tokens_per_s
            row["tokens_per_s_per_gpu"] = tokens_per_s / self.world_size
            if self.samples_per_step:
                row["samples_per_s"] = self.samples_per_step / step_time
            row["step_time_s"] = step_time
            span = attention_span(self._squared, self._span_tokens) or float(self.seq_len)
            if self.flops is not None and span:
                row["attention_span"] = span
            if self.flops is not None and self.peak_flops and span:
                per_gpu = tokens_per_s / self.world_size / self.peak_flops
                row["mfu"] = per_gpu * self.flops.at(span)
                # As most tools count it: every slot, at the row width.
                row["mfu_seq_len"] = (
                    slot_tokens_per_s / self.world_size / self.peak_flops * self.flops.at(self.seq_len)
                )
        if self.cuda:
            row.update(gpu_memory_gib())
        row["host_rss_gib"] = host_rss_gib()
        row["elapsed_s"] = time.perf_counter() - self.started
        if self.clock is not None and self._first_step_seen and not self._startup_logged:
            self._startup_logged = True
            row["startup_s"] = self.clock.total()  # process start to the end of the first step, once
        self._steps, self._seconds, self._squared, self._span_tokens, self._real_tokens = 0, 0.0, 0, 0, 0
        return row
