"""Data: sources -> tokenised (cached) -> packed -> micro-batches per data-parallel rank.

    sources.py      find a source (files, globs, save_to_disk folders, hub ids) and load its rows
    formats/        one module per data format (tokenise, loss mask, fields), asked through its registry
    fingerprint.py  cache keys from source content and tokenizer
    cache.py        build-once cache entries (file lock + atomic rename)
    store.py        tokenised rows as flat memory-mapped arrays
    packing.py      over-long policy, best-fit-decreasing packing, statistics
    prepare.py      a recipe's data section -> packed train / eval splits
    model_inputs.py sequences -> model inputs (position ids restart per sample)
    dealer.py       the one dealer (`Batches`): epoch order, sharding by data-parallel rank, exact resume
    stream_windows.py `streaming: true` sources: tokenised and packed on the fly, dealt by the same dealer
    workers.py      loader workers that end with their training process
    volume.py       epochs a run implies; the data.max_epochs guard
    summary.py      statistics and decoded samples for `llm-train data inspect`

The package's face: names are imported lazily so `llm-train --help` does not pay for numpy, torch or
datasets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for the checker (`X as X`: a re-export); at run time the lazy __getattr__
    from llm_train.data.dealer import Batches as Batches
    from llm_train.data.dealer import BatchStream as BatchStream
    from llm_train.data.dealer import eval_batches as eval_batches
    from llm_train.data.prepare import PackedSplit as PackedSplit
    from llm_train.data.prepare import PreparedData as PreparedData
    from llm_train.data.prepare import load_blocks as load_blocks
    from llm_train.data.prepare import prepare_data as prepare_data
    from llm_train.data.stream_windows import StreamingBatches as StreamingBatches
    from llm_train.data.stream_windows import StreamSpec as StreamSpec
    from llm_train.data.stream_windows import eval_split as eval_split
    from llm_train.data.stream_windows import is_streaming as is_streaming

_EXPORTS = {
    "prepare_data": "llm_train.data.prepare",
    "load_blocks": "llm_train.data.prepare",
    "PackedSplit": "llm_train.data.prepare",
    "PreparedData": "llm_train.data.prepare",
    "Batches": "llm_train.data.dealer",
    "BatchStream": "llm_train.data.dealer",
    "eval_batches": "llm_train.data.dealer",
    "StreamingBatches": "llm_train.data.stream_windows",
    "StreamSpec": "llm_train.data.stream_windows",
    "eval_split": "llm_train.data.stream_windows",
    "is_streaming": "llm_train.data.stream_windows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llm_train.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
