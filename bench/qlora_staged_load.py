"""What a QLoRA base staged on the host under ZeRO-3 costs to load, measured against the planner.

    .venv/bin/python -m bench.qlora_staged_load [--staging cpu|cuda] [--layers 16] [--hidden 1024]
        [--intermediate 3584] [--vocab 32000] [--out DIR]

Under ZeRO-3 an nf4 base loads onto the host, whole on every rank, each weight quantised on the run's
device as it loads (runtime/model/quantized_base.py `quantizing_on`), and is partitioned from there. This measures
that load for a synthetic Llama saved in bf16 (in a fresh process, so its peaks are the load's own),
with the weights quantised on `--staging` (cpu: a CPU run, bitsandbytes' CPU backend; cuda: a GPU run):
- the host RSS the load adds (VmRSS after - before) and its peak (VmHWM - VmRSS before), split into
  anonymous memory (RssAnon: what the process holds) and file-backed pages (RssFile: the memory-mapped
  checkpoint, page cache the kernel may drop), against the planner's bytes of the staged base
  (planning/quantized.base_weight_bytes) and its `model_load_peak` line for one rank quantising there;
- with --staging cuda, the allocator's peak during the load (torch.cuda.max_memory_allocated) and what
  stays on the GPU after it (the quantisation state), against the planner's
  (quantized.staged_quantize_gpu_bytes, quantization_state_bytes); where the codes and the state ended;
- the packed bytes and the quantisation state on the parameters, against the planner's
  NF4_PACKED_BYTES_PER_WEIGHT and NF4_STATE_BYTES_PER_WEIGHT;
- how fast the load quantises (weights per second; on the CPU with all threads torch uses here), and the
  planner's start-up time for it (planning/speed/step_time.staged_load: the drive's read and the copies).
One JSON object, written to DIR/qlora-staged-load.json (--out) or bench/results/qlora-staged-load-<date>.json.
bench/gpu_run.sh B runs it with --staging cuda on an 8B base (bench/consumer.py `staged_load_case`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.environment import REPO, versions, write_result
from bench.watch import proc_kib_field


def save_model(
    path: Path, layers: int, hidden: int, intermediate: int, vocab: int, device: str
) -> dict[str, Any]:
    """A random Llama-3-like model (head dim 128, 4 query heads per key/value head), in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 128),
        "num_key_value_heads": max(1, hidden // 512),
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    config = AutoConfig.for_model("llama", **fields)
    torch.manual_seed(0)
    with torch.device(device):  # drawn on the GPU where there is one: seconds, not minutes, for an 8B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="5GB")  # the hub's shards
    return fields


class AnonPeak:
    """The largest RssAnon seen while the block runs, sampled every 5 ms (VmHWM counts file pages too)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, proc_kib_field("/proc/self/status", "RssAnon") or 0)

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def planned(shape: Any, staging: str) -> dict[str, Any]:
    """The planner's figures for one rank loading this base, quantised on `staging`."""
    from llm_train.config.hardware import NVME_READ_BYTES_PER_S, hardware_for
    from llm_train.planning.memory.host import model_load_peak_bytes
    from llm_train.planning.memory.inputs import MemoryInputs
    from llm_train.planning.memory.model_split import model_split
    from llm_train.planning.memory.quantized_bytes import (
        NF4_PACKED_BYTES_PER_WEIGHT,
        NF4_STATE_BYTES_PER_WEIGHT,
        base_weight_bytes,
        quantization_state_bytes,
        staged_quantize_gpu_bytes,
    )
    from llm_train.planning.speed.step_time import DEFAULT_PCIE_BYTES_PER_S, staged_load

    where = "gpu" if staging == "cuda" else "cpu"
    inp = MemoryInputs.of(shape, 1, zero_stage=3, lora_rank=8, quantize="nf4", quantize_on=where)
    # The GPU machine this case is written for (bench/gpu_run.sh B); any other card's link is its own.
    link = (
        hardware_for(1, "H200", detect=False).pcie_bytes_per_s if where == "gpu" else DEFAULT_PCIE_BYTES_PER_S
    )
    load = staged_load(inp, NVME_READ_BYTES_PER_S, link)
    assert load is not None
    return {
        "planned_staged_bytes": round(base_weight_bytes(shape, "nf4", 2)),
        "planned_model_load_peak_bytes": round(model_load_peak_bytes(inp, model_split(inp))),
        "planned_gpu_load_peak_bytes": round(staged_quantize_gpu_bytes(shape, 2)) if where == "gpu" else None,
        "planned_gpu_state_bytes": round(quantization_state_bytes(shape, "nf4")) if where == "gpu" else None,
        "planned_load_seconds": round(load.total, 2),
        "planned_load_read_seconds": round(load.read, 2),
        "planned_packed_bytes_per_weight": NF4_PACKED_BYTES_PER_WEIGHT,
        "planned_state_bytes_per_weight": round(NF4_STATE_BYTES_PER_WEIGHT, 5),
    }


def measure_load(path: str, staging: str) -> dict[str, Any]:
    """In this process: the staged load of `path` as a ZeRO-3 QLoRA run makes it (bf16, device_map cpu)."""
    import ctypes

    import bitsandbytes  # noqa: F401  # its libraries loaded before the baseline, as the run's are
    import torch
    from transformers import AutoModelForCausalLM

    from llm_train.config.recipe_sections import LoraSection
    from llm_train.planning.memory.quantized_bytes import quantized_weight_params
    from llm_train.planning.model.shapes import shape_from_config
    from llm_train.runtime.model.quantized_base import (
        Staging,
        is_quantized_linear,
        quantization_config,
        quantized_base,
        quantizing_on,
    )

    gpu = staging == "cuda"
    if gpu:  # the CUDA context (host and device memory) before the baseline: a run has it before it loads
        torch.ones(1, device="cuda")
        torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated() if gpu else 0
    before = proc_kib_field("/proc/self/status", "VmRSS") or 0
    anon_before = proc_kib_field("/proc/self/status", "RssAnon") or 0
    sampler = AnonPeak()
    started = time.perf_counter()
    with sampler, quantizing_on(Staging(staging)):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.bfloat16,
            device_map={"": "cpu"},
            quantization_config=quantization_config(LoraSection(quantize="nf4"), torch.bfloat16),
        )
        if gpu:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    after = proc_kib_field("/proc/self/status", "VmRSS") or 0
    anon_after = proc_kib_field("/proc/self/status", "RssAnon") or 0
    file_after = proc_kib_field("/proc/self/status", "RssFile") or 0
    # What of the anonymous memory is glibc's free lists (the loader's freed temporaries, kept by malloc's
    # arenas for reuse within this process) rather than live tensors.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    anon_trimmed = proc_kib_field("/proc/self/status", "RssAnon") or 0
    peak = proc_kib_field("/proc/self/status", "VmHWM") or 0
    shape = shape_from_config(model.config.to_dict())
    base = quantized_base(model)
    weights = quantized_weight_params(shape)
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    record: dict[str, Any] = {
        "staging": staging,
        "quantized_weights": weights,
        "load_seconds": round(seconds, 2),
        "quantize_weights_per_s": round(weights / seconds),
        "rss_added_bytes": after - before,
        "rss_peak_added_bytes": peak - before,
        "anonymous_rss_added_bytes": anon_after - anon_before,
        "anonymous_rss_peak_added_bytes": sampler.peak - anon_before,
        "file_backed_rss_bytes": file_after,
        "anonymous_rss_added_after_malloc_trim_bytes": anon_trimmed - anon_before,
        "codes_on": sorted({m.weight.device.type for m in layers}),
        "state_on": sorted({m.weight.quant_state.absmax.device.type for m in layers}),
        "gpu_allocated_peak_bytes": torch.cuda.max_memory_allocated() - gpu_before if gpu else None,
        "gpu_allocated_after_bytes": torch.cuda.memory_allocated() - gpu_before if gpu else None,
        "packed_bytes_per_weight": round(base.packed / weights, 5),
        "state_bytes_per_weight": round(base.state / weights, 5),
        "torch_threads": torch.get_num_threads(),
        **planned(shape, staging),
    }
    record["anonymous_rss_added_over_planned"] = round(
        record["anonymous_rss_added_bytes"] / record["planned_staged_bytes"], 3
    )
    record["anonymous_rss_peak_over_planned_load_peak"] = round(
        record["anonymous_rss_peak_added_bytes"] / record["planned_model_load_peak_bytes"], 3
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staging", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--out", type=Path, help="Write DIR/qlora-staged-load.json (default: bench/results/, dated)."
    )
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the child process: measure this directory
    args = parser.parse_args()
    if args.load:
        print(json.dumps(measure_load(args.load, args.staging)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        fields = save_model(Path(tmp), args.layers, args.hidden, args.intermediate, args.vocab, args.staging)
        written = time.perf_counter() - started
        child = subprocess.run(
            [sys.executable, "-m", "bench.qlora_staged_load", "--load", tmp, "--staging", args.staging],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    if child.returncode != 0:
        sys.exit(f"qlora_staged_load: the load failed (exit {child.returncode})\n{child.stderr[-3000:]}")
    record = {
        "model": fields,
        "base_written_s": round(written, 1),
        **json.loads(child.stdout.strip().splitlines()[-1]),
        "versions": versions(),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "qlora-staged-load.json").write_text(json.dumps(record, indent=2) + "\n")
    else:
        write_result("qlora-staged-load", record)


if __name__ == "__main__":
    main()
