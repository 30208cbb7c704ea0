"""The data layer's two benchmarks, side by side in one run each: tokenise + pack, and streaming.

    .venv/bin/python -m bench.data pipeline [--mb 50] [--seq-len 2048] [--corpus paragraphs|python-files]
    .venv/bin/python -m bench.data streaming [--mb 20] [--seq-len 2048] [--files 4]

`pipeline` writes a ~50 MB JSON-lines corpus with a realistic length spread (log-normal, median ~230
tokens, a long tail past seq_len) built from the bundled Python-reference paragraphs, then
measures, in the same run and on the same file:

  naive     json.loads + tokenizer(text) per row, then next-fit packing in arrival order
            (the loop most scripts start with);
  pipeline  llm_train.data.prepare_data on a cold cache: datasets' Arrow JSON reader, a batched
            map (num_proc workers) through the per-word tokenisation memo (data/tokenize_memo.py:
            the tokenizer's exact ids: the run asserts that its token stream hashes like the naive
            loop's), flat memory-mapped arrays, best-fit-decreasing
            packing; once with one process and once with the automatic num_proc, and once with one
            process and data.tokenize_memo=false (the tokenizer alone: what the memo buys);
  warm      the same prepare_data again: the cache hit a second training run pays.

Prints wall-clock tokens/s and its ratio to naive, CPU seconds (this process and its workers:
the work done, whatever else the machine is running) and packing efficiency (real tokens /
sequence slots). The tokenizer's own threads are switched off so every variant uses the
cores it names (one, or num_proc). A benchmark, not a test: it prints ratios, never fails.

`streaming` writes a JSON-lines corpus (`pipeline`'s: the bundled paragraphs, log-normal lengths)
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
import hashlib
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from bench.environment import ASSETS, REPO, TOKENIZER

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llm_train.config.recipe_sections import DataSection
from llm_train.data import BatchStream, StreamingBatches, StreamSpec, prepare_data  # noqa: E402

PIPELINE = (
    "Tokenise + pack throughput of llm_train's data pipeline against a naive one-sample-at-a-time loop."
)
STREAMING = "Streaming sources against the tokenise-first path: trained tokens/s served, side by side."


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSON lines with a log-normal length spread; returns the number of rows."""
    paragraphs = [p for p in (ASSETS / "corpus.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    target = int(megabytes * 1e6)
    written = rows = 0
    with path.open("w", encoding="utf-8") as handle:
        while written < target:
            # ~4 characters per token for this tokenizer: median ~900 chars ~ 230 tokens; p99 ~ 9,000 tokens.
            chars = int(np.clip(rng.lognormal(np.log(900), 1.1), 20, 120_000))
            parts, size = [], 0
            while size < chars:
                piece = paragraphs[int(rng.integers(len(paragraphs)))]
                parts.append(piece)
                size += len(piece) + 2
            line = json.dumps({"id": rows, "text": "\n\n".join(parts)[:chars]}) + "\n"
            handle.write(line)
            written += len(line.encode())
            rows += 1
    return rows


def write_python_files(path: Path, megabytes: float) -> int:
    """JSON lines, one per .py file of the standard library then the installed packages (sorted paths).

    Real text (code, comments, docstrings) that repeats far less than the paragraph corpus:
    a fair test for a tokeniser that memoises words.
    """
    import sysconfig

    target = int(megabytes * 1e6)
    written = rows = 0
    with path.open("w", encoding="utf-8") as handle:
        for root in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
            for file in sorted(Path(root).rglob("*.py")):
                try:
                    text = file.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if written >= target:
                    return rows
                if text.strip():
                    line = json.dumps({"text": text}) + "\n"
                    handle.write(line)
                    written += len(line.encode())
                    rows += 1
    return rows


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the map workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def stream_digest(ids: np.ndarray) -> str:
    """Hash of a token stream (every row's ids end to end, in file order) as int32."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()


def naive(path: Path, tokenizer, seq_len: int) -> tuple[int, float, float, str]:
    """(tokens, seconds, packing efficiency, stream digest) of the one-sample-at-a-time loop."""
    eos = tokenizer.eos_token_id
    started = time.perf_counter()
    sequences: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            ids = tokenizer(json.loads(line)["text"])["input_ids"] + [eos]
            tokens += len(ids)
            for start in range(0, len(ids), seq_len):  # over-long: seq_len pieces
                piece = ids[start : start + seq_len]
                if len(current) + len(piece) > seq_len:
                    sequences.append(current)
                    current = []
                current.extend(piece)
    if current:
        sequences.append(current)
    seconds = time.perf_counter() - started
    # Next-fit keeps file order, so the sequences end to end are the token stream (hashed untimed).
    digest = stream_digest(
        np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int32, count=tokens)
    )
    return tokens, seconds, tokens / (len(sequences) * seq_len), digest


def pipeline(
    path: Path, tokenizer, seq_len: int, cache: Path, num_proc: int | None, memo: bool = True
) -> tuple[int, float, float, float]:
    """(tokens, cold seconds, warm seconds, packing efficiency, stream digest) of prepare_data."""
    from llm_train.config.recipe_sections import DataSection
    from llm_train.data import prepare_data

    shutil.rmtree(cache, ignore_errors=True)
    data = DataSection.model_validate(
        {
            "train": [str(path)],
            "eval_fraction": 0.0,
            "seq_len": seq_len,
            "cache_dir": str(cache),
            "num_proc": num_proc,
            "tokenize_memo": memo,
        }
    )
    started = time.perf_counter()
    prepared = prepare_data(data, tokenizer, seed=0)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    prepare_data(data, tokenizer, seed=0)
    warm = time.perf_counter() - started
    stats = prepared.train.parts[0].stats
    store = prepared.train.parts[0].store
    store_tokens = int(store.offsets[-1])
    return store_tokens, cold, warm, stats["efficiency"], stream_digest(store.input_ids[:store_tokens])


def pipeline_main(argv: list[str]) -> int:
    """`pipeline`: tokenise + pack throughput against the naive loop (the module docstring)."""
    parser = argparse.ArgumentParser(prog="bench.data pipeline", description=PIPELINE)
    parser.add_argument("--mb", type=float, default=50.0, help="Corpus size in MB (default 50).")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--corpus",
        choices=["paragraphs", "python-files"],
        default="paragraphs",
        help="paragraphs: the bundled corpus' paragraphs drawn at random (the issue's benchmark; its ~0.5 MB "
        "of paragraphs repeat, so words repeat more than in real data); python-files: the .py files of the "
        "standard library and installed packages, each once (real text, little repetition).",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # each variant uses exactly the cores it names
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    work = Path(tempfile.mkdtemp(prefix="llm_train_bench_"))
    try:
        corpus = work / "corpus.jsonl"
        rows = (
            write_corpus(corpus, args.mb)
            if args.corpus == "paragraphs"
            else write_python_files(corpus, args.mb)
        )
        warm = work / "warmup.jsonl"  # imports and first-call costs are paid here, outside the timings
        write_corpus(warm, 0.05, seed=1)
        pipeline(warm, tokenizer, args.seq_len, work / "warm-cache", None)
        naive(warm, tokenizer, args.seq_len)
        print(
            f"corpus ({args.corpus}): {corpus.stat().st_size / 1e6:.1f} MB, {rows:,} rows; seq_len {args.seq_len}; "
            f"{os.cpu_count()} CPUs"
        )
        cpu = cpu_seconds()
        n_tokens, naive_s, naive_eff, naive_digest = naive(corpus, tokenizer, args.seq_len)
        naive_cpu = cpu_seconds() - cpu
        print(
            f"{'naive':<23} {n_tokens / naive_s:>10,.0f} tokens/s  {naive_s:6.1f}s wall  {naive_cpu:6.1f}s CPU  "
            f"packing efficiency {naive_eff:.1%} (next-fit)"
        )
        results = {}
        variants = (  # data.tokenize_memo=false: what the per-word memo buys, on the same file
            ("pipeline, 1 process", 1, True),
            ("pipeline, auto num_proc", None, True),
            ("1 process, memo off", 1, False),
        )
        for label, procs, memo in variants:
            cpu = cpu_seconds()
            tokens, cold, warm, eff, digest = pipeline(
                corpus, tokenizer, args.seq_len, work / "cache", procs, memo
            )
            used = cpu_seconds() - cpu
            # The very same ids, id for id, or the comparison is void.
            assert (tokens, digest) == (n_tokens, naive_digest), (tokens, n_tokens)
            results[label] = (cold, warm, eff, used)
            print(
                f"{label:<23} {tokens / cold:>10,.0f} tokens/s  {cold:6.1f}s wall  {used:6.1f}s CPU  "
                f"packing efficiency {eff:.2%} (best-fit decreasing); {naive_s / cold:.2f}x naive wall, "
                f"{naive_cpu / used:.2f}x naive CPU; warm cache {warm:.2f}s"
            )
        memo_on, memo_off = results["pipeline, 1 process"], results.pop("1 process, memo off")
        print(
            f"per-word memo (one process): {memo_off[0] / memo_on[0]:.2f}x less wall time, "
            f"{memo_off[3] / memo_on[3]:.2f}x less CPU than the tokenizer alone (data.tokenize_memo=false)"
        )
        best = min(results, key=lambda label: results[label][0])  # by wall time
        cold, warm, eff, used = results[best]
        print(
            f"result ({best}): tokenise+pack {naive_s / cold:.2f}x the naive loop's wall time (target >= 5x), "
            f"{naive_cpu / used:.2f}x its CPU time; packing efficiency {eff:.2%} (target >= 97%) vs "
            f"{naive_eff:.1%} next-fit; a second run reads the cache in {warm:.2f}s"
        )
        print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


# --- streaming --------------------------------------------------------------------------------

MICRO = 8


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


def streaming_main(argv: list[str]) -> int:
    """`streaming`: streaming sources against the tokenise-first path (the module docstring)."""
    parser = argparse.ArgumentParser(prog="bench.data streaming", description=STREAMING)
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)

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
            f"# .venv/bin/python -m bench.streaming_throughput --mb {args.mb:g} --seq-len {args.seq_len} "
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


def main() -> int:
    commands = {"pipeline": pipeline_main, "streaming": streaming_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(
            f"usage: python -m bench.data {{{'|'.join(commands)}}} [options]  (--help after one)",
            file=sys.stderr,
        )
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
