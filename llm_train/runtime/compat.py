"""Resuming a run whose optimizer is on NVMe: what DeepSpeed 0.19.8's load leaves out, put back.

With `offload_optimizer: nvme`, ZeRO-3 keeps each swapped sub-group's fp32 master, Adam m and v in
swap files under NVME_PATH/zero_stage_3/optimizer/rankR. `engine.save_checkpoint` copies those files
into the checkpoint (engine.py 4937-4950, `offloaded_tensors/rankR`, gradients left out) and
`engine.load_checkpoint` copies them back (engine.py 4469-4481). But on that path it skips the ZeRO
optimizer's own state (engine.py 4456: `load_zero_checkpoint and not self.zero_nvme_offload_optimizer()`):
CPU Adam's step counts, and the master, m and v of the sub-groups too small to swap (under
max(1 MiB, aio block_size): the norms). The first step after a resume then creates m and v anew at
step 0 and ignores the files: measured on CPU (tests/e2e/test_host_offload.py), the resumed losses
left the uninterrupted run's at the first resumed step (7.9238 against 7.9234 on tiny-cpu).

`restore_swapped_state` runs DeepSpeed's own ZeRO load after the engine's (`_load_zero_checkpoint`,
the step it skipped), then points each swapped sub-group's Adam states at the restored files: the
checkpoint holds them as empty tensors (swapped out when it was saved), which the swapper would not
swap back in (`is_swappable_tensor`: too small), so each becomes a zero-stride placeholder of the
sub-group's size, whose storage the next swap-in replaces with the file's contents
(optimizer_utils.py `set_swap_buffers`). No full-size host copy is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def restore_swapped_state(engine: DeepSpeedEngine, load_dir: str, tag: str) -> bool:
    """After `engine.load_checkpoint` of an NVMe-offload run: load what it skipped (module docstring).

    Returns whether there was anything to do (False without NVMe optimizer offload).
    """
    optimizer = engine.optimizer
    swapper = getattr(optimizer, "optimizer_swapper", None)
    if swapper is None:
        return False
    engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True)
    for i, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        if not optimizer._swappable_optimizer_subgroup(i):
            continue  # held in host RAM: _load_zero_checkpoint restored it whole
        numel = int(optimizer.fp16_partitioned_groups_flat_numel[i])
        state = optimizer.optimizer.state.get(master, {})
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.numel() == 0:
                state[key] = torch.zeros(1, dtype=value.dtype).expand(numel)
    swapper.purge_state()  # the state tensors are named (and their files found) again at the next swap-in
    return True
