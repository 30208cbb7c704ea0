"""Every collective llm_train issues itself, with its tensors on the device the group talks on.

Why one module: on GPUs Accelerate and DeepSpeed create an NCCL process group, and NCCL
accepts only CUDA tensors. An all-reduce of a CPU tensor fails there with "No backend type
associated with device type cpu", while the very same call passes on CPU/gloo, so the CPU
test suite cannot see this class of bug. It can be reproduced on CPU, though:
`init_process_group("cuda:gloo")` binds gloo to the cuda device type only, and a CPU-tensor
`all_reduce` then fails with that same message (checked with 2 processes). Hence:

- no other module of the package imports `torch.distributed` (or `deepspeed.comm`):
  tests/unit/test_collectives.py fails if one does;
- every tensor goes to `comm_device()` before the collective and the result comes back as
  a Python value (or on the caller's device): the current CUDA device under NCCL, the CPU
  under gloo;
- the collectives run whenever a process group exists, also in a world of one. A one-GPU
  machine can only ever run a world of one (NCCL refuses two ranks on one GPU), so a
  `world > 1` shortcut would hide this path from the only GPU check there is. Without a
  process group (tools, unit tests) each function returns the local value.

Object collectives (`gather_objects`, `from_rank0`) pickle through tensors that
torch.distributed places itself once `torch.cuda.set_device` has run (Accelerate and the
pipeline launcher do that); they live here so that the rule "one home" has no exception.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn  # the autograd-aware collectives

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")

CPU = torch.device("cpu")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def join_restarted_world(timeout: timedelta) -> None:
    """After a torchrun restart (--max_restarts), join the new attempt's world under keys of its own.

    torchrun's agent keeps one key-value store for every attempt, and the workers of a
    restarted group read the previous attempt's addresses from it: gloo and NCCL then fail
    with "Connection refused" (pytorch/pytorch#167288; reproduced with torch 2.13 and a bare
    gloo script). Creating the process group here, on a store prefixed with the attempt
    number, avoids it; Accelerate and DeepSpeed use a process group that already exists.
    The first attempt is left to them, unchanged.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or initialized() or "MASTER_ADDR" not in os.environ:
        return
    rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(minutes=30),
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"llm_train/attempt_{attempt}", store),
        rank=rank_,
        world_size=world,
        timeout=timeout,
    )


def device_for_backend(backend: str) -> torch.device:
    """The device a group with this backend string communicates on.

    `backend` is what `dist.get_backend` reports: "nccl", "gloo", or a per-device map such
    as "cpu:gloo,cuda:nccl". A group with a CPU backend takes CPU tensors (the cheapest for
    the few bytes sent here); a group that only speaks NCCL (or binds gloo to cuda only, the
    way the tests reproduce the NCCL failure on CPU) needs the current CUDA device.
    """
    backend = backend.lower()
    if ":" in backend:
        devices = {part.split(":", 1)[0].strip() for part in backend.split(",")}
        return CPU if "cpu" in devices else _current_cuda()
    return _current_cuda() if backend == "nccl" else CPU


def _current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """Where tensors must be for a collective on `group` (None: the world)."""
    if not initialized():
        return CPU
    return device_for_backend(str(dist.get_backend(group)))


class Collectives:
    """The collectives of one process group (default: the world), as small typed operations.

    An object rather than bare functions so that callers can be handed a group-bound
    instance, and tests a fake one.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    @property
    def device(self) -> torch.device:
        return comm_device(self.group)

    @property
    def size(self) -> int:
        return world_size_of(self.group)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType | None = None) -> torch.Tensor:
        """All-reduce a copy of `tensor` on the communication device; the result stays there."""
        on_comm = tensor.detach().to(self.device, dtype=torch.float32).clone()
        if initialized():
            dist.all_reduce(on_comm, op=op if op is not None else dist.ReduceOp.SUM, group=self.group)
        return on_comm

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise fp32 sum over the group, back on `tensor`'s device."""
        return self._all_reduce(tensor).to(tensor.device)

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor."""
        return float(self._all_reduce(value.reshape(1)).cpu()[0]) / world_size_of(self.group)

    def means(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """The mean over ranks of each named scalar, in one collective (every rank passes the same names)."""
        if not values:
            return {}
        packed = self._all_reduce(
            torch.stack([v.detach().float().reshape(()) for v in values.values()])
        ).cpu()
        return {k: float(v) / world_size_of(self.group) for k, v in zip(values, packed.tolist(), strict=True)}

    def mean_and_any(self, value: torch.Tensor, flags: list[float]) -> tuple[float, list[bool]]:
        """One collective for the step: the mean of a scalar over ranks, and which flags any rank raised.

        Flags are 0/1, so their sum is positive exactly when some rank raised one.
        """
        flag_tensor = torch.tensor(flags, dtype=torch.float32, device=value.device)
        packed = self._all_reduce(torch.cat([value.detach().float().reshape(1), flag_tensor])).cpu()
        return float(packed[0]) / world_size_of(self.group), [bool(f > 0) for f in packed[1:].tolist()]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank."""
        value = torch.tensor([1.0 if flag else 0.0])
        return bool(self._all_reduce(value, op=dist.ReduceOp.MAX).cpu()[0] > 0)

    def all_finite(self, value: torch.Tensor) -> bool:
        """Whether `value` is finite on every rank."""
        return not self.any(not bool(torch.isfinite(value.detach()).all()))

    def barrier(self) -> None:
        if not initialized():
            return
        device = self.device
        if device != CPU:
            # Without device_ids NCCL guesses the device from the rank and warns that it may hang.
            dist.barrier(group=self.group, device_ids=[device.index])
        else:
            dist.barrier(group=self.group)

    def gather_with_grad(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order, differentiable (a loss reduced over a sequence-parallel group).

        Gathered on the communication device; the results come back on `tensor`'s device.
        """
        if not initialized():
            return [tensor]
        gathered = dist_nn.all_gather(tensor.to(self.device), group=self.group)
        return [t.to(tensor.device) for t in gathered]

    def gather_objects(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not initialized():
            return [obj]
        gathered: list[Any] = [None] * world_size_of(self.group)
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def world_size_of(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def timeout_s() -> float | None:
    """The timeout of the world's process group as its backend holds it (None if none or unreadable).

    What Accelerate and DeepSpeed actually gave the backend, read back so that a run records it
    (world.json) rather than what it asked for. torch 2.13 exposes it only on the backend's
    options (`_timeout`, the field init_process_group sets); checked for gloo on CPU.
    """
    if not initialized():
        return None
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(comm_device())
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return None


WORLD = Collectives()


def destroy() -> None:
    """Tear the process group down (idempotent): the end of a run, or after a stop signal."""
    if initialized():
        dist.destroy_process_group()
