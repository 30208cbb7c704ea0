"""GPUs without peer-to-peer access (RTX 40xx): detected, reported by doctor, and NCCL_P2P_DISABLE=1 set once.

No machine here has two GPUs, so the detection's torch calls are replaced: the logic under test
is which pairs count as lacking P2P, and what the run and doctor do with them.
"""

from __future__ import annotations

import os

import pytest
import torch

from llm_train import train
from llm_train.commands import doctor
from llm_train.config import hardware
from llm_train.errors import UserError
from llm_train.runtime.model.fast import disable_nccl_p2p


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, peers: set[tuple[int, int]]) -> None:
    """`count` CUDA GPUs where device i can read device j exactly when (i, j) is in `peers`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) in peers)


def test_detection_lists_every_pair_without_p2p_in_either_direction(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0<->1 both ways (NVLink pair), 2->3 one way only, nothing else.
    _fake_gpus(monkeypatch, 4, {(0, 1), (1, 0), (2, 3)})
    assert hardware.gpus_without_p2p() == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_detection_is_empty_when_every_pair_has_p2p_or_there_is_one_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpus(monkeypatch, 3, {(i, j) for i in range(3) for j in range(3) if i != j})
    assert hardware.gpus_without_p2p() == []
    _fake_gpus(monkeypatch, 1, set())
    assert hardware.gpus_without_p2p() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware.gpus_without_p2p() == []


def test_no_p2p_sets_nccl_p2p_disable_with_a_notice() -> None:
    env: dict[str, str] = {}
    notice = disable_nccl_p2p([(0, 1)], env)
    assert env == {"NCCL_P2P_DISABLE": "1"}
    assert (
        notice is not None and "GPUs 0-1" in notice and "NCCL_P2P_DISABLE=1" in notice and "\n" not in notice
    )


@pytest.mark.parametrize(
    "name, value", [("NCCL_P2P_DISABLE", "0"), ("NCCL_P2P_DISABLE", ""), ("NCCL_P2P_LEVEL", "PIX")]
)
def test_the_users_own_p2p_setting_is_kept(name: str, value: str) -> None:
    env = {name: value}
    assert disable_nccl_p2p([(0, 1)], env) is None
    assert env == {name: value}


def test_all_p2p_leaves_the_environment_untouched() -> None:
    env: dict[str, str] = {}
    assert disable_nccl_p2p([], env) is None
    assert env == {}


def test_a_run_on_a_node_without_p2p_sets_it_before_training_with_one_notice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NCCL_P2P_DISABLE", "placeholder")  # so monkeypatch restores the absence afterwards
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    monkeypatch.delenv("NCCL_P2P_LEVEL", raising=False)
    monkeypatch.setattr(train, "gpus_without_p2p", lambda: [(0, 1)])
    seen: dict[str, str | None] = {}

    def stop(*args: object, **kwargs: object) -> None:
        # Resolution comes before any process group: NCCL must already see the variable.
        seen["NCCL_P2P_DISABLE"] = os.environ.get("NCCL_P2P_DISABLE")
        raise UserError("stop here")

    monkeypatch.setattr(train, "resolve_run", stop)
    assert train.main(["--recipe", "tiny-cpu"]) == 2
    assert seen == {"NCCL_P2P_DISABLE": "1"}
    out = capsys.readouterr().out
    assert out.count("no peer-to-peer access") == 1, out


def test_doctor_reports_gpus_without_p2p_with_the_fix() -> None:
    report = doctor.Report()
    doctor.check_p2p(report, 2, [(0, 1)])
    assert report.sections["GPUs"] == [("peer-to-peer", "NONE between GPUs 0-1")]
    ((problem, fix),) = report.warnings
    assert "no peer-to-peer access" in problem and "NCCL_P2P_DISABLE=1" in fix


def test_doctor_says_all_pairs_have_p2p_and_is_silent_for_one_gpu() -> None:
    report = doctor.Report()
    doctor.check_p2p(report, 4, [])
    assert report.sections["GPUs"] == [("peer-to-peer", "every pair of the 4 GPUs")] and not report.warnings
    report = doctor.Report()
    doctor.check_p2p(report, 1, [])
    assert report.sections == {} and not report.warnings
