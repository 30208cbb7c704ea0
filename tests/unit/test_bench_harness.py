"""The bench harness under every prepared GPU check (bench/cases.py, launch.py, watch.py, result_files.py,
verdicts.py): verdicts, time boxes, the memory sampler, a stop mid-case.

The GPU machine gives 15 minutes in all: a check that overruns its part, loses its lines to a kill, or
judges wrongly costs the whole visit. Each harness feature is checked here once, cheaply.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_run, mfu_matrix
from bench.cases import Budget, Case, Context, run_cases
from bench.result_files import Results
from bench.verdicts import Judging, judge, verdict
from bench.watch import HostMemorySampler, proc_tree
from tests.optional import needs

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


# --- verdicts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("measured", "passed"), [(1.0, True), (1.149, True), (0.851, True), (1.16, False), (0.8, False)]
)
def test_an_estimate_is_met_within_15_percent_either_way(measured: float, passed: bool) -> None:
    v = verdict("step_time_s", measured, estimate=1.0)
    assert v["passed"] is passed and v["within_estimate"] is passed
    assert v["ratio"] == pytest.approx(measured)
    assert bool(v["misses"]) is not passed
    if not passed:
        assert "off the planner's 1 (allowed +-15%)" in v["misses"][0]


def test_a_target_is_a_floor_or_a_ceiling() -> None:
    assert verdict("mfu", 0.45, target=0.45)["passed"]
    missed = verdict("mfu", 0.30, target=0.45)
    assert not missed["passed"] and missed["misses"] == ["mfu 0.3 misses its target >= 0.45"]
    assert verdict("step_time_s", 2.0, target=3.0, higher_is_better=False)["passed"]
    assert not verdict("step_time_s", 4.0, target=3.0, higher_is_better=False)["passed"]


def test_nothing_measured_or_nothing_to_compare_with_is_a_miss() -> None:
    assert verdict("gpu_mem_peak_gib", None, estimate=20.0)["misses"] == [
        "gpu_mem_peak_gib: not measured (estimate 20)"
    ]
    assert not verdict("step_time_s", 1.0)["passed"]  # a verdict with nothing to judge by


def test_a_judged_miss_fails_the_line_and_an_unjudged_one_is_only_recorded() -> None:
    unjudged = verdict("step_time_s", 5.0, estimate=1.0, judged=False, why_not_judged="cpu-tiny")
    assert judge({"measurement": "x", "passed": True}, [unjudged])["passed"] is True
    verdicts = [verdict("step_time_s", 2.0, estimate=1.0), verdict("mfu", 0.3, target=0.45)]
    record = judge({"measurement": "b", "passed": True, "error": "exit 1"}, verdicts)
    assert record["passed"] is False and record["verdicts"] == verdicts
    assert (
        record["error"].startswith("exit 1; step_time_s 2 is +100% off")
        and "mfu 0.3 misses" in record["error"]
    )


def test_an_injected_estimate_is_judged_on_cpu_too_and_only_for_its_own_line() -> None:
    # --expect NAME.QUANTITY=VALUE: how a CPU test proves that a wrong estimate fails its line.
    judging = Judging(enforce=False, injected={"c.step_time_s": 1e-6})
    assert judging.against("c", "step_time_s", 0.5, planner=0.5)["passed"] is False
    assert judging.against("d", "step_time_s", 50.0, planner=0.5)["passed"] is True  # recorded, not judged


# --- cases in time boxes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("part", sorted(gpu_run.PARTS))
def test_each_parts_required_boxes_fit_its_limit_from_the_costs_the_code_assumes(part: str) -> None:
    own = gpu_run.PARTS[part].cases
    required = [c for c in own if not c.optional]
    room = gpu_run.PART_LIMIT_S - gpu_run.INSTALL_RESERVE_S
    # Every required case always gets its whole box: together they fit the part's limit.
    assert sum(c.box_s for c in required) <= room, [(c.name, c.box_s) for c in required]
    speed = mfu_matrix.cases(gpu_run.PARTS[part].speed)
    for case in [*own, *speed]:
        assert 0 <= case.cost_s <= case.box_s, case.name  # a box never shorter than what the case needs
    assert all(c.optional for c in speed) and required[0].name == "probe"
    # What the required cases and the GRPO case are assumed to take leaves A the side-by-side with the HF
    # Trainer, the comparison issue 34 wants in the GPU run.
    if part == "A":
        first = [c for c in speed if c.name in ("baseline", "hf_trainer")]
        grpo = [c for c in own if c.name == "grpo_24"]
        assert grpo and grpo[0].optional
        assert sum(c.cost_s for c in [*required, *grpo, *first]) <= room


def context(tmp_path: Path, seconds: float, gpu: bool = False) -> Context:
    results = Results("check", tmp_path / "out")
    return Context(gpu, tmp_path / "work", Budget(seconds), results, Judging(gpu))


def test_an_optional_case_the_budget_cannot_hold_is_deferred_and_a_required_one_fails(tmp_path: Path) -> None:
    ctx = context(tmp_path, seconds=10)
    ran: list[str] = []

    def run(ctx: Context) -> dict:
        ran.append("quick")
        return {"passed": True}

    cases = [
        Case("quick", run, cost_s=1, box_s=5),
        Case("too_long", run, cost_s=60, box_s=90, optional=True),
        Case("broken", lambda ctx: {"x": 1 / 0}, cost_s=1, box_s=5),
    ]
    run_cases(cases, ctx)
    lines = [json.loads(line) for line in ctx.results.jsonl.read_text().splitlines()]
    assert [r["measurement"] for r in lines] == ["quick", "too_long", "broken"] and ran == ["quick"]
    assert lines[1]["passed"] is None and lines[1]["deferred"].startswith("needs ~60s")
    assert lines[2]["passed"] is False and lines[2]["error"].startswith(
        "ZeroDivisionError"
    )  # the others still ran
    ctx.budget.deadline = time.time() - 1  # spent: a required case is a failed line, never skipped quietly
    run_cases([Case("late", run, cost_s=1, box_s=5)], ctx)
    assert ctx.done["late"]["passed"] is False and ctx.done["late"]["error"] == "not run: the budget is spent"


# A check of two cases: the first ends at once, the second's launch sleeps until it is stopped.
STOPPED_CHECK = """
import sys
from pathlib import Path
from bench.cases import Budget, Case, Context, run_cases
from bench.launch import launch
from bench.result_files import Results
from bench.verdicts import Judging

out, work = Path(sys.argv[1]), Path(sys.argv[2])
results = Results("check", out)
results.stop_on_signals()

def case(code):
    def run(ctx):
        done = launch([sys.executable, "-c", code], ctx.timeout(), work / "launch.log")
        return {"passed": done.rc == 0}
    return run

ctx = Context(False, work, Budget(600), results, Judging(False))
run_cases([
    Case("one", case("print('one done')"), cost_s=1, box_s=60, cpu_box_s=60),
    Case("two", case("import os, time; print('started', os.getpid(), flush=True); time.sleep(120)"),
         cost_s=1, box_s=300, cpu_box_s=300),
], ctx)
"""


def test_a_sigterm_mid_case_leaves_every_finished_line_the_log_tail_and_the_summary(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    check = subprocess.Popen([sys.executable, "-c", STOPPED_CHECK, str(out), str(work)], cwd=REPO)
    log = work / "launch.log"
    deadline = time.time() + 120
    while not (log.exists() and "started" in log.read_text()):
        assert check.poll() is None and time.time() < deadline, "the second case never started"
        time.sleep(0.1)
    sleeper = int(log.read_text().split()[1])
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=60) == 128 + signal.SIGTERM
    one, two = [json.loads(line) for line in (out / "check.jsonl").read_text().splitlines()]
    assert one == {"measurement": "one", "passed": True}
    assert two["measurement"] == "two" and two["passed"] is False
    assert two["error"].startswith("stopped by SIGTERM") and "started" in two["tail"]
    assert "two: stopped by SIGTERM" in (out / "check.log").read_text()
    summary = json.loads((out / "check_summary.json").read_text())
    assert summary["failed"] == ["two"] and summary["lines"]["one"]["passed"] is True
    with pytest.raises(ProcessLookupError):  # the running launch went with the check
        os.kill(sleeper, 0)


# --- the host-memory sampler -------------------------------------------------------------------------------

# A process touches 300 MiB and forks into four that share the pages copy-on-write: the first H200 run
# summed RSS over such a tree to 160.9 GiB on a 125.9 GiB machine; PSS counts the pages once.
FORKED = """
import os, time
block = bytearray(300 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
os.fork(); os.fork()
print("ready", flush=True)
time.sleep(4)
"""


@needs("smaps_rollup")
def test_pss_counts_forked_pages_once_and_rss_does_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", FORKED], stdout=subprocess.PIPE, text=True)
    try:
        # Four processes print "ready" into one pipe: their writes may land on one line ("readyready").
        assert child.stdout is not None and "ready" in child.stdout.readline()
        time.sleep(0.5)  # the first "ready" may come before the last fork: let all four exist
        sampler = HostMemorySampler()
        sampler.sample(child.pid)
        tree = proc_tree(child.pid)
        rss_sum = sum(proc.memory_info().rss for proc in tree)
    finally:
        child.wait(timeout=30)
    assert len(tree) == 4
    assert rss_sum > 3.5 * 300 * MiB  # each process counts the shared 300 MiB again
    assert sampler.pss_peak is not None and 300 * MiB < sampler.pss_peak < 300 * MiB + 4 * 40 * MiB


# --- the capped trainer ----------------------------------------------------------------------------------


def test_capped_train_without_a_cap_is_a_one_line_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.capped_train", "--recipe", "tiny-cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "capped_train: usage: python -m bench.capped_train --gpu-cap-gib GIB [--host-ram-gib GIB] "
        "[train.py arguments ...]"
    ]


def test_a_host_budget_is_what_llm_train_sees_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from bench.capped_train import budget_host_ram
    from llm_train.units import GiB

    monkeypatch.setattr(psutil, "virtual_memory", psutil.virtual_memory)  # restored after the test
    real = psutil.virtual_memory()
    budget_host_ram(2.0)
    seen = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    assert seen.total == min(2 * GiB, real.total)
    # What is free on a 2 GiB machine that runs only this process (a fit check reads `available`).
    assert 0 <= seen.available <= max(0, 2 * GiB - rss) + 64 * MiB  # the RSS moves a little between reads
