"""A sample's token ids (or loss mask) as a row: raw bytes in the dtype of the cache's arrays.

Tokenisation hands rows of int32 ids and uint8 masks to the store instead of lists of Python
ints: joining the memoised pieces of a text is then one memory copy, and a batch goes into
Arrow (and from there into input_ids.npy) without converting twelve million ints one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import pyarrow as pa

IDS = np.dtype(np.int32)  # input_ids.npy
MASK = np.dtype(np.uint8)  # loss_mask.npy


def as_row(ids: npt.ArrayLike) -> bytes:
    """Token ids (a list or array) as an int32 row."""
    return np.asarray(ids, dtype=IDS).tobytes()


def mask_row(untrained: int, trained: int) -> bytes:
    """A loss-mask row: `untrained` zeros then `trained` ones."""
    return bytes(untrained) + b"\x01" * trained


def width(row: bytes) -> int:
    """Number of ids in an int32 row."""
    return len(row) // IDS.itemsize


def to_arrow(values: list[bytes] | list[list[int]], dtype: np.dtype) -> pa.ListArray:
    """One batch's rows (bytes rows, or lists of ints from the list-building formats) as an Arrow list array."""
    import itertools

    import pyarrow as pa

    if values and isinstance(values[0], bytes):
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values)) // dtype.itemsize
        flat = np.frombuffer(b"".join(values), dtype=dtype)
    else:
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        flat = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=int(lengths.sum()))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    # Arrow takes numpy's buffers without a copy.
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
