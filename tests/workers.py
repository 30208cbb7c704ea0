"""`python tests/workers.py N llm_train/train.py ARGS`: N local workers, started the way torchrun starts them.

Every multi-GPU launch (accelerate's torchrun path, `torchrun`, `deepspeed`, srun) hands each worker
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and each worker then checks and trains on
its own (llm_train/runtime/launcher.py, case 1). Most e2e tests start their runs like this, through
the same spawner llm_train uses under `accelerate launch` on CPU (launcher.spawn_workers: stop signals
forwarded, the first failure's exit code). What that parent adds (accelerate
and llm_train imported once more, the run resolved and checked before any worker starts: 3-5 s of
every launch on 2 cores) is tested where it is the point: tests/e2e/test_launch_train.py, the
max-restarts and SLURM tests, and the stop-signal tests of test_resume.py.
"""

from __future__ import annotations

import os
import sys

from llm_train.runtime.launcher import LocalWorld, free_port, spawn_workers

if __name__ == "__main__":
    nproc, argv = int(sys.argv[1]), sys.argv[2:]
    # One thread per worker, as `accelerate launch` on CPU gives every worker (its default
    # num_cpu_threads_per_process): a one-process run then sums in the same order as each of N
    # workers, which the 1e-5 comparisons of one process against several rely on.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(spawn_workers(LocalWorld(nproc, 1, 0, "127.0.0.1", free_port()), argv))
