"""`python tests/workers.py N llm_train/train.py ARGS`: N local workers, each given its rank as torchrun gives it.

Every multi-GPU launch (accelerate's torchrun path, `torchrun`, `deepspeed`, srun) hands each worker
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and each worker then checks and trains on
its own (llm_train/runtime/base/launch_env.py, case 1). Most e2e tests start their runs like this. What the
`accelerate launch` parent adds (accelerate and llm_train imported once more, the run resolved and
checked before any worker starts: 3-5 s of every launch on 2 cores) is tested where it is the point:
tests/e2e/test_train_command.py (its stop signal too) and the max-restarts and SLURM tests; those
workers are interpreters of their own, as on a GPU machine.

Here each worker is forked from this process once it has imported what every worker imports first
(torch, transformers, DeepSpeed, Accelerate, llm_train's training modules), and then runs train.py's
main() with its rank in the environment. That import is most of a tiny run's CPU, and the suite is
CPU-bound on 2 cores: a tiny 2-process zero2 run took 13.7-14.8 CPU-s with a fresh interpreter per
worker and 8.7-9.7 forked, with the same losses. What a fresh worker does before those imports
(library logs quieted, the op loads' ninja and CPU probe, DeepSpeed's Muon compile deferred and its
unused shared-memory op skipped) is done here first, in the same order. Nothing here touches a
tensor before the fork: a fork after torch has started OpenMP threads could hang the child.

tests/helpers.py's `launch` and `launch_popen` do that import once per pytest process: its launch
server (tests/launch_server.py) forks each launch's parent, which then runs `run_launch` as this
script's `__main__` does (a tiny 2-process run: 13.5 -> 6.7 CPU-s, same losses). `launch_cmd` (the
memory tests, which watch the launch's process tree from its root) runs this script fresh.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from llm_train.runtime.base.launch_env import LocalWorld, free_port, supervise, worker_env


def import_what_workers_import(argv: list[str]) -> None:
    from llm_train.runtime.session import prepare_libraries

    prepare_libraries("--verbose" in argv)  # as a fresh worker's prepare_process, before these imports
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401 - how DeepSpeed loads its ops
    import transformers.masking_utils  # noqa: F401 - every decoder model's; it imports torch._dynamo
    import transformers.models.llama.modeling_llama  # noqa: F401 - the tiny-cpu recipes' model
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import llm_train.runtime.engines.zero_engine  # noqa: F401
    import llm_train.runtime.session  # noqa: F401
    import llm_train.train  # noqa: F401


class ForkedWorker:
    """One forked worker, seen through the part of subprocess.Popen that launcher.supervise uses."""

    def __init__(self, world: LocalWorld, local_rank: int, argv: list[str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the worker: never returns into the parent's code
            exit_with(lambda: run_worker(argv, worker_env(world, local_rank)))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def exit_with(body: Callable[[], int]) -> NoReturn:
    """End a forked child with body()'s exit code (1 and its traceback if it raised), its output flushed,
    without the interpreter teardown or anything else of the parent's code after the fork."""
    code = 1
    try:
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_worker(argv: list[str], env: dict[str, str]) -> int:
    """train.py's `__main__` in this (forked) process, under the worker's environment: main()."""
    from llm_train.train import main

    os.environ.update(env)
    sys.argv = argv
    try:
        return main(argv[1:])
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1


def run_launch(nproc: int, argv: list[str]) -> int:
    """N workers of `argv` forked from this process (which has imported what they import), supervised."""
    world = LocalWorld(nproc, 1, 0, "127.0.0.1", free_port())
    workers = [ForkedWorker(world, local_rank, argv) for local_rank in range(nproc)]
    return supervise(workers)


if __name__ == "__main__":
    # One thread per worker (OMP_NUM_THREADS=1): the environment every launch inherits from the test
    # session (tests/session_env.py THREADS_PER_WORKER, set by tests/conftest.py).
    nproc, argv = int(sys.argv[1]), sys.argv[2:]
    import_what_workers_import(argv)
    sys.exit(run_launch(nproc, argv))
