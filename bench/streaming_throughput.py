"""Streaming sources against the tokenise-first path: trained tokens/s served, side by side in one run.

    .venv/bin/python bench/streaming_throughput.py [--mb 20] [--seq-len 2048] [--files 4]

Writes a JSON-lines corpus (data_pipeline.py's: the bundled paragraphs, log-normal lengths)
split into --files shards, then serves one pass of it as micro-batches of 8 sequences on one
data-parallel rank:

  tokenise-first, cold   prepare_data on an empty cache (tokenise + pack everything, automatic
                         num_proc), then BatchStream: what a first run pays before and while training;
  tokenise-first, warm   BatchStream on the cached arrays: every later run;
  streaming, W workers   StreamingBatches (`streaming: true`): windows read through datasets'
                         streaming mode, tokenised and packed on the fly by W DataLoader workers
                         (0: in the training process itself).

For each: wall seconds to the first batch and for the pass, trained tokens/s (label positions,
counted the same way for both paths), the training process's own CPU seconds (what the model
competes with; workers' CPU is not in it), and trained tokens per sequence slot (packing). A benchmark, not a test:
it prints numbers, never fails. Writes bench/results/streaming-throughput-<date>.txt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from data_pipeline import write_corpus  # bench/ is this script's folder

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llm_train.config.recipe import DataSection  # noqa: E402
from llm_train.data import BatchStream, StreamingBatches, StreamSpec, prepare_data  # noqa: E402

MICRO = 8
TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"


def shard(corpus: Path, folder: Path, files: int) -> None:
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    folder.mkdir()
    per = -(-len(lines) // files)
    for f in range(files):
        (folder / f"part-{f:02d}.jsonl").write_text("".join(lines[f * per : (f + 1) * per]), encoding="utf-8")


def serve(stream: Any, sequences: int, seq_len: int) -> dict[str, float]:
    """Pull micro-batches until `sequences` are served; wall and this process's CPU, first batch apart."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    first = None
    trained = served = 0
    while served < sequences:
        batch = next(stream)
        if first is None:
            first = time.perf_counter() - wall0
        labels = batch["labels"]
        trained += int((labels != -100).sum())
        served += labels.shape[0]
    wall = time.perf_counter() - wall0
    return {
        "first": first or 0.0,
        "wall": wall,
        "cpu": time.process_time() - cpu0,
        "trained": trained,
        "sequences": served,
        "slots": served * seq_len,
    }


def line(name: str, r: dict[str, float], before: float = 0.0, base: float | None = None) -> str:
    wall = r["wall"] + before
    rate = r["trained"] / wall
    ratio = f"  {rate / base:5.2f}x tokenise-first cold" if base else ""
    return (
        f"{name:<28}{rate:>12,.0f} trained tokens/s  first batch {r['first'] + before:6.2f}s  pass {wall:6.1f}s "
        f"wall  {r['cpu']:6.1f}s CPU in the training process{ratio}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    started = datetime.now(timezone.utc)
    load = os.getloadavg()[0]
    try:
        corpus = tmp / "corpus.jsonl"
        rows = write_corpus(corpus, args.mb)
        folder = tmp / "shards"
        shard(corpus, folder, args.files)
        common = {"seq_len": args.seq_len, "eval_fraction": 0.0, "cache_dir": str(tmp / "cache")}

        data = DataSection.model_validate({"train": [str(folder)], **common})
        t0, c0 = time.perf_counter(), time.process_time()
        split = prepare_data(data, tokenizer, seed=0).train
        prepare_s, prepare_cpu = time.perf_counter() - t0, time.process_time() - c0
        n = split.n_sequences
        cold = serve(BatchStream(split, MICRO, 0, 1, seed=0, workers=0), n, args.seq_len)
        cold["cpu"] += prepare_cpu  # num_proc workers' CPU is not counted, as for streaming's
        warm = serve(BatchStream(split, MICRO, 0, 1, seed=0, workers=0), n, args.seq_len)
        base = cold["trained"] / (cold["wall"] + prepare_s)
        out = [
            f"# .venv/bin/python bench/streaming_throughput.py --mb {args.mb:g} --seq-len {args.seq_len} "
            f"--files {args.files}   ({started:%Y-%m-%dT%H:%MZ}; commit {_commit()}; {os.cpu_count()} CPUs, "
            f"load average {load:.2f} at start)",
            f"corpus: {args.mb:g} MB in {args.files} jsonl files, {rows:,} rows; seq_len {args.seq_len}; "
            f"one pass = {n:,} packed sequences, micro-batch {MICRO}, one data-parallel rank",
            line("tokenise-first, cold", cold, prepare_s) + f"  (prepare_data {prepare_s:.1f}s of it)",
            line("tokenise-first, warm", warm, 0.0, base),
        ]
        efficiency = {"tokenise-first": cold["trained"] / cold["slots"]}
        stream_data = DataSection.model_validate(
            {"train": [{"path": str(folder), "streaming": True}], **common}
        )
        for workers in args.workers:
            spec = StreamSpec.build(stream_data, tokenizer, 0)
            result = serve(StreamingBatches(spec, MICRO, 0, 1, workers=workers), n, args.seq_len)
            out.append(line(f"streaming, {workers} workers", result, 0.0, base))
            efficiency["streaming"] = result["trained"] / result["slots"]
        out.append(
            "trained tokens per sequence slot: "
            + ", ".join(f"{k} {v:.1%}" for k, v in efficiency.items())
            + " (streaming packs per window of 1000 rows, tokenise-first per source)"
        )
        out.append(
            f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (shared machine)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = "\n".join(out) + "\n"
    print(text, end="")
    results = REPO / "bench" / "results" / f"streaming-throughput-{started:%Y%m%d-%H%M}.txt"
    results.write_text(text)
    print(f"written to {results.relative_to(REPO)}")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
