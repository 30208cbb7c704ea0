"""What a QLoRA base staged on the host costs under ZeRO-3, measured against the planner, on CPU.

    .venv/bin/python bench/qlora_staged_load.py [--layers 16] [--hidden 1024] [--intermediate 3584]

Under ZeRO-3 an nf4 base loads onto the host, whole on every rank, and is partitioned from there
(runtime/quantize.py). This measures, for a synthetic Llama saved in bf16 (in a fresh process, so its
peak is the load's own):
- the host RSS the quantised load adds (VmRSS after - before) and its peak (VmHWM - VmRSS before),
  split into anonymous memory (RssAnon: what the process holds) and file-backed pages (RssFile: the
  memory-mapped checkpoint, page cache the kernel may drop), against the planner's bytes of the
  staged base (planning/quantized.base_weight_bytes): the `model_load_peak` line of a QLoRA ZeRO-3
  plan counts one of them per rank, plus the checkpoint shard being read;
- the packed bytes and the quantisation state on the parameters, against the planner's
  NF4_PACKED_BYTES_PER_WEIGHT and NF4_STATE_BYTES_PER_WEIGHT;
- how fast bitsandbytes quantises on this CPU (weights per second, all threads torch uses here).
One JSON object, written to bench/results/qlora-staged-load-<date>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import REPO, proc_kib_field, versions, write_result  # bench/ is this script's folder


def save_model(path: Path, layers: int, hidden: int, intermediate: int) -> dict[str, Any]:
    """A random Llama-3-like model (head dim 128, 4 query heads per key/value head), in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": max(1, hidden // 512),
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }
    config = AutoConfig.for_model("llama", **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
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


def measure_load(path: str) -> dict[str, Any]:
    """In this process: the staged load of `path` as a ZeRO-3 QLoRA run makes it (bf16, device_map cpu)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llm_train.config.recipe import LoraSection
    from llm_train.planning.quantized import (
        NF4_PACKED_BYTES_PER_WEIGHT,
        NF4_STATE_BYTES_PER_WEIGHT,
        base_weight_bytes,
        quantized_weight_params,
    )
    from llm_train.planning.shapes import shape_from_config
    from llm_train.runtime.quantize import quantization_config, quantized_base

    before = proc_kib_field("/proc/self/status", "VmRSS") or 0
    anon_before = proc_kib_field("/proc/self/status", "RssAnon") or 0
    sampler = AnonPeak()
    started = time.perf_counter()
    with sampler:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.bfloat16,
            device_map={"": "cpu"},
            quantization_config=quantization_config(LoraSection(quantize="nf4"), torch.bfloat16),
        )
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
    planned = base_weight_bytes(shape, "nf4", 2)
    return {
        "quantized_weights": weights,
        "load_seconds": round(seconds, 2),
        "quantize_weights_per_s": round(weights / seconds),
        "rss_added_bytes": after - before,
        "rss_peak_added_bytes": peak - before,
        "anonymous_rss_added_bytes": anon_after - anon_before,
        "anonymous_rss_peak_added_bytes": sampler.peak - anon_before,
        "file_backed_rss_bytes": file_after,
        "planned_staged_bytes": round(planned),
        "anonymous_rss_added_over_planned": round((anon_after - anon_before) / planned, 3),
        "anonymous_rss_added_after_malloc_trim_bytes": anon_trimmed - anon_before,
        "packed_bytes_per_weight": round(base.packed / weights, 5),
        "planned_packed_bytes_per_weight": NF4_PACKED_BYTES_PER_WEIGHT,
        "state_bytes_per_weight": round(base.state / weights, 5),
        "planned_state_bytes_per_weight": round(NF4_STATE_BYTES_PER_WEIGHT, 5),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the child process: measure this directory
    args = parser.parse_args()
    if args.load:
        print(json.dumps(measure_load(args.load)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        fields = save_model(Path(tmp), args.layers, args.hidden, args.intermediate)
        child = subprocess.run(
            [sys.executable, __file__, "--load", tmp], cwd=REPO, capture_output=True, text=True, check=True
        )
    record = {"model": fields, **json.loads(child.stdout.strip().splitlines()[-1]), "versions": versions()}
    print(json.dumps(record, indent=2))
    write_result("qlora-staged-load", record)


if __name__ == "__main__":
    main()
