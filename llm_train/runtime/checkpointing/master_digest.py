"""A digest of the fp32 master weights each rank holds at a save, checked against its shard at export.

Why: the export check compares the exported model's logits with the ones the engine recorded at save
time, within 4 ulps of the coarser dtype (runtime/export/verify.py). At fine-tuning learning rates (~1e-5) one
optimizer step moves bf16 weights by less than their rounding, so a checkpoint whose optimizer shards
are one step old (a save that wrote an old partition, yet whose manifest verifies: the manifest hashes
what was written) passes any bf16 comparison. The master weights' bits change at every step whatever the
learning rate, so each rank records the sha256 of its own fp32 partitions *as they are in memory* right
after DeepSpeed wrote them (in its trainer state, run_state.py), and the export hashes the same
tensors as they are in each shard file. Every shard must carry a digest some rank recorded at that step,
and every recorded digest must be in a shard: a stale, mixed-up or half-written shard fails, in one line.

The tensors are the ones DeepSpeed itself saves under the optimizer state's keys below (DeepSpeed
0.19.8: stage_1_and_2.py and bf16_optimizer.py `single_partition_of_fp32_groups`, ZeRO-1/2 without the
alignment padding; stage3.py `fp32_flat_groups`), taken from the optimizer's own `state_dict()`, so what
is hashed in memory is exactly what is written. Not covered, and said so: a run whose optimizer lives on
the NVMe drive (its fp32 partitions are swapped out; the swap files are checked by their own manifest
entries), and a ZeRO-0 fp32 run (no master copy: the module's weights are the masters, saved whole).
Cost: sha256 of 4 bytes per trainable parameter per rank partition (~1 GB/s), a quarter of what the
manifest already hashes at each save (master, m and v files).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from llm_train.errors import ExportError

MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")
DIGEST_KEY = "master_digest"  # the trainer-state field (trainer/rankNNNNN.json)
SHARD = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_CHUNK = 64 * 2**20  # elements hashed per copy to host memory (256 MiB of fp32)


def digest_groups(groups: Sequence[torch.Tensor]) -> str:
    """sha256 over the groups' dtypes, shapes and bytes, in order (chunked: a GPU partition is copied piecewise)."""
    hasher = hashlib.sha256()
    for tensor in groups:
        flat = tensor.detach().reshape(-1)
        hasher.update(f"{flat.dtype}:{flat.numel()};".encode())
        for chunk in flat.split(_CHUNK):
            hasher.update(chunk.contiguous().cpu().view(torch.uint8).numpy())
    return hasher.hexdigest()


def _masters(optimizer_state: dict[str, Any]) -> list[torch.Tensor] | None:
    for key in MASTER_KEYS:
        if key in optimizer_state:
            return list(optimizer_state[key])
    return None


def live_master_digest(optimizer: Any, optimizer_on_nvme: bool) -> str | None:
    """This rank's digest of what DeepSpeed's optimizer saves as its fp32 partitions; None where none is kept."""
    if optimizer_on_nvme or optimizer is None or not hasattr(optimizer, "state_dict"):
        return None
    masters = _masters(optimizer.state_dict())
    return digest_groups(masters) if masters is not None else None


def shard_files(ckpt_dir: Path) -> list[Path]:
    state = ckpt_dir / "state"
    return sorted(p for p in state.rglob("*_optim_states.pt") if SHARD.match(p.name))


def shard_digest(path: Path) -> str | None:
    # mmap: only the master tensors' pages are read, not Adam's m and v stored beside them. The file
    # is a DeepSpeed pickle, loaded only after the checkpoint's manifest verified (runtime/checkpointing/commit.py).
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    masters = _masters(saved.get("optimizer_state_dict", {}))
    return digest_groups(masters) if masters is not None else None


def check_master_digests(ckpt_dir: Path, recorded: Sequence[str | None]) -> str:
    """Raise ExportError unless the shards hold the masters the ranks recorded; else say what was checked."""
    wanted = [d for d in recorded if d is not None]
    if not wanted:
        return "no master-weight digest recorded (optimizer on NVMe, ZeRO-0 fp32, or an older checkpoint)"
    shards = shard_files(ckpt_dir)
    found = {path: shard_digest(path) for path in shards}
    missing = Counter(wanted) - Counter(d for d in found.values() if d is not None)
    if missing or len(shards) != len(wanted):
        stale = sorted(p.name for p, d in found.items() if d not in set(wanted))
        where = (
            f"{', '.join(stale)} hold(s)" if stale else f"{len(shards)} shards for {len(wanted)} ranks hold"
        )
        raise ExportError(
            f"checkpoint {ckpt_dir}: {where} fp32 master weights other than those the training ranks had when "
            f"it was saved (a stale or mis-written optimizer shard); export an earlier checkpoint"
        )
    return f"fp32 master weights of {len(shards)} optimizer shard(s) equal to the training ranks' at save"
