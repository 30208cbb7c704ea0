"""Sharding by data-parallel rank, exactly once per epoch, deterministic shuffle, mixture weights, exact resume."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llm_train.data import BatchStream, eval_batches, prepare_data
from llm_train.data.dealer import EpochOrder
from llm_train.errors import UserError
from tests.unit.data_fixtures import data_section, get_tokenizer, samples_of, text_rows, write_jsonl

N_DOCS = 60
MICRO = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[tuple[int, ...]]]:
    """A packed split of N_DOCS distinct documents, and each document's tokens (tokenised independently)."""
    tmp = tmp_path_factory.mktemp("stream")
    rows = text_rows(N_DOCS)
    path = write_jsonl(tmp / "docs.jsonl", rows)
    split = prepare_data(data_section(tmp, train=[str(path)], seq_len=48), get_tokenizer(), seed=0).train
    tok = get_tokenizer()
    docs = [tuple(tok.encode(r["text"]) + [tok.eos_token_id]) for r in rows]
    assert max(map(len, docs)) <= 48 and split.n_sequences > 8  # nothing split; several sequences
    return split, docs


def _global_stream(split: Any, dp: int, steps: int, seed: int = 7) -> list[tuple[int, ...]]:
    """Samples in global order: step by step, rank by rank (positions k*G + r*MICRO + j)."""
    streams = [BatchStream(split, MICRO, rank, dp, seed) for rank in range(dp)]
    out = []
    for _ in range(steps):
        for stream in streams:
            batch = next(stream)
            for row in range(MICRO):
                out.append(samples_of({k: v[row : row + 1] for k, v in batch.items() if k != "use_cache"}))
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_every_sample_exactly_once_per_epoch_across_ranks(corpus: tuple, dp: int) -> None:
    split, docs = corpus
    epoch = split.n_sequences
    steps = -(-2 * epoch // (MICRO * dp))  # two epochs' worth of global micro-steps
    sequences = _global_stream(split, dp, steps)
    for e in range(2):
        seen = [s for seq in sequences[e * epoch : (e + 1) * epoch] for s in seq]
        assert Counter(seen) == Counter(docs), f"epoch {e} with dp={dp}"
    first, second = sequences[:epoch], sequences[epoch : 2 * epoch]
    assert first != second  # a fresh shuffle each epoch


def test_ranks_of_one_tensor_parallel_group_get_identical_batches(corpus: tuple) -> None:
    split, _ = corpus
    # tp=2 over 4 processes: global ranks 0 and 1 are data-parallel rank 0, ranks 2 and 3 are dp rank 1.
    tp = 2
    streams = [BatchStream(split, MICRO, rank // tp, 4 // tp, 7) for rank in range(4)]
    for _ in range(5):
        b = [next(s) for s in streams]
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(b[0][key], b[1][key]) and torch.equal(b[2][key], b[3][key])
        assert not torch.equal(b[0]["input_ids"], b[2]["input_ids"])


def test_order_is_deterministic_from_the_seed(corpus: tuple) -> None:
    split, _ = corpus
    a, b, c = (BatchStream(split, MICRO, 0, 2, seed) for seed in (7, 7, 8))
    batches = [[next(s)["input_ids"] for _ in range(4)] for s in (a, b, c)]
    assert all(torch.equal(x, y) for x, y in zip(batches[0], batches[1], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(batches[0], batches[2], strict=True))


def _equal(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_the_next_batch(corpus: tuple, workers: int) -> None:
    split, _ = corpus
    k = split.n_sequences // (MICRO * 2) + 3  # past an epoch boundary
    uninterrupted = BatchStream(split, MICRO, 1, 2, 7)
    expected = [next(uninterrupted) for _ in range(k + 2)]
    interrupted = BatchStream(split, MICRO, 1, 2, 7, workers=workers)  # workers prefetch ahead
    for _ in range(k):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))  # checkpoints store it as JSON
    assert state["sequences_consumed"] == k * MICRO * 2 and state["epoch"] == 1
    resumed = BatchStream(split, MICRO, 1, 2, 7)
    resumed.load_state_dict(state)
    assert _equal(next(resumed), expected[k]) and _equal(next(resumed), expected[k + 1])


def test_resume_on_another_number_of_ranks_neither_repeats_nor_skips(corpus: tuple) -> None:
    split, _ = corpus
    reference = _global_stream(split, 2, 6)  # what 2 ranks would see for 6 steps
    two = [BatchStream(split, MICRO, r, 2, 7) for r in range(2)]
    for _ in range(3):
        for s in two:
            next(s)
    state = two[0].state_dict()
    four = [BatchStream(split, MICRO, r, 4, 7) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    after = []
    for s in four:
        batch = next(s)
        after += [
            samples_of({k: v[i : i + 1] for k, v in batch.items() if k != "use_cache"}) for i in range(MICRO)
        ]
    assert after == reference[3 * 2 * MICRO : 3 * 2 * MICRO + 4 * MICRO]


def test_resume_refuses_other_data(corpus: tuple, tmp_path: Path) -> None:
    split, _ = corpus
    state = BatchStream(split, MICRO, 0, 2, 7).state_dict()
    with pytest.raises(UserError, match="differ from the checkpoint"):
        BatchStream(split, MICRO, 0, 2, 8).load_state_dict(state)
    other = prepare_data(
        data_section(
            tmp_path, train=[str(write_jsonl(tmp_path / "o.jsonl", text_rows(40, seed=3)))], seq_len=48
        ),
        get_tokenizer(),
        seed=0,
    ).train
    with pytest.raises(UserError, match="differ from the checkpoint"):
        BatchStream(other, MICRO, 0, 2, 7).load_state_dict(state)


def test_mixture_weights_are_passes_per_epoch() -> None:
    order = EpochOrder([10, 6], [2.0, 0.5], seed=3)
    assert order.epoch_len == 20 + 3
    counts = Counter(order.at(p) for p in range(order.epoch_len))
    assert all(counts[(0, i)] == 2 for i in range(10))  # weight 2: every sequence twice
    halves = [
        {s for (part, s) in (order.at(p) for p in range(e * 23, (e + 1) * 23)) if part == 1} for e in (0, 1)
    ]
    assert len(halves[0]) == 3 and halves[0] | halves[1] == set(
        range(6)
    )  # weight 0.5: half, then the other half


def test_per_epoch_counts_this_ranks_micro_batches(corpus: tuple) -> None:
    split, _ = corpus
    stream = BatchStream(split, MICRO, 0, 2, 7)
    assert stream.per_epoch == split.n_sequences // (MICRO * 2)
    with pytest.raises(UserError, match="fewer than one global micro-step"):
        BatchStream(split, split.n_sequences, 0, 2, 7)


def test_eval_batches_are_fixed_and_equal_in_number_on_every_rank(corpus: tuple) -> None:
    split, _ = corpus
    dp = 4
    per_rank = [eval_batches(split, 3, r, dp, limit=100) for r in range(dp)]
    steps = -(-split.n_sequences // (3 * dp))
    assert [len(b) for b in per_rank] == [steps] * dp  # a short set wraps; no rank is left without batches
    again = eval_batches(split, 3, 1, dp, limit=100)
    assert all(_equal(x, y) for x, y in zip(per_rank[1], again, strict=True))
    assert eval_batches(None, 3, 0, dp, 4) == []
    assert len(eval_batches(split, 3, 0, dp, limit=1)) == 1


def test_loader_workers_produce_the_same_batches(corpus: tuple) -> None:
    split, _ = corpus
    plain = BatchStream(split, MICRO, 0, 2, 7, workers=0)
    workers = BatchStream(split, MICRO, 0, 2, 7, workers=2)
    for _ in range(6):
        assert _equal(next(plain), next(workers))
    assert np.array_equal(
        plain.state_dict()["sequences_consumed"], workers.state_dict()["sequences_consumed"]
    )


def test_loader_workers_never_touch_cuda(corpus: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs the loader forks its workers after CUDA is initialised (and pins their batches in
    the parent): a worker that touched torch.cuda would die with "Cannot re-initialize CUDA in
    forked subprocess". Forked workers inherit these patches, so any CUDA call there fails the test."""
    split, _ = corpus
    plain = BatchStream(split, MICRO, 0, 1, seed=3, workers=0, pin_memory=False)
    expected = [next(plain) for _ in range(4)]

    def no_cuda(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA touched in a data loader worker")

    forked = BatchStream(split, MICRO, 0, 1, seed=3, workers=2, pin_memory=False)
    for name in ("_lazy_init", "is_available", "current_device", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    got = [next(forked) for _ in range(4)]
    assert forked.workers == 2
    for mine, theirs in zip(got, expected, strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs if isinstance(theirs[k], torch.Tensor))


@pytest.mark.parametrize(("micro_after", "dp_after"), [(MICRO, 1), (MICRO * 2, 1), (1, 3)])
def test_one_epoch_across_a_layout_and_batch_change_holds_every_sample_once(
    corpus: tuple, micro_after: int, dp_after: int
) -> None:
    """dp 2 for part of an epoch, then a resume on another dp (and micro-batch): each sample once."""
    split, docs = corpus
    epoch = split.n_sequences
    two = [BatchStream(split, MICRO, r, 2, 7) for r in range(2)]
    before: list[list[tuple[int, ...]]] = []  # one entry per packed sequence, in global position order
    for _ in range(epoch // (2 * MICRO) // 2):  # about half the epoch on 2 ranks
        for stream in two:
            before += _rows(next(stream))
    after_streams = [BatchStream(split, micro_after, r, dp_after, 7) for r in range(dp_after)]
    for stream in after_streams:
        stream.load_state_dict(two[0].state_dict())
    after: list[list[tuple[int, ...]]] = []
    while len(before) + len(after) < epoch:
        for stream in after_streams:  # rank by rank: global position order again
            after += _rows(next(stream))
    in_epoch = before + after[: epoch - len(before)]  # the rest ran on into the next epoch
    assert Counter(s for seq in in_epoch for s in seq) == Counter(docs)


def _rows(batch: dict[str, Any]) -> list[list[tuple[int, ...]]]:
    """The samples of each packed sequence of a micro-batch."""
    return [
        samples_of({k: v[i : i + 1] for k, v in batch.items() if k != "use_cache"})
        for i in range(batch["input_ids"].shape[0])
    ]
