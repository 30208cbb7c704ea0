"""The master-weight digests: one flipped bit of one fp32 master fails, a faithful shard passes.

Shards are written as DeepSpeed writes them (torch.save of {"optimizer_state_dict": {...}}) under the
two keys its optimizers use; the e2e proof on real runs is tests/e2e/test_bf16.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_train.errors import ExportError
from llm_train.runtime.checkpointing.master_digest import (
    check_master_digests,
    digest_groups,
    live_master_digest,
)


def _groups(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1000, generator=g), torch.randn(37, generator=g)]


def _write_shards(ckpt: Path, per_rank: list[list[torch.Tensor]], key: str) -> None:
    ds = ckpt / "state" / "ds"
    ds.mkdir(parents=True, exist_ok=True)
    for rank, groups in enumerate(per_rank):
        torch.save(
            {"optimizer_state_dict": {key: groups, "other": 1}},
            ds / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )


def test_one_bit_of_one_master_changes_the_digest() -> None:
    groups = _groups(0)
    flipped = [g.clone() for g in groups]
    flipped[1].view(torch.int32)[5] ^= 1  # the lowest mantissa bit: far below any bf16 or logit tolerance
    assert digest_groups(groups) == digest_groups([g.clone() for g in groups])
    assert digest_groups(groups) != digest_groups(flipped)
    assert digest_groups(groups) != digest_groups(groups[::-1])  # the order of the groups counts


@pytest.mark.parametrize("key", ["single_partition_of_fp32_groups", "fp32_flat_groups"])
def test_shards_must_hold_the_masters_the_ranks_recorded(tmp_path: Path, key: str) -> None:
    ranks = [_groups(0), _groups(1)]
    recorded = [digest_groups(g) for g in ranks]
    _write_shards(tmp_path / "good", ranks, key)
    assert "2 optimizer shard(s)" in check_master_digests(tmp_path / "good", recorded)
    _write_shards(tmp_path / "stale", [ranks[0], _groups(2)], key)  # rank 1's shard from another step
    with pytest.raises(ExportError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt hold"):
        check_master_digests(tmp_path / "stale", recorded)
    _write_shards(tmp_path / "short", [ranks[0]], key)  # a shard missing
    with pytest.raises(ExportError, match="1 shards for 2 ranks"):
        check_master_digests(tmp_path / "short", recorded)


def test_a_checkpoint_without_digests_says_so() -> None:
    assert check_master_digests(Path("/nonexistent"), [None, None]).startswith("no master-weight digest")


def test_the_live_digest_is_of_what_the_optimizer_saves() -> None:
    class Saved:  # an optimizer whose state_dict has DeepSpeed's key, as ZeRO-1/2's has
        def state_dict(self) -> dict:
            return {"single_partition_of_fp32_groups": _groups(3)}

    assert live_master_digest(Saved(), optimizer_on_nvme=False) == digest_groups(_groups(3))
    assert live_master_digest(Saved(), optimizer_on_nvme=True) is None  # swapped out: not hashed
    assert live_master_digest(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), False) is None
