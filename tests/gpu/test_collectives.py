"""llm_train.runtime.base.collectives on a real CUDA device: a world of one under NCCL.

The CPU suite (tests/unit/test_collectives.py) can only check where tensors are sent, with
the meta device standing in for CUDA; NCCL itself is what refuses a CPU tensor ("No backend type
associated with device type cpu"). Here the real thing runs: one NCCL rank on cuda:0 (NCCL refuses two ranks on one GPU, so a
world of one is what a one-GPU machine can check), every Collectives operation called the way
the loop and the checkpoint protocol call it, and its value checked. The last test shows the
check can fail: NCCL rejects a CPU tensor that bypasses the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from llm_train.runtime.base import collectives
from llm_train.runtime.base.collectives import Collectives, comm_device
from tests.helpers import free_port
from tests.unit.test_collectives import CALLS

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)
# What each call of CALLS (CPU inputs, as the unit tests make them) returns in a world of one;
# a tensor result comes back on its input's device, compared here as a list.
EXPECTED: dict[str, Any] = {
    "sum": [1.0, 1.0, 1.0],
    "mean": 2.0,
    "mean_and_any": (2.0, [False, True]),
    "any": True,
    "all_finite": False,  # CALLS hands it a NaN
    "barrier": None,
    "gather_objects": [{"rank": 0}],
    "from_rank0": "step-00000002",
}


@pytest.fixture(scope="module")
def nccl_world_of_one() -> Iterator[None]:
    """The world Accelerate / DeepSpeed make on one GPU: NCCL only, rank 0 of 1, on cuda:0."""
    assert not collectives.initialized()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        collectives.destroy()
    assert not collectives.initialized()


def test_the_group_is_nccl_and_talks_on_the_current_cuda_device(nccl_world_of_one: None) -> None:
    assert str(dist.get_backend()).lower() == "nccl"
    assert collectives.world_size() == 1 and collectives.rank() == 0
    assert comm_device() == CUDA0
    assert Collectives().device == CUDA0


def test_every_operation_is_checked_here() -> None:
    assert set(EXPECTED) == set(CALLS), "a new collective needs its expected value here"


@pytest.mark.parametrize("operation", sorted(EXPECTED))
def test_each_operation_returns_the_right_value_from_cpu_inputs(
    nccl_world_of_one: None, operation: str
) -> None:
    result = CALLS[operation](Collectives())
    if isinstance(result, torch.Tensor):
        assert result.device == torch.device("cpu")  # back on the caller's device
        result = result.tolist()
    assert result == EXPECTED[operation]


def test_operations_on_cuda_inputs_return_the_right_values(nccl_world_of_one: None) -> None:
    """The loop's loss and gradient norm live on the GPU: the same calls with CUDA tensors."""
    comm = Collectives()
    total = comm.sum(torch.tensor([1.0, 2.0], device=CUDA0))
    assert total.device == CUDA0 and total.tolist() == [1.0, 2.0]
    assert comm.mean(torch.tensor(4.0, device=CUDA0)) == 4.0
    assert comm.mean_and_any(torch.tensor(3.0, device=CUDA0), [0.0, 1.0]) == (3.0, [False, True])
    assert comm.mean_and_any(torch.tensor(3.0, device=CUDA0), [0.0, 0.0]) == (3.0, [False, False])
    assert comm.any(True) and not comm.any(False)
    assert comm.all_finite(torch.tensor(1.0, device=CUDA0))
    assert not comm.all_finite(torch.tensor(float("inf"), device=CUDA0))
    comm.barrier()
    assert comm.gather_objects({"step": 3}) == [{"step": 3}]
    assert comm.from_rank0({"latest": "step-00000004"}) == {"latest": "step-00000004"}


def test_nccl_refuses_a_cpu_tensor_that_bypasses_the_module(nccl_world_of_one: None) -> None:
    """The failure the module exists to prevent (NCCL takes only CUDA tensors), so the checks above can fail."""
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1))
