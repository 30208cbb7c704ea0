"""The libraries' own logs, warnings and progress bars, kept out of a run's output unless --verbose."""

from __future__ import annotations

import logging
import os
import warnings


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


# bitsandbytes 0.50's CPU backend, at import on a CPU with AVX512-BF16, tries to fetch a 4-bit matmul
# kernel from the Hub ("kernels-community/quantization-bitsandbytes") and logs a warning when it cannot.
# PEFT imports bitsandbytes whenever it is installed, so every LoRA run printed it, quantised or not; the
# kernel only speeds up 4-bit inference on a CPU, and without it bitsandbytes runs its own code. Offline
# (HF_HUB_OFFLINE=1) the kernels package logs its own line about that fetch instead (kernels 0.11).
# A logger's filter sees only records logged on that very logger: each one is named.
KERNELS_COMMUNITY_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub")


class _NotKernelsCommunity(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


def quiet(verbose: bool) -> None:
    """Keep library logs and progress bars out of the training output unless --verbose.

    Must run before DeepSpeed is imported: its logger is (re)configured at import, but a
    filter attached to the logger object beforehand survives that and drops the
    "Setting accelerator to CPU" style warnings every rank prints.
    """
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Writing model shards" bars on export
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").addFilter(_BelowError())
    for name in KERNELS_COMMUNITY_LOGGERS:
        logging.getLogger(name).addFilter(_NotKernelsCommunity())
    for name in ("accelerate", "torch.distributed", "torch._dynamo", "torch._inductor", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
