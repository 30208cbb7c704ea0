"""bench/gpu_check.py's host-memory sampler counts a forked tree's shared pages once, where RSS sums do not.

The first H200 run summed RSS over the trainer and its forked workers to 160.9 GiB on a 125.9 GiB
machine. Here a process touches 300 MiB and forks three times (four processes sharing the pages
copy-on-write): the RSS sum reads ~4x, the PSS sum and the machine's used-memory growth ~1x.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MiB = 2**20
CHILD = """
import os, time
block = bytearray(300 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
os.fork(); os.fork()  # four processes share the touched pages
print("ready", flush=True)
time.sleep(4)
"""


@pytest.fixture(scope="module")
def gpu_check() -> object:
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs Linux >= 4.14 (/proc/PID/smaps_rollup)")
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    return gpu_check


def test_pss_counts_forked_pages_once_and_rss_does_not(gpu_check: object) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        # Four processes print "ready" into one pipe: their writes may land on one line ("readyready").
        assert child.stdout is not None and "ready" in child.stdout.readline()
        time.sleep(0.5)  # the first "ready" may come before the last fork: let all four exist
        sampler = gpu_check.HostMemorySampler()  # type: ignore[attr-defined]
        sampler.sample(child.pid)
        tree = gpu_check._proc_tree(child.pid)  # type: ignore[attr-defined]
        rss_sum = sum(proc.memory_info().rss for proc in tree)
    finally:
        child.wait(timeout=30)
    assert len(tree) == 4
    assert rss_sum > 3.5 * 300 * MiB  # each process counts the shared 300 MiB again
    # PSS: the 300 MiB once, plus four small interpreters' own pages.
    assert 300 * MiB < sampler.pss_peak < 300 * MiB + 4 * 40 * MiB
