"""Optional parts of the test machine: a test that needs one says so, and its absence is never silent.

Some evidence needs a part that a fresh machine may lack: DeepSpeed's async-I/O op needs libaio (a
Debian package, not a wheel) for NVMe offload; QLoRA needs bitsandbytes; one privilege test needs
util-linux's setpriv; the gpu tier needs a CUDA device. A test names what it needs,

    pytestmark = needs("libaio")            # a module, class or test (a mark)
    bnb = import_or_skip("bitsandbytes")    # a module that needs the import at module level

and where the part is missing the test is skipped with a reason naming the part and how to get it,
and the run ends with one line listing what was not tested (`pytest_terminal_summary` below). In CI
(`CI` set to anything but "", "0" or "false", as CI services and .ci/run set it) a missing part that
CI installs fails the test instead: a green CI run then holds every claim, QLoRA's and NVMe's
included. A CUDA GPU is the one part CI never has: its tier is skipped there too, and said.

`LLM_TRAIN_TESTS_WITHOUT=libaio,bitsandbytes` makes the suite behave as if those parts were missing:
how the lead checks what a fresh machine without them would print, without uninstalling anything.

The plugin also writes every test's duration (setup + call + teardown) to the file given by
`--durations-file` (`make test`: runs/test-durations.tsv), slowest first, so a slow test shows up in
review rather than as a CI timeout.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

SKIP_PREFIX = "missing "  # every skip this module makes starts so; the summary groups them by part


@dataclass(frozen=True)
class Part:
    """Something a test needs that a fresh machine may not have."""

    name: str
    how: str  # how to get it, shown in the skip reason
    probe: Callable[[], bool]
    ci_installs: bool = True  # in CI its absence fails the tests that need it


def _imports(module: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return False
        return True

    return probe


def _libaio() -> bool:
    # DeepSpeed's own test of what its async-I/O op builds against: libaio's header and library
    # (op_builder/async_io.py, checked with 0.19.8), the same answer `llm-train doctor` reports.
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


PARTS = {
    part.name: part
    for part in (
        Part("libaio", "apt-get install libaio-dev (DeepSpeed's async I/O op, NVMe offload)", _libaio),
        Part("bitsandbytes", "pip install -e '.[qlora]' (make install does)", _imports("bitsandbytes")),
        Part("peft", "pip install -e '.[lora]' (make install does)", _imports("peft")),
        Part("trl", "pip install -e '.[dev]' (make install does)", _imports("trl")),
        Part("lm_eval", "pip install -e '.[eval]' (make install does)", _imports("lm_eval")),
        Part("setpriv", "apt-get install util-linux", lambda: shutil.which("setpriv") is not None),
        Part("tomllib", "Python >= 3.11", lambda: sys.version_info >= (3, 11)),
        Part(
            "smaps_rollup",
            "Linux >= 4.14 (/proc/PID/smaps_rollup)",
            lambda: Path("/proc/self/smaps_rollup").exists(),
        ),
        Part("a CUDA GPU", "run the gpu tier on a machine with one", _cuda, ci_installs=False),
    )
}
GPU = "a CUDA GPU"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _pretended_missing() -> set[str]:
    return {p.strip() for p in os.environ.get("LLM_TRAIN_TESTS_WITHOUT", "").split(",") if p.strip()}


@functools.cache
def available(name: str) -> bool:
    if name not in PARTS:
        raise KeyError(f"unknown optional part {name!r}; known: {', '.join(PARTS)} (tests/optional.py)")
    return name not in _pretended_missing() and PARTS[name].probe()


def reason(name: str) -> str:
    return f"{SKIP_PREFIX}{name}: {PARTS[name].how}"


def needs(*names: str) -> pytest.MarkDecorator:
    """The mark of a test (module, class) that needs these parts."""
    for name in names:
        if name not in PARTS:
            raise KeyError(f"unknown optional part {name!r}; known: {', '.join(PARTS)} (tests/optional.py)")
    return pytest.mark.needs(*names)


def require(name: str) -> None:
    """Inside a test or at module level: go on only if `name` is there (skip, or fail in CI)."""
    if available(name):
        return
    if in_ci() and PARTS[name].ci_installs:
        pytest.fail(f"{name} is missing in CI, where .ci/run installs it: {PARTS[name].how}", pytrace=False)
    pytest.skip(reason(name), allow_module_level=True)


def import_or_skip(module: str, part: str | None = None) -> ModuleType:
    """The module, else a skip (a failure in CI) naming the part it belongs to (default: its top package)."""
    require(part or module.split(".")[0])
    return importlib.import_module(module)


# --- the plugin --------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-file",
        default=None,
        help="write every test's duration (s, setup + call + teardown) to this file, slowest first",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(*parts): needs optional parts (tests/optional.py PARTS)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The gpu tier (tests/gpu, marker `gpu`) needs a CUDA device, as a part like any other.
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.needs(GPU))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        for name in mark.args:
            require(name)


# Seconds per test id, summed over its setup, call and teardown reports (one pytest session per process).
_DURATIONS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under pytest-xdist this runs in the controller for every worker's reports too.
    _DURATIONS[report.nodeid] += report.duration


def _not_tested(terminalreporter: pytest.TerminalReporter) -> Counter[str]:
    """Skipped tests (and modules) per missing part, from the reasons this module gave."""
    counts: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        text = text.removeprefix("Skipped: ")
        if text.startswith(SKIP_PREFIX):
            counts[text[len(SKIP_PREFIX) :].split(":", 1)[0]] += 1
    return counts


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    _write_durations(config)
    counts = _not_tested(terminalreporter)
    if not counts:
        terminalreporter.write_line("not tested here: nothing skipped for a missing part")
        return
    parts = "; ".join(
        f"{name}: {n} skipped ({PARTS[name].how})" if name in PARTS else f"{name}: {n} skipped"
        for name, n in sorted(counts.items())
    )
    terminalreporter.write_line(f"not tested here (skipped tests or modules per missing part): {parts}")


def _write_durations(config: pytest.Config) -> None:
    path = config.getoption("--durations-file")
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(_DURATIONS.items(), key=lambda kv: -kv[1])
    target.write_text("seconds\ttest\n" + "".join(f"{s:.2f}\t{nodeid}\n" for nodeid, s in rows))
