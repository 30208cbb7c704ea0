"""deepspeed.pinning: which allocator a run gets, the memlock limit checked before start, auto's choice."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_train.config.recipe import load_recipe
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from llm_train.planning.memory import pinning
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.pinning import MemlockLimit, has_cap_ipc_lock
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.search.candidate import memory_inputs
from llm_train.planning.search.guards import auto_pinning, check_memlock
from llm_train.runtime.base.launch_env import PIN_BACKEND_ENV, use_pin_memory_backend
from llm_train.units import GiB
from tests.devices import RTX_4090, resolve
from tests.optional import require
from tests.unit.offload_arithmetic import EMBED_8B, PSI_7B, SUB_GROUPS_7B, zero3_cpu_offload_host

REPO = Path(__file__).resolve().parents[2]


def _inputs(run: object) -> object:
    return memory_inputs(run, shape_from_config(run.model_fields))  # type: ignore[attr-defined]


# --- the recipe key ----------------------------------------------------------------------------------------


def test_off_writes_pin_memory_false_into_every_offload_section() -> None:
    run = resolve_run("tiny-cpu", ["deepspeed.pinning=off"], world_size=2, ds_config_path="zero3_offload")
    zero = run.ds_config["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is False and zero["offload_param"]["pin_memory"] is False
    # YAML 1.1 reads a bare `off` as false; the recipe key means the word.
    assert load_recipe("tiny-cpu", ["deepspeed.pinning=off"]).deepspeed.pinning == "off"
    # The other choices leave the JSON's own pin_memory (DeepSpeed's default: true).
    kept = resolve_run("tiny-cpu", ["deepspeed.pinning=native"], world_size=2, ds_config_path="zero3_offload")
    assert kept.ds_config["zero_optimization"]["offload_optimizer"]["pin_memory"] is True


def test_an_unknown_choice_is_one_line_naming_the_key() -> None:
    with pytest.raises(
        UserError, match=r"deepspeed\.pinning: Input should be 'torch', 'native', 'off' or 'auto'"
    ):
        load_recipe("tiny-cpu", ["deepspeed.pinning=exact"])


def test_each_choice_reaches_the_planner_per_section() -> None:
    for choice, expected in (("torch", "torch"), ("native", "native"), ("off", "off"), ("auto", "native")):
        inp = _inputs(resolve("7b-rtx4090", [f"deepspeed.pinning={choice}"], world_size=1, device=RTX_4090))
        assert inp.pinning == expected, choice  # type: ignore[attr-defined]
    # DeepSpeed's CPU accelerator pins nothing through torch; native pinning mlocks on any device.
    cpu = resolve_run("tiny-cpu", [], world_size=2, ds_config_path="zero3_offload")
    assert (_inputs(cpu).pinning, _inputs(cpu).param_pinning) == ("off", "off")  # type: ignore[attr-defined]
    native = resolve_run(
        "tiny-cpu", ["deepspeed.pinning=native"], world_size=2, ds_config_path="zero3_offload"
    )
    assert (_inputs(native).pinning, _inputs(native).param_pinning) == ("native", "native")  # type: ignore[attr-defined]


def test_the_worker_gets_the_recipes_backend_whatever_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    use_pin_memory_backend("torch")
    assert os.environ[PIN_BACKEND_ENV] == "torch"
    use_pin_memory_backend("native")
    assert os.environ[PIN_BACKEND_ENV] == "native"
    use_pin_memory_backend("off")  # nothing pinned: the backend does not matter, torch's is DeepSpeed's own
    assert os.environ[PIN_BACKEND_ENV] == "torch"


# --- the memlock limit -----------------------------------------------------------------------------------------


def test_capability_is_read_from_the_status_file(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t000001fffeffffff\n")  # root in a container: bit 14 set
    assert has_cap_ipc_lock(str(status))
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")  # an ordinary user
    assert not has_cap_ipc_lock(str(status))
    assert not has_cap_ipc_lock(str(tmp_path / "absent"))


def test_native_pinning_past_the_limit_is_refused_in_one_line_with_the_fix() -> None:
    run = resolve("7b-rtx4090", ["deepspeed.pinning=native"], world_size=1, device=RTX_4090)
    locked = estimate_memory(_inputs(run)).locked_per_rank
    # Native pinning mlocks exactly the fp32 gradient of every sub-group and the flat bf16 gradients.
    assert locked == zero3_cpu_offload_host(PSI_7B, SUB_GROUPS_7B, "native")["locked"] == 6 * PSI_7B
    with pytest.raises(UserError) as info:
        check_memlock(run, limit=MemlockLimit(8 * 2**20, "RLIMIT_MEMLOCK"))
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    assert message.startswith(
        f"host memory lock: deepspeed.pinning=native locks ~{locked / GiB:.1f} GiB per process"
    )
    assert "the memlock limit is 8 MiB (ulimit -l 8192)" in message
    assert "ulimit -l unlimited" in message and "deepspeed.pinning=off" in message
    check_memlock(run, limit=MemlockLimit(None, "unlimited"))  # no limit: nothing to refuse
    check_memlock(run, limit=MemlockLimit(locked, "RLIMIT_MEMLOCK"))  # exactly enough is enough


def test_nvme_swap_buffers_are_locked_even_unpinned() -> None:
    run = resolve_run("8b-rtx4090-nvme", ["deepspeed.pinning=off"], world_size=1, device=RTX_4090)
    # The async-I/O handle's swap buffers: 4 of the largest sub-group (the embedding) in fp32.
    swap = 4 * 4 * EMBED_8B
    with pytest.raises(
        UserError, match=rf"NVMe swapping \(zero3_offload_optimizer_nvme\.json\) locks ~{swap / GiB:.1f} GiB"
    ):
        check_memlock(run, limit=MemlockLimit(64 * 2**20, "RLIMIT_MEMLOCK"))
    # torch pinning on the GPU goes through the driver, not mlock: a run without NVMe locks nothing.
    check_memlock(
        resolve("7b-rtx4090", ["deepspeed.pinning=torch"], world_size=1, device=RTX_4090),
        limit=MemlockLimit(0, "RLIMIT_MEMLOCK"),
    )


@pytest.mark.parametrize(
    ("limit", "host_gib", "expected"),
    [(None, 125, "native"), (64 * GiB, 125, "native"), (8 * 2**20, 125, "off"), (8 * 2**20, 253, "torch")],
)
def test_auto_takes_native_pinning_where_the_limit_allows_it_else_torchs_where_its_rounding_fits(
    limit: int | None, host_gib: int, expected: str
) -> None:
    # 7b-rtx4090's host RAM: 116.4 GiB exact, 127.8 GiB rounded by torch's allocator, which a 128 GiB machine
    # (125 usable) cannot hold and a 256 GiB one can; torch's pinning is the RTX_4090 driver's, not mlock's.
    run = resolve("7b-rtx4090", ["deepspeed.pinning=auto"], world_size=1, device=RTX_4090)
    choice, notice = auto_pinning(run, MemlockLimit(limit, "test"), host_gib * GiB)
    assert choice == expected and notice.startswith(f"deepspeed.pinning=auto: {expected}")
    if expected == "off":
        locked = zero3_cpu_offload_host(PSI_7B, SUB_GROUPS_7B, "native")["locked"]
        assert "ulimit -l unlimited" in notice and f"~{locked / GiB:.1f} GiB" in notice
    if expected == "torch":
        assert "rounded up to powers of two" in notice and "memlock limit is 8 MiB" in notice
    cpu = resolve_run("tiny-cpu", ["deepspeed.pinning=auto"], world_size=2, ds_config_path="zero3_offload")
    assert auto_pinning(cpu, MemlockLimit(None, "test"))[0] == "off"  # no device copies on a CPU run


def test_train_decides_auto_once_and_carries_it_as_an_override(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.train import main

    assert (
        main(["--recipe", "tiny-cpu", "--dry-run", "--ds-config", "zero3_offload", "deepspeed.pinning=auto"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pinning: 'off'" in out or "pinning: off" in out  # the resolved recipe records the choice
    assert "notice: deepspeed.pinning=auto: off on CPU" in out
    assert '"pin_memory": false' in out  # and the DS JSON DeepSpeed receives says it


def test_this_process_limit_is_what_the_kernel_enforces() -> None:
    """Without CAP_IPC_LOCK and under a 1 MiB limit (a child made so with setpriv and prlimit), the check
    reads 1 MiB; root with the capability, as CI runs, reads no limit."""
    require("setpriv")
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    code = (
        "import resource, sys; sys.path.insert(0, sys.argv[1]); "
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (2**20, 2**20)); "
        "from llm_train.planning.memory.pinning import memlock_limit; l = memlock_limit(); "
        "print(l.limit_bytes, l.describe())"
    )
    cmd = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", code, str(REPO)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(2**20) and "ulimit -l 1024" in out.stdout
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    here = pinning.memlock_limit()
    assert (here.limit_bytes is None) == (soft == resource.RLIM_INFINITY or has_cap_ipc_lock())


def test_plan_shows_the_buffers_under_each_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train import cli

    assert cli.main(["plan", "--recipe", "7b-rtx4090", "--gpu-mem", "24", "--host-ram", "128"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("host buffers per pinning choice") :].splitlines()
    assert table[1].split() == ["torch", "native", "*", "off"]  # the recipe's auto plans as native
    rows = {line.rsplit(maxsplit=3)[0].strip(): line.split()[-3:] for line in table[2:9]}
    # The columns by hand (tests/unit/offload_arithmetic.py), in GiB as the table prints them.
    by_hand = [zero3_cpu_offload_host(PSI_7B, SUB_GROUPS_7B, p) for p in ("torch", "native", "off")]

    def column(key: str) -> list[str]:
        return [f"{row[key] / GiB:.2f}" for row in by_hand]

    assert rows["master-dtype gradient per sub-group (stage3.py 1337)"] == column("fp32_gradients")
    assert rows["host RAM total (the estimate above)"] == column("host")
    assert rows["mlocked per process (memlock limit)"] == column("locked")
    assert "host settings for this budget: sub_group_size 2e+08" in out and "data.loader_workers 0" in out


def test_drive_speeds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train import cli

    assert (
        cli.main(["plan", "--recipe", "8b-rtx4090-nvme", "--nvme-gib", "140", "--nvme-write-gbs", "0"]) == 2
    )
    assert "--nvme-write-gbs 0: give the drive's speed in GB/s" in capsys.readouterr().err
