"""llm_train's own collectives: one home, tensors on the group's device, the same calls in a world of one.

NCCL accepts only CUDA tensors (a CPU tensor fails with "No backend type associated with device type
cpu"). No GPU is needed to check the rule:
the backend is reported as NCCL, the "current CUDA device" is stood in for by the meta
device (tensors can be placed there without a GPU), and each torch.distributed call records
where its tensors are, then stops the call.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from llm_train.runtime.base import collectives
from llm_train.runtime.base.collectives import Collectives, device_for_backend
from tests.helpers import free_port

PACKAGE = Path(collectives.__file__).resolve().parents[1]  # runtime/, every room
STAND_IN_CUDA = torch.device("meta")


def test_device_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for_backend("gloo") == torch.device("cpu")
    assert device_for_backend("nccl") == torch.device("cuda", 3)
    assert device_for_backend("NCCL") == torch.device("cuda", 3)
    # A group with a CPU backend takes CPU tensors; one bound to cuda only does not (on CPU,
    # init_process_group("cuda:gloo") then refuses a CPU-tensor all_reduce just as NCCL does).
    assert device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert device_for_backend("cuda:gloo") == torch.device("cuda", 3)


class Stop(Exception):
    """Raised by a recording collective once it has seen its arguments."""


@pytest.fixture
def nccl_world(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """A world of one that reports NCCL; every collective records (name, device) and stops."""
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(collectives, "_current_cuda", lambda: STAND_IN_CUDA)

    def tensor_call(name: str):
        def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            seen.append((name, tensor.device))
            raise Stop

        return record

    def barrier(group: Any = None, device_ids: list[int] | None = None) -> None:
        seen.append(("barrier", device_ids))
        raise Stop

    def object_call(name: str):
        def record(*args: Any, **kwargs: Any) -> None:
            seen.append((name, None))
            raise Stop

        return record

    monkeypatch.setattr(dist, "all_reduce", tensor_call("all_reduce"))
    monkeypatch.setattr(dist_nn, "all_gather", tensor_call("all_gather"))
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "all_gather_object", object_call("all_gather_object"))
    monkeypatch.setattr(dist, "broadcast_object_list", object_call("broadcast_object_list"))
    return seen


# Every public operation of Collectives, called as the loop and the checkpoint protocol call it.
CALLS = {
    "sum": lambda c: c.sum(torch.ones(3)),
    "mean": lambda c: c.mean(torch.tensor(2.0)),
    "means": lambda c: c.means({"loss": torch.tensor(2.0), "reward_accuracy": torch.tensor(0.5)}),
    "mean_and_any": lambda c: c.mean_and_any(torch.tensor(2.0), [0.0, 1.0]),
    "any": lambda c: c.any(True),
    "all_finite": lambda c: c.all_finite(torch.tensor(float("nan"))),
    "barrier": lambda c: c.barrier(),
    "gather_with_grad": lambda c: c.gather_with_grad(torch.ones(2, requires_grad=True)),
    "gather_objects": lambda c: c.gather_objects({"rank": 0}),
    "from_rank0": lambda c: c.from_rank0("step-00000002"),
}


def test_every_operation_is_covered_here() -> None:
    public = {
        name
        for name, member in inspect.getmembers(Collectives)
        if not name.startswith("_") and (inspect.isfunction(member))
    }
    assert public == set(CALLS), "a new collective needs a line in CALLS (and a device check)"


@pytest.mark.parametrize("operation", sorted(CALLS))
def test_under_nccl_every_collective_gets_its_tensors_on_the_cuda_device(
    nccl_world: list[tuple[str, Any]], operation: str
) -> None:
    with pytest.raises(Stop):
        CALLS[operation](Collectives())
    assert len(nccl_world) == 1, f"{operation} issued {nccl_world}"
    name, where = nccl_world[0]
    if name in ("all_reduce", "all_gather"):
        assert where == STAND_IN_CUDA
    elif name == "barrier":
        # NCCL's barrier must be told the device (its index), or it guesses one from the rank.
        assert where == [STAND_IN_CUDA.index]
        assert Collectives().device != torch.device("cpu")
    else:
        # Object collectives place their own pickled tensors (after torch.cuda.set_device).
        assert name in ("all_gather_object", "broadcast_object_list")


def test_under_gloo_tensors_stay_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: devices.append(t.device))
    assert Collectives().mean(torch.tensor(5.0)) == 5.0
    assert devices == [torch.device("cpu")]


def test_a_world_of_one_runs_the_real_collectives() -> None:
    """No `world > 1` shortcut: with a process group of one, every call goes through it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        comm = Collectives()
        assert comm.device == torch.device("cpu")
        assert torch.equal(comm.sum(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
        assert comm.mean(torch.tensor(4.0)) == 4.0
        assert comm.means({"a": torch.tensor(4.0), "b": torch.tensor(0.25)}) == {"a": 4.0, "b": 0.25}
        assert comm.means({}) == {}
        assert comm.mean_and_any(torch.tensor(3.0), [0.0, 1.0]) == (3.0, [False, True])
        assert comm.any(True) and not comm.any(False)
        assert comm.all_finite(torch.tensor(1.0)) and not comm.all_finite(torch.tensor(float("inf")))
        comm.barrier()
        assert comm.gather_objects({"a": 1}) == [{"a": 1}]
        assert comm.from_rank0("x") == "x"
        local = torch.tensor([2.0, 3.0], requires_grad=True)
        (gathered,) = comm.gather_with_grad(local)
        (3 * gathered).sum().backward()
        assert torch.equal(gathered.detach(), local.detach()) and torch.equal(
            local.grad, torch.full((2,), 3.0)
        )
    finally:
        collectives.destroy()
    assert not collectives.initialized()


def test_without_a_process_group_the_local_value_is_returned() -> None:
    assert not collectives.initialized()
    comm = Collectives()
    assert comm.mean_and_any(torch.tensor(2.5), [1.0, 0.0]) == (2.5, [True, False])
    assert comm.gather_objects(7) == [7] and comm.from_rank0(7) == 7
    assert collectives.world_size() == 1 and collectives.rank() == 0


# ---------------------------------------------------------------- the one-home rule

FORBIDDEN_MODULES = ("torch.distributed", "deepspeed.comm")


def _offences(path: Path) -> list[str]:
    """Imports of torch.distributed / deepspeed.comm, and lookups of them by name, in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):  # sys.modules.get("torch.distributed"), importlib.import_module(...)
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed"):
            names = [ast.unparse(node)]
        for name in names:
            if any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    return found


def test_no_other_module_talks_to_torch_distributed_directly() -> None:
    home = Path(collectives.__file__).resolve()
    offences = [o for f in sorted(PACKAGE.rglob("*.py")) if f.resolve() != home for o in _offences(f)]
    # The compatibility boundary patches the op build of DeepSpeed's backend there (skip_unused_shm_op);
    # it issues no collective.
    offences = [
        o for o in offences if not re.fullmatch(r"runtime/base/compat.py:\d+: deepspeed.comm.torch", o)
    ]
    assert offences == [], "use llm_train.runtime.base.collectives instead:\n" + "\n".join(offences)


def test_the_rule_catches_each_way_of_reaching_torch_distributed(tmp_path: Path) -> None:
    sample = tmp_path / "llm_train" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import torch.distributed as dist\n"
        "from torch.distributed import all_reduce\n"
        "from torch import distributed\n"
        "from deepspeed import comm\n"
        "import sys\n"
        "d = sys.modules.get('torch.distributed')\n"
        "import torch\n"
        "torch.distributed.barrier()\n"
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "llm_train"
    try:
        lines = {int(o.split(":")[1]) for o in _offences(sample)}
    finally:
        PACKAGE = saved
    assert lines == {1, 2, 3, 4, 6, 8}
