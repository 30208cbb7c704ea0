"""Build DeepSpeed's CPU ops that the suite's runs load (cpu_adam, pin_memory, async_io) into this environment
once, at `make install`, rather than inside whichever test first loads each.

tests/conftest.py gives every environment its own torch extensions folder (<environment>/torch_extensions, so
that two checkouts do not rebuild each other's ops). On a fresh clone the suite therefore built the three ops
itself: cpu_adam 56 s, pin_memory 39 s and async_io 164 s of its 18:01 of pytest on 2 cores (2026-12-06, the
folder's build.ninja -> .so times), each inside a test, with ninja's jobs taking both cores from the other
pytest worker too. Built here the way a run builds them (the same folder, and compat.prepare_op_loads: the
environment's own ninja, no debug info), a launch finds them up to date and loads them in a second. Here,
on a fresh clone with nothing else running: cpu_adam 28.0 s, pin_memory 20.4 s, async_io 94.7 s; on another
2-core machine the same day 50.7 s, 35.3 s and 154.1 s.

async_io only where libaio is installed (AsyncIOBuilder.is_compatible, as tests/optional.py asks). Nothing on a
machine with a CUDA GPU: its ops are CUDA builds, and the GPU tier builds what it loads. A build that fails is a
line, not a failed install: the first test that loads the op builds it again and shows the compiler's error.

A build that was killed (a Ctrl-C'd test run) leaves its folder's `lock` file behind, and torch's JIT loader
(torch.utils.file_baton) then waits for it forever: every later run that loads the op hangs without a word
(seen here: an interrupted suite left async_io's lock, and the next load sat idle). Install time is when no
run of this environment can be building, so a lock found then is stale and is removed, with a line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    # The folder tests/conftest.py sets for every run the suite makes (set before DeepSpeed is imported).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    import torch

    if torch.cuda.is_available():
        print("build_ops: a CUDA GPU is present; DeepSpeed builds its ops at the first run that loads them")
        return 0
    from llm_train.runtime.base.compat import prepare_op_loads

    prepare_op_loads()
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, PinMemoryBuilder

    for lock in Path(os.environ["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):
        lock.unlink()
        print(f"build_ops: removed {lock}, left by a build that was stopped half way")

    for builder in (CPUAdamBuilder(), PinMemoryBuilder(), AsyncIOBuilder()):
        if isinstance(builder, AsyncIOBuilder) and not builder.is_compatible(verbose=False):
            print("build_ops: async_io skipped: libaio is not installed (apt-get install libaio-dev)")
            continue
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a cache warm-up: the test that loads the op shows the real error
            print(f"build_ops: {builder.NAME} did not build ({type(exc).__name__}); a test will build it")
            continue
        print(f"build_ops: {builder.NAME} ready in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
