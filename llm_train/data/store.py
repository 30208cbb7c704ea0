"""Tokenised rows of one source, on disk as flat memory-mapped arrays.

    input_ids.npy  int32 [tokens]      every row's tokens, end to end
    loss_mask.npy  uint8 [tokens]      1 where the token is trained on (absent: all tokens)
    offsets.npy    int64 [rows + 1]    row i is input_ids[offsets[i]:offsets[i + 1]]
    arrays.bin     bytes               image formats: row i's other model inputs (pixel values, grid sizes)
    arrays.npy     int64 [rows + 1]    as one np.savez blob, arrays.bin[arrays[i]:arrays[i + 1]]
    filler.npz                         image formats: a blank-image row with its ids (model_inputs.py)

Tokenisation runs as a batched `datasets.map` (with `num_proc` workers for large sources)
into a temporary Arrow file, which is then flattened chunk by chunk into the arrays above:
the corpus never passes through Python lists as a whole, and reading a sample later is a
slice of a memory map.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llm_train.data.formats.base import Batch, TokenizeFn
from llm_train.data.rows import IDS, MASK, to_arrow

if TYPE_CHECKING:
    from collections.abc import Callable

    import pyarrow as pa
    from datasets import Dataset

# Below this much source per worker, starting workers costs more than it saves (measured: a
# 10 MB source took as long with 2 workers as with 1 on 2 cores; a 50 MB one 1.5x less).
_BYTES_PER_WORKER = 16 << 20
FILLER = "filler.npz"
_MIN_ROWS_PER_WORKER = 100


@dataclass
class TokenStore:
    path: Path
    input_ids: np.ndarray
    loss_mask: np.ndarray | None
    offsets: np.ndarray
    blobs: np.ndarray | None = None
    blob_offsets: np.ndarray | None = None
    filler: dict[str, np.ndarray] | None = None

    @classmethod
    def open(cls, path: Path) -> TokenStore:
        mask = path / "loss_mask.npy"
        blobs = path / "arrays.bin"
        return cls(
            path=path,
            input_ids=np.load(path / "input_ids.npy", mmap_mode="r"),
            loss_mask=np.load(mask, mmap_mode="r") if mask.is_file() else None,
            offsets=np.load(path / "offsets.npy"),
            blobs=np.memmap(blobs, dtype=np.uint8, mode="r") if blobs.is_file() else None,
            blob_offsets=np.load(path / "arrays.npy") if blobs.is_file() else None,
            filler=_load_npz(path / FILLER),
        )

    def row_of(self, start: int) -> int:
        """The row whose tokens start at or before token `start` (a span's row)."""
        return int(np.searchsorted(self.offsets, start, side="right")) - 1

    def arrays(self, row: int) -> dict[str, np.ndarray]:
        """Row `row`'s other model inputs (pixel values ...); empty for stores without them."""
        if self.blobs is None or self.blob_offsets is None:
            return {}
        lo, hi = int(self.blob_offsets[row]), int(self.blob_offsets[row + 1])
        with np.load(io.BytesIO(self.blobs[lo:hi].tobytes()), allow_pickle=False) as blob:
            return {name: blob[name] for name in blob.files}

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def tokens(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.input_ids[start : start + length]
        if self.loss_mask is None:
            return ids, np.ones(length, dtype=np.uint8)
        return ids, self.loss_mask[start : start + length]


def _load_npz(path: Path) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as blob:
        return {name: blob[name] for name in blob.files}


def auto_num_proc(rows: int, nbytes: int, requested: int | None) -> int:
    """Worker processes for tokenising a source: data.num_proc, else one per 16 MB of it (up to the CPUs, 8)."""
    if requested is not None:
        return requested
    return max(1, min(8, os.cpu_count() or 1, nbytes // _BYTES_PER_WORKER, rows // _MIN_ROWS_PER_WORKER))


def _arrow_io(
    tokenize: TokenizeFn, with_mask: bool, with_arrays: bool = False
) -> Callable[[Batch, list[int]], pa.Table]:
    """`tokenize`, building its output Arrow arrays directly.

    datasets' generic conversion of nested Python lists cost as much as tokenising itself;
    one flat array plus offsets per batch (rows.to_arrow) costs a small fraction of it.
    """
    import pyarrow as pa

    dtypes: dict[str, np.dtype] = {"input_ids": IDS, "loss_mask": MASK}

    def apply(batch: Batch, indices: list[int]) -> pa.Table:
        out = tokenize(batch, indices)
        names = ["input_ids"] + (["loss_mask"] if with_mask else [])
        columns = {name: to_arrow(out[name], dtypes[name]) for name in names}
        if with_arrays:
            columns["arrays"] = pa.array(out["arrays"], type=pa.binary())
        return pa.table(columns)

    return apply


def build_store(
    out: Path,
    rows: Dataset,
    tokenize: TokenizeFn,
    columns: list[str],
    with_mask: bool,
    num_proc: int,
    fingerprint: str,
    with_arrays: bool = False,
) -> dict[str, Any]:
    """Tokenise `rows` (a datasets.Dataset) into `out`; returns counts for the cache's meta.json."""
    import datasets
    import pyarrow.compute as pc

    features = {"input_ids": datasets.List(datasets.Value("int32"))}
    if with_mask:
        features["loss_mask"] = datasets.List(datasets.Value("uint8"))
    if with_arrays:
        features["arrays"] = datasets.Value("binary")
    if num_proc > 1:
        # Each worker tokenises on its own core; the fast tokenizer's own threads would only contend.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Rows are read through datasets' own decoding (JSON-typed columns and the like), only the columns used.
    rows = rows.select_columns(columns)
    mapped = rows.map(
        _arrow_io(tokenize, with_mask, with_arrays),
        batched=True,
        batch_size=1000,
        with_indices=True,
        remove_columns=rows.column_names,
        features=datasets.Features(features),
        num_proc=num_proc if num_proc > 1 else None,
        cache_file_name=str(out / "mapped.arrow"),
        new_fingerprint=fingerprint,  # our own key; spares datasets hashing the tokenizer
    )
    table = mapped.data.table
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    np.save(out / "offsets.npy", offsets)
    trained = total
    arrays = [("input_ids", np.int32)] + ([("loss_mask", np.uint8)] if with_mask else [])
    for name, dtype in arrays:
        # open_memmap with shape (0,) cannot be created; an all-empty source is caught by the caller.
        flat = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dtype, shape=(max(total, 1),))
        pos = 0
        for chunk in table.column(name).chunks:
            values = chunk.flatten().to_numpy(zero_copy_only=False)
            flat[pos : pos + len(values)] = values
            pos += len(values)
        if name == "loss_mask":
            trained = int(flat[:total].sum(dtype=np.int64))
        flat.flush()
        del flat
    if with_arrays:
        _write_blobs(out, table.column("arrays"))
    del table, mapped
    for arrow in out.glob("mapped*.arrow"):  # the flat arrays replace it
        arrow.unlink()
    return {"rows": len(lengths), "tokens": total, "trained_tokens": trained}


def _write_blobs(out: Path, column: Any) -> None:
    """arrays.bin (the rows' blobs end to end) and arrays.npy (where each starts), chunk by chunk."""
    sizes = []
    with open(out / "arrays.bin", "wb") as f:
        for chunk in column.chunks:
            for blob in chunk.to_pylist():
                f.write(blob)
                sizes.append(len(blob))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    np.save(out / "arrays.npy", offsets)
