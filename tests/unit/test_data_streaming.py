"""Streaming sources: multi-file parquet and jsonl corpora read through datasets' streaming mode.

Each sequence goes to exactly one data-parallel rank, in a global order that does not depend
on the number of ranks or loader workers; a saved position resumes without repeating or
skipping, on any number of ranks; packing follows the tokenise-first path's rules.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_train.config.recipe import load_recipe
from llm_train.data import prepare_data
from llm_train.data.model_inputs import build_rows
from llm_train.data.stream_windows import StreamingBatches, StreamSpec, next_source
from llm_train.errors import UserError
from tests.unit.data_fixtures import data_section, get_tokenizer, samples_of, text_rows, write_jsonl

N_DOCS = 90
FILES = 3
WINDOW = 16  # rows per window: 6 windows per pass, the last one short, windows crossing file ends
MICRO = 2
SEQ_LEN = 48


def _docs() -> list[tuple[int, ...]]:
    tok = get_tokenizer()
    return [tuple(tok.encode(r["text"]) + [tok.eos_token_id]) for r in text_rows(N_DOCS)]


@pytest.fixture(scope="module", params=["jsonl", "parquet"])
def corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N_DOCS distinct documents in FILES files of one format, in a folder."""
    folder = tmp_path_factory.mktemp(f"corpus-{request.param}")
    rows = text_rows(N_DOCS)
    per = N_DOCS // FILES
    for f in range(FILES):
        part = rows[f * per : (f + 1) * per]
        if request.param == "jsonl":
            write_jsonl(folder / f"part-{f}.jsonl", part)
        else:
            pq.write_table(pa.table({"text": [r["text"] for r in part]}), folder / f"part-{f}.parquet")
    return folder


def _spec(corpus: Path, seed: int = 7, **fields: Any) -> StreamSpec:
    fields = {"train": [{"path": str(corpus), "streaming": True}], "seq_len": SEQ_LEN, **fields}
    return StreamSpec.build(data_section(corpus.parent, **fields), get_tokenizer(), seed, window_rows=WINDOW)


def _rows(batch: dict[str, Any]) -> list[tuple[tuple[int, ...], ...]]:
    """Each row of a micro-batch as the tuple of its samples."""
    n = batch["input_ids"].shape[0]
    return [
        tuple(samples_of({k: v[r : r + 1] for k, v in batch.items() if k != "use_cache"})) for r in range(n)
    ]


def _global(streams: list[StreamingBatches], steps: int) -> list[tuple[tuple[int, ...], ...]]:
    """Sequences in global order: step by step, rank by rank (positions k*G + r*MICRO + j)."""
    out = []
    for _ in range(steps):
        for stream in streams:
            out += _rows(next(stream))
    return out


def _streams(spec: StreamSpec, dp: int, workers: int = 0) -> list[StreamingBatches]:
    return [StreamingBatches(spec, MICRO, rank, dp, workers=workers) for rank in range(dp)]


def _pass_length(spec: StreamSpec) -> int:
    """Sequences in one pass: the windows of pass 0 (a pass is ceil(N_DOCS / WINDOW) windows)."""
    from llm_train.data.stream_windows import _initial_record, windows

    items = windows(spec, _initial_record(1))
    return sum(next(items)[1].n_sequences for _ in range(-(-N_DOCS // WINDOW)))


def test_each_sequence_goes_to_one_rank_in_the_same_global_order_for_dp_1_and_2(corpus: Path) -> None:
    spec = _spec(corpus)
    per_pass = _pass_length(spec)
    steps = -(-per_pass // (2 * MICRO)) + 3  # past the end of the first pass
    two = _global(_streams(spec, 2), steps)
    one = _global(_streams(spec, 1), 2 * steps)
    assert two == one
    first_pass = [s for seq in two[:per_pass] for s in seq]
    assert Counter(first_pass) == Counter(_docs())  # every document exactly once in a pass
    assert two[per_pass:] != two[: len(two) - per_pass]  # the next pass is in another order


def test_loader_workers_do_not_change_the_order(corpus: Path) -> None:
    spec = _spec(corpus)
    assert _global(_streams(spec, 2, workers=2), 6) == _global(_streams(spec, 2, workers=0), 6)


@pytest.mark.parametrize("dp_after", [2, 1, 4])
def test_resume_neither_repeats_nor_skips_on_any_number_of_ranks(corpus: Path, dp_after: int) -> None:
    spec = _spec(corpus)
    total_steps, stop = 21, 7  # 7 steps of dp=2 end mid-window; 21 steps cross into the second pass
    reference = _global(_streams(spec, 2), total_steps)
    before_streams = _streams(spec, 2)
    before = _global(before_streams, stop)
    states = [json.loads(json.dumps(s.state_dict())) for s in before_streams]  # as a checkpoint stores it
    assert states[0] == states[1]  # one position, whichever rank's file a resume reads
    assert states[0]["sequences_consumed"] == stop * 2 * MICRO
    after_streams = _streams(_spec(corpus), dp_after)
    for stream in after_streams:
        stream.load_state_dict(states[0])
    after = _global(after_streams, (total_steps - stop) * 2 // dp_after)
    assert before + after == reference


def test_epoch_counts_completed_passes(corpus: Path) -> None:
    spec = _spec(corpus)
    per_pass = _pass_length(spec)
    (stream,) = _streams(spec, 1)
    assert stream.epoch == 0 and stream.per_epoch is None
    for _ in range(-(-per_pass // MICRO) + 1):
        next(stream)
    assert stream.epoch == 1


def test_a_checkpoint_of_other_data_or_seed_is_refused(corpus: Path) -> None:
    (stream,) = _streams(_spec(corpus), 1)
    next(stream)
    state = stream.state_dict()
    (other_seed,) = _streams(_spec(corpus, seed=8), 1)
    with pytest.raises(UserError, match="differ from the checkpoint's"):
        other_seed.load_state_dict(state)
    (other_len,) = _streams(_spec(corpus, seq_len=64), 1)
    with pytest.raises(UserError, match="differ from the checkpoint's"):
        other_len.load_state_dict(state)
    with pytest.raises(UserError, match="not a streaming one"):
        stream.load_state_dict({"version": 1, "sequences_consumed": 4})  # a tokenise-first position


def _instruction_rows(n: int) -> list[dict[str, str]]:
    docs = text_rows(n, seed=1)
    return [{"instruction": f"repeat {i}", "input": "", "output": d["text"]} for i, d in enumerate(docs)]


@pytest.mark.parametrize(
    ("fmt", "packing"), [("text", "packed"), ("text", "padded"), ("instruction", "packed")]
)
def test_a_window_packs_as_the_tokenise_first_path_packs(tmp_path: Path, fmt: str, packing: str) -> None:
    """One file, one window holding every row: row for row the micro-batch prepare_data's split gives.

    Same ids, labels (loss only on the response for instruction rows) and position ids or
    attention mask; only the order of the sequences differs (shuffled within the window).
    """
    long_doc = {"text": " ".join(["lambda"] * 120)}  # longer than seq_len: the over-long policy splits it
    rows = text_rows(40) + [long_doc] if fmt == "text" else _instruction_rows(40)
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    fields = {"seq_len": SEQ_LEN, "packing": packing}
    source = {"path": str(path), "format": fmt}
    split = prepare_data(data_section(tmp_path, train=[source], **fields), get_tokenizer(), seed=0).train
    data = data_section(tmp_path, train=[{**source, "streaming": True}], **fields)
    spec = StreamSpec.build(data, get_tokenizer(), 0, window_rows=len(rows))
    n = split.n_sequences
    streamed = next(StreamingBatches(spec, n, 0, 1, workers=0))
    expected = build_rows(split, [(0, b) for b in range(n)])
    if fmt == "text":
        assert split.parts[0].stats["split"] == 1  # the over-long policy ran in both paths

    def row(batch: dict[str, Any], r: int) -> tuple:
        return tuple(tuple(int(x) for x in batch[k][r]) for k in sorted(batch) if k != "use_cache")

    assert Counter(row(streamed, r) for r in range(n)) == Counter(row(expected, r) for r in range(n))
    assert streamed.get("use_cache") == expected.get("use_cache")


def test_weighted_round_robin_gives_each_source_its_share_of_windows() -> None:
    taken = [0, 0]
    picks = []
    for _ in range(40):
        i = next_source(taken, [1.0, 3.0])
        taken[i] += 1
        picks.append(i)
    assert taken == [10, 30]
    assert all(picks[k : k + 4].count(0) == 1 for k in range(0, 40, 4))  # evenly spread, not in runs


def test_two_streaming_sources_mix_by_weight(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i}"} for i in range(200)])
    train = [{"path": str(a), "streaming": True}, {"path": str(b), "streaming": True, "weight": 3}]
    spec = StreamSpec.build(data_section(tmp_path, train=train, seq_len=SEQ_LEN), get_tokenizer(), 0, 16)
    tok = get_tokenizer()
    alpha = tok.encode("alpha")[0]
    samples = [s for seq in _global(_streams(spec, 1), 20) for s in seq]
    share_a = sum(s[0] == alpha for s in samples) / len(samples)
    assert 0.15 < share_a < 0.35  # a quarter of the rows (windows are whole: +-one window of slack)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim.max_steps=null", "optim.epochs=1"],
            "its length is unknown and optim.epochs cannot be counted",
        ),
        (["data.eval_fraction=0.05"], "data.eval_fraction cannot be carved from it"),
        (
            ["data.eval=[{path: x.jsonl, streaming: true}]"],
            "data.eval[0].streaming=true: eval sets are read whole",
        ),
        (
            ["data.train=[{path: a.jsonl, streaming: true}, b.jsonl]"],
            "set streaming: true on every data.train source or on none",
        ),
    ],
)
def test_what_a_stream_cannot_do_is_refused_in_one_line(overrides: list[str], message: str) -> None:
    base = ["data.train=[{path: a.jsonl, streaming: true}]", "data.eval_fraction=0"]
    with pytest.raises(UserError, match=re.escape(message)) as err:
        load_recipe("tiny-cpu", base + overrides)
    assert "\n" not in str(err.value)


def test_a_missing_field_is_one_line_from_the_stream(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": "no text field"}] * 3)
    spec = StreamSpec.build(
        data_section(tmp_path, train=[{"path": str(path), "streaming": True}]), get_tokenizer(), 0, WINDOW
    )
    for workers in (0, 1):
        with pytest.raises(UserError, match="no field 'text' for format text") as err:
            next(StreamingBatches(spec, MICRO, 0, 1, workers=workers))
        assert "\n" not in str(err.value)


_EXIT_SCRIPT = """
import os, sys
from llm_train.data.stream_windows import StreamingBatches, StreamSpec
from tests.unit.data_fixtures import data_section, get_tokenizer
from pathlib import Path
folder = Path(sys.argv[1])
data = data_section(folder, train=[{"path": str(folder / "docs.jsonl"), "streaming": True}], seq_len=48)
stream = StreamingBatches(StreamSpec.build(data, get_tokenizer(), 0), 2, 0, 1, workers=1)
next(stream)
print("served", flush=True)
os._exit(0)  # as train.py ends: no DataLoader shutdown
"""


def test_loader_workers_end_with_their_training_process(tmp_path: Path) -> None:
    """A launcher reading the process's output gets EOF: no orphaned worker holds the pipe open."""
    import subprocess
    import sys

    from tests.helpers import REPO
    from tests.session_env import OFFLINE_ENV

    write_jsonl(tmp_path / "docs.jsonl", text_rows(4000))  # windows of ~100 KB: more than a pipe holds
    env = {**__import__("os").environ, **OFFLINE_ENV}
    result = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # the worker notices within ~1 s; a hang without the watch never ends
    )
    assert result.returncode == 0 and "served" in result.stdout, result.stderr[-2000:]
