"""The libraries' own logs, warnings and progress bars, kept out of a run's output unless --verbose."""

from __future__ import annotations

import logging
import os
import warnings


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


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
    for name in ("accelerate", "torch.distributed", "torch._dynamo", "torch._inductor", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
