"""The environment every test process and every launch it makes runs under (tests/conftest.py sets it first).

Kept free of heavy imports: conftest applies it before torch or huggingface_hub is imported, as both read
these variables once, at import.
"""

from __future__ import annotations

# Nothing in the tests may wait on a network that is not there: the hubs are unreachable from CI, and
# W&B runs offline (a local .wandb file, synced later if at all). Set for the session too, not only for
# the launches: without it a test that loads a hub name in-process (a recipe's tokenizer in a dry run)
# spent 46 s in huggingface_hub's retries when pytest was run directly instead of through `make test`.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
}

# One thread per process, as `accelerate launch` on CPU gives every worker (its default
# num_cpu_threads_per_process): a one-process run then sums in the same order as each of N workers,
# which the 1e-5 comparisons of one process against several rely on. For the session's own process too:
# `make test` runs two pytest workers on a 2-core machine, each running in-process tests or starting
# scripts, and torch's default of a thread per core put four or more spinning threads on two cores.
# Measured on a 2-core machine (2026-12-06): bench/gpu_run.sh A and B --cpu-tiny side by side took 103 s
# and 250 s with torch's default threads, 63 s and 88 s with one; the whole suite 1,022 s before, 954 s
# after (2,517 passed each).
THREADS_PER_WORKER = {"OMP_NUM_THREADS": "1"}
