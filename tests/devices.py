"""The devices the unit tests resolve runs for, as `Device.detect()` would read them, and `resolve`.

One home for them: the tests used to write their own `Device(...)` with disagreeing arguments. Each
field below is what torch reports on that machine (config/hardware.py's `Device.detect`): bf16 is
native bf16 (compute capability 8.0 and newer), and CPU says bf16 as detect() does (precision=auto is
fp32 on CPU whatever it says: config/layout.py's `default_precision`).
"""

from __future__ import annotations

from dataclasses import replace

from llm_train.config.hardware import Device
from llm_train.config.resolution import Resolved, resolve_run

CPU = Device("cpu", "cpu", bf16=True)
# No bf16 in hardware (compute capability 7.5): precision=auto picks fp16, precision=bf16 is refused.
T4 = Device("cuda", "Tesla T4", bf16=False, compute_capability=(7, 5))
# shared_memory_per_block: the opt-in bytes per thread block torch reads (the attention kernel's input).
H100 = Device("cuda", "NVIDIA H100 80GB HBM3", True, (9, 0), 232448)
H200 = Device("cuda", "NVIDIA H200", True, (9, 0), 232448)  # the GPU machine
RTX_4090 = Device("cuda", "NVIDIA GeForce RTX 4090", True, (8, 9), 101376)
# The same card where torch did not report its shared memory: the kernel goes by compute capability.
RTX_4090_UNREAD = replace(RTX_4090, shared_memory_per_block=None)


def resolve(
    recipe: str = "tiny-cpu",
    overrides: list[str] | tuple[str, ...] = (),
    *,
    world_size: int | None = 2,
    device: Device | None = CPU,
    ds: str | None = None,
) -> Resolved:
    """`resolve_run` as the tests call it: tiny-cpu on two CPU processes unless told otherwise.

    world_size None / device None: the hardware the recipe declares (a dry run); `ds`: the DeepSpeed
    JSON (a shipped name or a path), as `--ds-config` gives it.
    """
    return resolve_run(recipe, list(overrides), world_size=world_size, device=device, ds_config_path=ds)
