"""The planner's estimate against measured memory on CPU (loose bounds; the tight check is on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llm_train.config.hardware import Device
from llm_train.config.resolution import resolve_run
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.search.candidate import memory_inputs, needs
from llm_train.units import GiB
from tests.helpers import launch_cmd, run_cmd

# Runs a command and reports the peak RSS of its largest descendant (Linux: KiB), so the
# measurement is not polluted by what this pytest process started before.
PEAK_RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def tiny_cpu_estimate_per_process() -> float:
    run = resolve_run("tiny-cpu", [], world_size=2, device=Device("cpu", "cpu", True))
    inputs = memory_inputs(run, shape_from_config(run.model_fields), 2)
    _, host = needs(estimate_memory(inputs), inputs, "cpu")
    return host / inputs.ranks_per_node


@pytest.mark.e2e
def test_tiny_cpu_estimate_bounds_measured_peak_rss(tmp_path: Path) -> None:
    args = ["--recipe", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--max-steps", "5"]
    cmd = [sys.executable, "-c", PEAK_RSS_WRAPPER, *launch_cmd([*args, "output.sample_prompt=null"], 2)]
    result = run_cmd(cmd, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    peak = int(result.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024
    estimate = tiny_cpu_estimate_per_process()
    # Upper bound: no training process outgrew its share of the planner's host estimate...
    assert peak <= estimate, f"measured {peak / GiB:.2f} GiB > estimate {estimate / GiB:.2f} GiB per process"
    # ... and not absurdly loose (the estimate is dominated by the per-process runtime allowance).
    assert estimate < 4 * peak, f"estimate {estimate / GiB:.2f} GiB vs measured {peak / GiB:.2f} GiB"
