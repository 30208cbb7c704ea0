"""Text in, packed and sharded micro-batches out.

Minimal path: local .txt / .jsonl files are tokenised, joined with the eos token and cut
into fixed-length blocks. Blocks are dealt to *data-parallel* ranks (never global ranks,
so every rank of a tensor-parallel group sees the same batch), in a per-epoch order drawn
from the seed, so each block is seen exactly once per epoch across ranks.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_train.errors import UserError
from llm_train.recipe import DataSection


def expand_files(patterns: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if any(ch in pattern for ch in "*?[") else [pattern]
        if not matches:
            raise UserError(f"{key}: no files match '{pattern}'")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise UserError(f"{key}: file not found: {match}")
            if path.suffix not in (".txt", ".jsonl", ".md"):
                raise UserError(f"{key}: {match}: unsupported file type '{path.suffix}'; use .txt or .jsonl")
            files.append(path)
    return files


def read_documents(path: Path, text_field: str) -> list[str]:
    if path.suffix != ".jsonl":
        # Blank-line separated paragraphs are documents; keeps eos boundaries meaningful.
        return [doc for doc in path.read_text(encoding="utf-8").split("\n\n") if doc.strip()]
    docs = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                present = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise UserError(
                    f"{path}:{lineno}: no field '{text_field}' (fields: {present}); set data.text_field"
                )
            docs.append(str(row[text_field]))
    return docs


def pack(files: list[Path], tokenizer: Any, text_field: str, seq_len: int) -> torch.Tensor:
    """All documents tokenised, each followed by eos, cut into [n_blocks, seq_len] (the tail is dropped)."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for path in files:
        docs = read_documents(path, text_field)
        for start in range(0, len(docs), 1000):  # batched fast-tokenizer calls
            for tokens in tokenizer(docs[start : start + 1000], add_special_tokens=False)["input_ids"]:
                ids.extend(tokens)
                ids.append(eos)
    n_blocks = len(ids) // seq_len
    if n_blocks == 0:
        names = ", ".join(str(f) for f in files)
        raise UserError(
            f"data: {names} hold {len(ids)} tokens, fewer than one block of data.seq_len={seq_len}"
        )
    return torch.tensor(ids[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def load_blocks(data: DataSection, tokenizer: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_blocks, eval_blocks)."""
    train = pack(expand_files(data.train, "data.train"), tokenizer, data.text_field, data.seq_len)
    if data.eval:
        return train, pack(expand_files(data.eval, "data.eval"), tokenizer, data.text_field, data.seq_len)
    n_eval = int(len(train) * data.eval_fraction)
    if data.eval_fraction > 0 and n_eval == 0:
        n_eval = 1
    # A seeded shuffle before the split, so eval blocks come from the whole corpus, not its last file.
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return train[order[n_eval:]], train[order[:n_eval]]


@dataclass
class StreamState:
    """Where the stream stands: enough to continue exactly (epoch, next micro-batch within it)."""

    epoch: int = 0
    position: int = 0


class BatchStream:
    """Endless micro-batches for one data-parallel rank; every block once per epoch across ranks."""

    def __init__(self, blocks: torch.Tensor, micro_batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        self.blocks, self.micro, self.rank, self.size, self.seed = blocks, micro_batch, dp_rank, dp_size, seed
        self.per_epoch = len(blocks) // (micro_batch * dp_size)
        if self.per_epoch == 0:
            raise UserError(
                f"data: {len(blocks)} training blocks are fewer than one global micro-step "
                f"(micro_batch_size {micro_batch} x data-parallel size {dp_size}); add data or shrink the batch"
            )
        self.state = StreamState()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = StreamState(epoch=int(state["epoch"]), position=int(state["position"]))

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.blocks), generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.state.position >= self.per_epoch:
            self.state = StreamState(epoch=self.state.epoch + 1, position=0)
        order = self._order(self.state.epoch)
        start = (self.state.position * self.size + self.rank) * self.micro
        ids = self.blocks[order[start : start + self.micro]]
        self.state.position += 1
        return {"input_ids": ids, "labels": ids}


def eval_batches(
    blocks: torch.Tensor, micro_batch: int, dp_rank: int, dp_size: int, limit: int
) -> list[dict]:
    """The same fixed eval micro-batches at every evaluation (sharded by data-parallel rank)."""
    batches = []
    for i in range(limit):
        start = (i * dp_size + dp_rank) * micro_batch
        ids = blocks[start : start + micro_batch]
        if len(ids) < micro_batch:
            break
        batches.append({"input_ids": ids, "labels": ids})
    return batches
