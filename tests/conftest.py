"""Test tiers: unit (default), e2e (real multi-process DeepSpeed on CPU), gpu (skipped without CUDA)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.session_env import OFFLINE_ENV, THREADS_PER_WORKER

# Before torch and huggingface_hub are imported (each reads these once): tests/session_env.py says why.
# A caller's own setting wins.
for key, value in {**OFFLINE_ENV, **THREADS_PER_WORKER}.items():
    os.environ.setdefault(key, value)

from llm_train.runtime.base.compat import prepare_op_loads  # noqa: E402 (after the thread setting)

# Optional parts (libaio, bitsandbytes, a GPU, ...): skipped where missing, failed in CI, listed at the end.
pytest_plugins = ["tests.optional"]

# DeepSpeed JIT-builds its CPU ops (cpu_adam, async I/O, pinned memory) into torch's extensions
# folder, ~/.cache/torch_extensions by default. torch rebuilds an op whenever its include paths change,
# and they name the virtual environment: two checkouts on one machine then rebuild cpu_adam at every
# other launch (minutes of compiling on 2 cores, whose RSS a memory check of the run then counts). One
# folder per environment builds each op once. Every launch the tests make inherits this.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# The tests' own op loads (unit tests make DeepSpeedCPUAdam in this process) with the ninja and the one
# CPU probe a training worker uses: another ninja would rebuild what the runs built, and back again.
prepare_op_loads()


# The test modules that read tests/e2e/conftest.py's session fixture `runs` (the shared reference runs).
REFERENCE_MODULES = (
    "tests/e2e/test_host_offload.py",
    "tests/e2e/test_multinode.py",
    "tests/e2e/test_resume.py",
    "tests/e2e/test_resume_anywhere.py",
    "tests/e2e/test_zero_stages.py",
)
REFERENCE_RUNS = "runs"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`make test` (-n 2 --dist loadscope): what e2e tests share is made once, on one worker.

    pytest-xdist sends each module to one worker, so a module's fixtures (one launch that several of
    its tests read) run once; here the modules of REFERENCE_MODULES also go together, so the six
    reference runs are launched once rather than on both workers. (pytest-xdist's own loadgroup mode
    does not group under pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads.)
    """
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "reference-runs" if module in REFERENCE_MODULES else module

    return ModuleScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after pytest has ordered the items by their fixtures
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_reference_modules(items)
    # Longest first, as pytest-xdist hands out modules in this order (--no-loadscope-reorder): the
    # reference group, the other e2e modules, then the unit modules to fill whichever worker is free.
    items.sort(
        key=lambda item: 0 if _module(item) in REFERENCE_MODULES else 1 if "e2e" in item.keywords else 2
    )
    # The gpu tier needs a CUDA device: tests/optional.py marks it so (skipped, and said, where none is).


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def check_reference_modules(items: list[pytest.Item]) -> None:
    """REFERENCE_MODULES must name every module that reads the reference runs (else both workers launch them)."""
    readers = {_module(item) for item in items if _reads_reference_runs(item)}
    if missing := readers - set(REFERENCE_MODULES):
        raise pytest.UsageError(
            f"{', '.join(sorted(missing))} read the reference runs: add them to REFERENCE_MODULES in tests/conftest.py"
        )


def _reads_reference_runs(item: pytest.Item) -> bool:
    """Whether `item` uses tests/e2e/conftest.py's `runs` (test_parallel.py has a `runs` of its own)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.get(REFERENCE_RUNS, ()) if info is not None else ()
    return bool(definitions) and definitions[-1].func.__module__ == "tests.e2e.conftest"
