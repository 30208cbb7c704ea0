"""Cache keys: what a cached result depends on, hashed, so a stale cache is never read.

A local source is identified by its content, cheaply: size, mtime and a hash of the first
and last MiB of every file (reading a 100 GB corpus to hash it would cost more than
tokenising it). A tokenizer is identified by everything that changes its output: its
serialised model and special tokens (chat sources add the template they use).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bump when tokenisation or packing output changes for the same inputs (invalidates old caches).
CODE_VERSION = 1
_EDGE = 1 << 20


def digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def files_signature(files: Iterable[Path]) -> str:
    rows = []
    for path in sorted(Path(f) for f in files):
        stat = path.stat()
        with path.open("rb") as handle:
            head = hashlib.sha256(handle.read(_EDGE)).hexdigest()
            if stat.st_size > _EDGE:
                handle.seek(max(_EDGE, stat.st_size - _EDGE))
                tail = hashlib.sha256(handle.read()).hexdigest()
            else:
                tail = ""
        # The name counts only within a folder (a renamed shard reorders rows); the folder does not.
        rows.append((path.name, stat.st_size, stat.st_mtime_ns, head, tail))
    return digest(rows)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A slow tokenizer has no serialised model: its vocabulary stands in.
    model = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return digest(
        type(tokenizer).__name__,
        hashlib.sha256(model.encode()).hexdigest(),
        {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
