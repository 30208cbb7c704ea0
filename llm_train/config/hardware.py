"""GPUs the planner knows by name: memory, bf16 support and peak dense tensor throughput.

Used by `llm-train plan --gpu NAME` (memory and bf16), by the planner's speed model and
by MFU reporting (peak TFLOP/s). Pure data, no torch import.

Memory is what `nvidia-smi` reports as total (MiB / 1024), not the marketing number:
an "A10 24 GB" has 22.5 GiB, and that is what has to hold the training run.

`peak_tflops` is the dense (no 2:4 sparsity) 16-bit tensor-core throughput with fp32
accumulation, from NVIDIA's data sheets / architecture whitepapers: bf16 where the card
has it, else fp16 (the precision such a card trains in). GeForce cards run fp32
accumulation at half the fp16-accumulate rate; training uses fp32 accumulation, so
their number is the lower one.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from llm_train.errors import UserError
from llm_train.units import GiB

if TYPE_CHECKING:
    from llm_train.config.recipe import Recipe


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    bf16: bool
    peak_tflops: float
    """Dense 16-bit tensor TFLOP/s (bf16, or fp16 where bf16 is missing), fp32 accumulate."""
    compute_capability: tuple[int, int]
    pcie: tuple[int, int]
    """(PCIe generation, lanes) of the card's host link: what offload and host copies cross."""
    memory_gbs: float
    """Memory bandwidth in GB/s: what bitsandbytes' dequantisation (memory-bound) streams at."""
    source: str
    """Where peak, memory bandwidth and link come from (docs/consumer-cards.md lists them)."""
    nvlink: bool = False
    """GPUs of one node talk over NVLink (SXM boards); else PCIe."""
    aliases: tuple[str, ...] = ()


# Sources (the full list with links: docs/consumer-cards.md#the-card-table):
TURING = "Turing whitepaper (TU102, FP16 tensor with FP32 accumulate); NVIDIA product page"
AMPERE = "Ampere GA102 whitepaper appendix A (BF16 tensor, FP32 accumulate, dense); NVIDIA product page"
ADA = "Ada Lovelace whitepaper appendix A (FP16/BF16 tensor, FP32 accumulate, dense); NVIDIA product page"
BLACKWELL = "RTX Blackwell whitepaper (FP16/BF16 tensor, FP32 accumulate, dense); NVIDIA product page"

GPUS: tuple[GPUSpec, ...] = (
    GPUSpec("RTX 2080 Ti", 11264 / 1024, False, 53.8, (7, 5), (3, 16), 616, TURING, aliases=("2080ti", "rtx2080ti")),
    # GA106, 28 SMs x 1.777 GHz x 512 dense 16-bit FLOP/clock/SM at fp32 accumulate (GeForce rate) = 25.5;
    # 12.7 is its FP32 CUDA-core rate, not a tensor rate.
    GPUSpec("RTX 3060", 12288 / 1024, True, 25.5, (8, 6), (4, 16), 360, AMPERE, aliases=("3060", "rtx3060", "rtx306012gb")),
    GPUSpec("RTX 3090", 24576 / 1024, True, 71.0, (8, 6), (4, 16), 936, AMPERE, aliases=("3090", "rtx3090")),
    # AD106 is wired for 8 lanes: half the host bandwidth of the other cards of its generation.
    GPUSpec(
        "RTX 4060 Ti 16GB", 16380 / 1024, True, 44.2, (8, 9), (4, 8), 288, ADA, aliases=("4060ti", "rtx4060ti", "rtx4060ti16")
    ),
    GPUSpec("RTX 4070", 12282 / 1024, True, 58.4, (8, 9), (4, 16), 504, ADA, aliases=("4070", "rtx4070")),
    GPUSpec("RTX 4080", 16376 / 1024, True, 97.5, (8, 9), (4, 16), 717, ADA, aliases=("4080", "rtx4080")),
    GPUSpec("RTX 4090", 24564 / 1024, True, 165.2, (8, 9), (4, 16), 1008, ADA, aliases=("4090", "rtx4090")),
    GPUSpec("RTX 5090", 32607 / 1024, True, 209.5, (12, 0), (5, 16), 1792, BLACKWELL, aliases=("5090", "rtx5090")),
    GPUSpec("T4", 15360 / 1024, False, 65.0, (7, 5), (3, 16), 320, "T4 datasheet (FP16/FP32 mixed)", aliases=("teslat4",)),
    GPUSpec(
        "V100", 32768 / 1024, False, 125.0, (7, 0), (3, 16), 900, "V100 datasheet (SXM2, tensor)", nvlink=True,
        aliases=("v10032gb", "teslav100"),
    ),
    GPUSpec("A10", 23028 / 1024, True, 125.0, (8, 6), (4, 16), 600, "A10 datasheet (BF16 tensor, dense)", aliases=("a10g",)),
    GPUSpec("L4", 23034 / 1024, True, 121.0, (8, 9), (4, 16), 300, "L4 datasheet (BF16 tensor, 242 with sparsity)"),
    GPUSpec("L40S", 46068 / 1024, True, 362.0, (8, 9), (4, 16), 864, "L40S datasheet (BF16 tensor, dense)"),
    GPUSpec(
        "A100-40GB", 40960 / 1024, True, 312.0, (8, 0), (4, 16), 1555, "A100 datasheet (BF16 tensor, dense)",
        nvlink=True, aliases=("a10040", "a10040gb"),
    ),
    GPUSpec(
        "A100-80GB", 81920 / 1024, True, 312.0, (8, 0), (4, 16), 2039, "A100 datasheet (BF16 tensor, dense; SXM)",
        nvlink=True, aliases=("a100", "a10080", "a10080gb"),
    ),
    GPUSpec(
        "H100", 81559 / 1024, True, 989.0, (9, 0), (5, 16), 3350, "H100 datasheet (SXM, BF16 tensor, dense)",
        nvlink=True, aliases=("h10080gb", "h100sxm"),
    ),
    GPUSpec(
        "H200", 143771 / 1024, True, 989.0, (9, 0), (5, 16), 4800, "H200 datasheet (SXM, BF16 tensor, dense)",
        nvlink=True, aliases=("h200sxm",),
    ),
)  # fmt: skip


def _key(text: str) -> str:
    # "NVIDIA GeForce RTX 4090" / "rtx-4090" / "RTX4090" all compare equal.
    text = text.lower()
    for noise in ("nvidia", "geforce", "tesla", "pcie", "sxm5", "sxm4", "sxm2", "hbm3", "hbm2e"):
        text = text.replace(noise, "")
    return re.sub(r"[^a-z0-9]", "", text)


def find_gpu(name: str) -> GPUSpec | None:
    """The table entry for a user-typed or driver-reported name, or None."""
    key = _key(name)
    for spec in GPUS:
        if key == _key(spec.name) or key in spec.aliases:
            return spec
    # Driver names carry extra words ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3").
    for spec in sorted(GPUS, key=lambda s: -len(_key(s.name))):
        if _key(spec.name) in key:
            return spec
    if "a100" in key:
        return find_gpu("A100-80GB" if "80" in key else "A100-40GB")
    return None


def gpu_spec(name: str) -> GPUSpec:
    """Like find_gpu, but an unknown name is a one-line UserError listing the known ones."""
    spec = find_gpu(name)
    if spec is None:
        known = ", ".join(s.name.replace(" ", "-") for s in GPUS)
        raise UserError(f"--gpu {name}: unknown GPU; known: {known}; or give its memory with --gpu-mem GIB")
    return spec


def peak_tflops(name: str) -> float | None:
    """Dense 16-bit peak TFLOP/s of a GPU by (driver) name; None when unknown. For MFU."""
    spec = find_gpu(name)
    return spec.peak_tflops if spec else None


# Keep 5% of GPU memory free beyond the estimate (which already counts allocator slack):
# the estimate claims +-15%, and an OOM at step 900 costs more than a slower step.
GPU_HEADROOM = 0.05
# What the operating system itself keeps: kernel, services, a desktop session (a Linux desktop
# idles at ~1.5-2.5 GiB; a headless server at under 1). A flat amount, not a share: 5% of a 16 GiB
# desktop is too little to matter, and a share that grows with the machine would make 16-32 GiB
# desktops look smaller than they are while reserving 100 GiB on a 2 TiB node. Page cache is
# reclaimable and needs no reserve. `llm-train plan` prints it.
HOST_RESERVE_BYTES = 3 * GiB
# The NVMe drive of ZeRO-Infinity when the user gives no speeds (`llm-train plan --nvme-read-gbs/--nvme-write-gbs`,
# `llm-train doctor --recipe ...` measures them): a PCIe 4.0 x4 TLC drive. Its data sheet's sequential read
# (~7 GB/s) less DeepSpeed's per-request overhead; writes past the drive's SLC cache (a step writes ~16 bytes
# per parameter, 100+ GB for 7B) run at about half the read speed on such drives.
NVME_READ_BYTES_PER_S = 6e9
NVME_WRITE_BYTES_PER_S = 3e9
# Speed model stand-ins when the hardware's peak is unknown (only ratios matter there): a card between an
# RTX 4070 and a 4080 on a PCIe 4.0 x16 slot.
UNKNOWN_GPU_PEAK_TFLOPS = 100.0
UNKNOWN_GPU_MEMORY_GBS = 500.0
UNKNOWN_GPU_PCIE = (4, 16)
CPU_PEAK_TFLOPS = 0.2
# Bytes per second per lane and direction of each PCIe generation after line coding (PCI-SIG base
# specifications: 8 GT/s for 3.0, 16 for 4.0, 32 for 5.0, all 128b/130b): x16 gives 15.75 / 31.5 / 63 GB/s.
PCIE_LANE_BYTES_PER_S = {3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8, 5: 32e9 * 128 / 130 / 8}


def native_bf16(capability: tuple[int, int]) -> bool:
    """bf16 in hardware: Ampere (compute capability 8.0) and newer.

    Not torch.cuda.is_bf16_supported(): by default it also counts emulation, which says yes on
    V100, T4 and RTX 20xx, where bf16 runs emulated and slow (precision=auto must pick fp16
    there), and it allocates a tensor, creating a CUDA context in whichever process asks.
    """
    return capability >= (8, 0)


@dataclass(frozen=True)
class Device:
    """What the processes will run on. Read from torch at launch, or from the recipe for dry runs."""

    kind: str  # "cuda" | "cpu"
    name: str
    bf16: bool
    compute_capability: tuple[int, int] | None = None
    shared_memory_per_block: int | None = None
    """Bytes of shared memory one thread block may opt in to, as torch reads it (None: not read; the
    attention kernel then goes by compute capability: config/attention_kernel.py)."""

    @staticmethod
    def detect() -> Device:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            optin = getattr(props, "shared_memory_per_block_optin", None)  # NVIDIA only; absent on ROCm
            return Device(
                kind="cuda",
                name=props.name,
                bf16=native_bf16((props.major, props.minor)),
                compute_capability=(props.major, props.minor),
                shared_memory_per_block=int(optin) if optin else None,
            )
        return Device(kind="cpu", name="cpu", bf16=True)

    @staticmethod
    def declared(recipe: Recipe) -> Device:
        # A dry run assumes the hardware the recipe is written for; every card it names supports bf16
        # unless the recipe says fp16, which is why it would. A card in the table brings its compute
        # capability (what the attention kernel's choice depends on).
        name = recipe.hardware.gpu_name or recipe.hardware.device
        spec = find_gpu(recipe.hardware.gpu_name) if recipe.hardware.gpu_name else None
        return Device(
            kind=recipe.hardware.device,
            name=name,
            bf16=recipe.precision != "fp16",
            compute_capability=spec.compute_capability
            if spec is not None and recipe.hardware.device == "cuda"
            else None,
        )


# --- hardware -------------------------------------------------------------------------------------


class DriveSpeeds(TypedDict, total=False):
    """Hardware's drive fields a command line sets (`dataclasses.replace(hw, **speeds)`)."""

    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float


@dataclass(frozen=True)
class Hardware:
    """What the run will have: devices (per GPU) and the host (per node)."""

    kind: str  # "cuda" | "cpu"
    name: str
    gpus: int  # processes in the world (GPUs, or CPU processes)
    gpus_per_node: int
    gpu_mem_bytes: int  # per GPU; 0 on CPU
    host_ram_bytes: int  # per node
    bf16: bool
    peak_tflops: float
    nvlink: bool = False
    compute_capability: tuple[int, int] | None = None
    sources: tuple[str, ...] = ()  # where the numbers came from, for the printout
    nvme_read_bytes_per_s: float = NVME_READ_BYTES_PER_S
    """Sequential read speed of the node's NVMe drive (ZeRO-Infinity's swap-ins)."""
    nvme_write_bytes_per_s: float = NVME_WRITE_BYTES_PER_S
    """Sustained sequential write speed of that drive (swap-outs)."""
    pcie: tuple[int, int] = UNKNOWN_GPU_PCIE
    """(PCIe generation, lanes) of each GPU's host link."""
    memory_bytes_per_s: float = UNKNOWN_GPU_MEMORY_GBS * 1e9
    """Each GPU's memory bandwidth."""

    @property
    def pcie_bytes_per_s(self) -> float:
        """The raw rate of one GPU's host link, per direction (what a copy can at best reach)."""
        generation, lanes = self.pcie
        return PCIE_LANE_BYTES_PER_S[generation] * lanes

    @property
    def host_limit_bytes(self) -> int:
        return max(0, self.host_ram_bytes - HOST_RESERVE_BYTES)

    @property
    def gpu_limit_bytes(self) -> int:
        return int(self.gpu_mem_bytes * (1 - GPU_HEADROOM))

    def device(self) -> Device:
        if self.kind == "cpu":
            return Device(kind="cpu", name="cpu", bf16=True)
        return Device(kind="cuda", name=self.name, bf16=self.bf16, compute_capability=self.compute_capability)

    def describe(self) -> str:
        if self.kind == "cpu":
            where = f"{self.gpus} CPU process(es)"
        else:
            bf16 = "bf16" if self.bf16 else "no bf16: fp16"
            where = (
                f"{self.gpus} x {self.name} ({self.gpu_mem_bytes / GiB:.2f} GiB, {bf16}, "
                f"PCIe {self.pcie[0]}.0 x{self.pcie[1]})"
            )
            if self.gpus > self.gpus_per_node:
                where += f" on {-(-self.gpus // self.gpus_per_node)} nodes"
        text = f"{where}; host RAM {self.host_ram_bytes / GiB:.2f} GiB per node"
        return text + (f"  [{'; '.join(self.sources)}]" if self.sources else "")


def _detected_gpus() -> tuple[int, str, int, bool, tuple[int, int]] | None:
    """(count, name, memory bytes, bf16, compute capability) of this machine's GPUs, or None."""
    import shutil

    if shutil.which("nvidia-smi") is None and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # no NVIDIA driver tools: skip the 2 s torch import
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return (
        torch.cuda.device_count(),
        props.name,
        int(props.total_memory),
        native_bf16((props.major, props.minor)),
        (props.major, props.minor),
    )


def gpus_without_p2p() -> list[tuple[int, int]]:
    """Pairs (i, j), i < j, of this node's visible GPUs that cannot reach each other's memory directly.

    Consumer cards (RTX 40xx, many RTX 30xx boards and PCIe topologies) have no peer-to-peer
    access; NCCL's P2P transport then hangs or fails on them instead of falling back, which is a
    frequent DeepSpeed report. Empty with fewer than two GPUs or no CUDA. Asks torch, so it
    initialises CUDA: call it after the allocator settings are in place (runtime/model/fast.py).
    """
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    return [
        (i, j)
        for i in range(count)
        for j in range(i + 1, count)
        # Both directions: one-way access still leaves NCCL a path it cannot use.
        if not (torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(j, i))
    ]


def describe_pairs(pairs: list[tuple[int, int]]) -> str:
    """'0-1, 2-3': GPU pairs as doctor and the run's notice print them."""
    return ", ".join(f"{i}-{j}" for i, j in pairs)


def host_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def hardware_for(
    gpus: int | None = None,
    gpu: str | None = None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    recipe: Recipe | None = None,
    detect: bool = True,
) -> Hardware:
    """Hardware from flags, else this machine's GPUs, else what the recipe declares, else this CPU."""
    # 0 is a value given, not "unset": refused rather than replaced by a default the user did not ask for.
    # argparse's float() also takes nan and inf, which no comparison below would catch (nan <= 0 is False)
    # and int(inf * GiB) raises: `0 < value < inf` is false for both.
    for flag, value in (("--gpu-mem", gpu_mem_gib), ("--host-ram", host_ram_gib)):
        if value is not None and not 0 < value < math.inf:
            raise UserError(f"{flag} {value:g}: give the memory in GiB (> 0), or leave it out")
    sources: list[str] = []
    spec: GPUSpec | None = gpu_spec(gpu) if gpu else None
    declared = recipe.hardware if recipe is not None else None
    kind = "cuda"
    name, mem, bf16, cc = "GPU", 0, True, None
    count_default = declared.world_size if declared else 1
    found = None
    from_recipe = False
    if spec or gpu_mem_gib:
        sources.append("--gpu" if spec else "--gpu-mem (bf16 assumed; --gpu NAME for a card without it)")
    elif declared is not None and declared.device == "cpu":
        kind = "cpu"
    elif detect and (found := _detected_gpus()) is not None:
        count, det_name, det_mem, bf16, cc = found
        spec = find_gpu(det_name)
        name, mem = det_name, det_mem
        count_default = count if declared is None else count_default
        sources.append("detected")
    elif declared is not None and (declared.gpu_name or declared.gpu_mem_gib):
        spec = find_gpu(declared.gpu_name) if declared.gpu_name else None
        if declared.gpu_mem_gib:
            gpu_mem_gib = declared.gpu_mem_gib
        from_recipe = True
        sources.append("GPU as the recipe declares")
    else:
        kind = "cpu"
        sources.append("no GPU found or named: CPU processes; --gpu/--gpu-mem to plan for a GPU")

    if spec is not None:
        name, bf16, cc = spec.name, spec.bf16, spec.compute_capability
        mem = mem or int(spec.memory_gib * GiB)
    if gpu_mem_gib:
        mem = int(gpu_mem_gib * GiB)
        if spec is None and found is None:
            name = f"{gpu_mem_gib:g} GiB GPU"
    if gpus is not None and gpus < 1:
        raise UserError(
            f"--gpus {gpus}: give the number of GPUs (>= 1), or leave it out for the detected count"
        )
    world = count_default if gpus is None else gpus
    if declared is not None and world == declared.world_size:
        per_node = declared.processes_per_node
    elif found is not None:
        per_node = min(world, found[0])
    else:
        per_node = min(world, 8)  # the usual node: up to 8 GPUs

    if host_ram_gib:
        host = int(host_ram_gib * GiB)
        sources.append("--host-ram")
    elif from_recipe and declared is not None and declared.host_ram_gib:
        # Planning for the machine the recipe is written for, not this one.
        host = int(declared.host_ram_gib * GiB)
        sources[-1] = "GPU and host RAM as the recipe declares; --gpu/--gpu-mem/--host-ram for yours"
    else:
        host = host_ram_bytes()
        sources.append("host RAM of this machine; --host-ram for another")
    if kind == "cpu":
        return Hardware("cpu", "cpu", world, per_node, 0, host, True, CPU_PEAK_TFLOPS, sources=tuple(sources))
    peak = spec.peak_tflops if spec else UNKNOWN_GPU_PEAK_TFLOPS
    return Hardware(
        kind="cuda",
        name=name,
        gpus=world,
        gpus_per_node=per_node,
        gpu_mem_bytes=mem,
        host_ram_bytes=host,
        bf16=bf16,
        peak_tflops=peak,
        nvlink=bool(spec and spec.nvlink),
        compute_capability=cc,
        sources=tuple(sources),
        pcie=spec.pcie if spec else UNKNOWN_GPU_PCIE,
        memory_bytes_per_s=(spec.memory_gbs if spec else UNKNOWN_GPU_MEMORY_GBS) * 1e9,
    )
