"""NVMe offload: the directory comes from the recipe, is never hard-coded, and is checked before start.

The shipped zero3_offload_nvme.json says "auto"; deepspeed.nvme_path (recipe or command line)
fills it. A missing path, a path that contradicts the JSON, a path no offload uses, and a
directory that is missing, read-only or too small are each one line naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from llm_train.commands import doctor
from llm_train.config import resolution
from llm_train.config.ds_json import fill_autos as resolve_ds
from llm_train.config.ds_json import load_ds_config, nvme_paths
from llm_train.config.recipe import load_recipe
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from llm_train.planning.search import guards
from llm_train.planning.search.guards import check_nvme_path, memory_estimate, nvme_problems
from tests.devices import CPU, resolve
from tests.optional import require
from tests.unit.test_dsconfig import VALUES

REPO = Path(__file__).resolve().parents[2]
NVME = ["deepspeed.config=zero3_offload_nvme"]
SECTIONS = ("offload_optimizer", "offload_param")


def _run(nvme_dir: Path | str, *extra: str) -> resolution.Resolved:
    """tiny-cpu on the shipped NVMe config (two processes, one node), offloading to `nvme_dir`."""
    return resolve("tiny-cpu", [*NVME, f"deepspeed.nvme_path={nvme_dir}", *extra])


def _one_line_error(run: resolution.Resolved) -> str:
    with pytest.raises(UserError) as info:
        check_nvme_path(run, gpus_per_node=2)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    return message


# --- "auto" resolution (dsconfig) ----------------------------------------------------------------------


def test_shipped_nvme_config_names_no_directory() -> None:
    _, raw = load_ds_config("zero3_offload_nvme")
    for section in SECTIONS:
        assert raw["zero_optimization"][section]["device"] == "nvme"
        assert raw["zero_optimization"][section]["nvme_path"] == "auto"


def test_auto_nvme_path_is_filled_from_the_recipe() -> None:
    _, raw = load_ds_config("zero3_offload_nvme")
    resolved = resolve_ds(raw, replace(VALUES, nvme_path="/mnt/nvme"), "zero3_offload_nvme")
    assert nvme_paths(resolved) == {"offload_optimizer": "/mnt/nvme", "offload_param": "/mnt/nvme"}
    assert '"auto"' not in json.dumps(resolved)


def test_nvme_offload_with_no_path_anywhere_is_refused_naming_the_key() -> None:
    _, raw = load_ds_config("zero3_offload_nvme")
    with pytest.raises(
        UserError, match=r"offload_optimizer goes to nvme but no directory.*deepspeed\.nvme_path="
    ):
        resolve_ds(raw, VALUES, "zero3_offload_nvme")
    absent = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(UserError, match=r"offload_param goes to nvme but no directory"):
        resolve_ds(absent, VALUES, "x.json")


def test_json_path_that_contradicts_the_recipe_is_refused() -> None:
    explicit = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"}}}
    with pytest.raises(
        UserError,
        match=r'offload_param\.nvme_path="/a" contradicts deepspeed\.nvme_path \(which gives "/b"\); '
        r'set it to "auto"',
    ):
        resolve_ds(explicit, replace(VALUES, nvme_path="/b"), "x.json")


def test_json_path_alone_or_agreeing_with_the_recipe_is_kept() -> None:
    explicit = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a/"}}}
    assert nvme_paths(resolve_ds(explicit, VALUES, "x.json")) == {"offload_param": "/a/"}
    # The same directory spelled with a trailing slash is agreement, not a contradiction.
    agreed = resolve_ds(explicit, replace(VALUES, nvme_path="/a"), "x.json")
    assert nvme_paths(agreed) == {"offload_param": "/a/"}


def test_recipe_nvme_path_without_nvme_offload_is_refused() -> None:
    _, raw = load_ds_config("zero3_offload")  # offloads to cpu
    with pytest.raises(
        UserError, match=r"deepspeed\.nvme_path=/mnt/nvme is set but .* offloads nothing to nvme"
    ):
        resolve_ds(raw, replace(VALUES, nvme_path="/mnt/nvme"), "zero3_offload")


def test_auto_path_in_a_cpu_offload_section_is_dropped_not_left_for_deepspeed() -> None:
    raw = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "auto"}}}
    resolved = resolve_ds(raw, VALUES, "x.json")
    assert "nvme_path" not in resolved["zero_optimization"]["offload_param"]


# --- the recipe key --------------------------------------------------------------------------------------


def test_nvme_path_override_is_made_absolute_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("tiny-cpu", [*NVME, "deepspeed.nvme_path=swap"])
    assert recipe.deepspeed.nvme_path == str(tmp_path / "swap")
    assert load_recipe("tiny-cpu").deepspeed.nvme_path is None  # no default directory


@pytest.mark.parametrize("value", ["auto", "''"])
def test_nvme_path_that_is_not_a_directory_name_is_refused(value: str) -> None:
    with pytest.raises(UserError, match=r"deepspeed\.nvme_path=.* is not a directory"):
        load_recipe("tiny-cpu", [*NVME, f"deepspeed.nvme_path={value}"])


# --- checked before start --------------------------------------------------------------------------------


def test_writable_directory_with_room_passes(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert nvme_paths(run.ds_config) == {"offload_optimizer": str(tmp_path), "offload_param": str(tmp_path)}
    check_nvme_path(run, gpus_per_node=2)
    assert list(tmp_path.iterdir()) == []  # the write probe cleaned up after itself


def test_missing_directory_is_one_line_naming_path_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "not-mounted"
    message = _one_line_error(_run(missing))
    assert f"deepspeed.nvme_path={missing}: does not exist" in message and f"mkdir -p {missing}" in message


def test_file_instead_of_directory_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "swapfile"
    a_file.write_text("")
    assert "is not a directory" in _one_line_error(_run(a_file))
    # A path *under* a file cannot exist, whoever runs the test (root included).
    assert "does not exist" in _one_line_error(_run(a_file / "sub"))


def test_directory_that_refuses_new_files_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, which ignores mode bits, so a chmod 555 directory would still take the
    # probe file; the kernel's answer for another user is simulated at the one call that writes.
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(guards.tempfile, "mkstemp", refuse)
    message = _one_line_error(_run(tmp_path))
    assert f"deepspeed.nvme_path={tmp_path}: cannot create files there (Permission denied)" in message
    assert "chown/chmod" in message


def test_read_only_directory_is_refused_for_real(tmp_path: Path) -> None:
    """The kernel's own answer, also where tests run as root (CI does): the check runs in a child that
    lacks CAP_DAC_OVERRIDE, which is what lets root write into a mode-555 directory."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tests.unit.test_nvme_offload import _run; "
        "from llm_train.planning.search.guards import nvme_problems; print(nvme_problems(_run(sys.argv[2]), 2)[0])"
    )
    cmd = [sys.executable, "-c", code, str(REPO), str(read_only)]
    if os.geteuid() == 0:
        require("setpriv")  # root ignores the read-only mode unless setpriv drops CAP_DAC_OVERRIDE
        setpriv = shutil.which("setpriv")
        assert setpriv is not None
        drop = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    finally:
        read_only.chmod(0o755)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"deepspeed.nvme_path={read_only}: cannot create files there (Permission denied)" in out.stdout


Usage = namedtuple("Usage", "total used free")


def test_too_little_free_space_names_both_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)
    need = memory_estimate(run, gpus_per_node=2).nvme_bytes  # the planner's figure, not a second formula
    assert need > 0
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda p: Usage(need * 4, need * 3, need - 1))
    message = _one_line_error(run)
    assert f"deepspeed.nvme_path={tmp_path}: {(need - 1) / 2**30:.1f} GiB free" in message
    assert f"need ~{need / 2**30:.1f} GiB" in message and "larger drive" in message
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda p: Usage(need * 4, need * 3, need))
    check_nvme_path(run, gpus_per_node=2)  # exactly enough is enough


def test_swap_files_of_an_earlier_run_count_as_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed deletes or rewrites NVME_PATH/zero_stage_3 when it starts, so that space comes back.
    run = _run(tmp_path)
    need = memory_estimate(run, gpus_per_node=2).nvme_bytes
    old = tmp_path / "zero_stage_3" / "optimizer" / "rank0"
    old.mkdir(parents=True)
    with open(old / "0.tensor.swp", "wb") as f:
        f.truncate(1000)  # sparse: the size is what counts
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda p: Usage(need, need, need - 1000))
    check_nvme_path(run, gpus_per_node=2)
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda p: Usage(need, need, need - 1001))
    assert "GiB free" in _one_line_error(run)


def test_dry_run_shows_a_failing_check_and_still_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train.train import main

    missing = tmp_path / "elsewhere"
    assert main(["--recipe", "tiny-cpu", "--dry-run", *NVME, f"deepspeed.nvme_path={missing}"]) == 0
    out = capsys.readouterr().out
    assert f"NVMe path check              deepspeed.nvme_path={missing}: does not exist" in out
    assert "(a real run stops here)" in out
    assert main(["--recipe", "tiny-cpu", "--dry-run", *NVME, f"deepspeed.nvme_path={tmp_path}"]) == 0
    assert f"NVMe path check              {tmp_path}: ok" in capsys.readouterr().out


def test_run_directory_records_the_real_path_and_no_auto(tmp_path: Path) -> None:
    from llm_train.runtime.rundir import create_run_dir

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run = _run(nvme)
    create_run_dir(tmp_path / "run", run, overwrite=False)
    text = (tmp_path / "run" / "config" / "ds_config.json").read_text()
    written = json.loads(text)
    assert '"auto"' not in text
    for section in SECTIONS:
        assert written["zero_optimization"][section]["nvme_path"] == str(nvme)


def test_json_path_problem_names_the_json_key_when_the_recipe_has_none(tmp_path: Path) -> None:
    _, raw = load_ds_config("zero3_offload_nvme")
    for section in SECTIONS:
        raw["zero_optimization"][section]["nvme_path"] = str(tmp_path / "gone")
    ds = tmp_path / "mine.json"
    ds.write_text(json.dumps(raw))
    run = resolve_run("tiny-cpu", [], world_size=2, device=CPU, ds_config_path=str(ds))
    message = _one_line_error(run)
    assert f"zero_optimization.offload_optimizer.nvme_path in {ds}={tmp_path / 'gone'}" in message


# --- llm-train doctor: DeepSpeed's async I/O op ------------------------------------------------------------


class FakeAioBuilder:
    """Stands in for deepspeed.ops.op_builder.AsyncIOBuilder (whose check compiles a test program)."""

    def __init__(self, libaio: bool) -> None:
        self.libaio = libaio

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.libaio

    def has_function(self, name: str, libraries: tuple[str, ...]) -> bool:
        assert (name, libraries) == ("io_submit", ("aio",))  # the probe DeepSpeed itself uses
        return self.libaio


@pytest.mark.parametrize("libaio", [True, False])
@pytest.mark.parametrize("uses_nvme", [True, False])
def test_doctor_reports_async_io_and_warns_only_for_nvme_recipes(
    monkeypatch: pytest.MonkeyPatch, libaio: bool, uses_nvme: bool
) -> None:
    monkeypatch.setattr(doctor, "_async_io_builder", lambda: FakeAioBuilder(libaio))
    report = doctor.Report()
    doctor.check_async_io(report, uses_nvme=uses_nvme)
    ((key, value),) = report.sections["DeepSpeed ops"]
    assert key == "async I/O"
    if libaio:
        assert value.startswith("can build") and not report.warnings
    elif uses_nvme:
        assert value.startswith("CANNOT build: libaio headers or library not found")
        ((problem, fix),) = report.warnings
        assert "offloads to NVMe" in problem
        assert "apt install libaio-dev" in fix and "CFLAGS" in fix and "LDFLAGS" in fix
    else:
        assert value.startswith("cannot build") and "apt install libaio-dev" in value
        assert not report.warnings  # information only: this recipe never touches async I/O


def test_doctor_checks_the_nvme_directory_of_the_recipe_it_is_given(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    assert doctor.recipe_uses_nvme("tiny-cpu", [*NVME, f"deepspeed.nvme_path={missing}"])
    assert not doctor.recipe_uses_nvme("tiny-cpu", [])
    report = doctor.Report()
    doctor.check_nvme_recipe(report, "tiny-cpu", [*NVME, f"deepspeed.nvme_path={missing}"])
    assert dict(report.sections["NVMe offload"])["path check"] == "FAILS"
    ((problem, fix),) = report.warnings
    assert problem == f"deepspeed.nvme_path={missing}: does not exist" and "mkdir -p" in fix


def test_nvme_problems_is_empty_without_nvme_offload() -> None:
    run = resolve_run("tiny-cpu", [], world_size=2, device=CPU)
    assert nvme_problems(run) == [] and not nvme_paths(run.ds_config)


def test_doctor_command_takes_a_recipe_and_its_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train import cli

    args = [
        "doctor",
        "--skip-build",
        "--drive-gib",
        "0",
        "--recipe",
        "tiny-cpu",
        *NVME,
        f"deepspeed.nvme_path={tmp_path}",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "== NVMe offload" in out and f"tiny-cpu offloads to nvme at {tmp_path}" in out
    assert "path check  ok (exists, writable, enough free space)" in out
    assert cli.main(["doctor", "--skip-build", "deepspeed.nvme_path=/x"]) == 2
    assert "overrides need --recipe" in capsys.readouterr().err


def test_a_real_run_stops_before_any_worker_when_the_nvme_path_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train import train

    missing = tmp_path / "no-such-drive"
    code = train.main(
        [
            "--recipe",
            "tiny-cpu",
            "--ds-config",
            "zero3_offload_nvme",
            f"deepspeed.nvme_path={missing}",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"deepspeed.nvme_path={missing}: does not exist" in err
    assert not (tmp_path / "run").exists()


# --- the keys DeepSpeed 0.19.8 reads; the parameter swap buffer --------------------------------------------


@pytest.mark.parametrize("name", ["zero3_offload_nvme", "zero3_offload_optimizer_nvme"])
def test_shipped_nvme_configs_use_only_keys_deepspeed_reads(name: str) -> None:
    """DeepSpeed ignores unknown aio keys (thread_count is no longer read: intra_op_parallelism), and its
    offload sections are pydantic models: their fields are the keys it reads."""
    from deepspeed.runtime.swap_tensor import aio_config
    from deepspeed.runtime.zero import offload_config as offload

    _, raw = load_ds_config(name)
    assert set(raw["aio"]) <= set(aio_config.AIO_DEFAULT_DICT), set(raw["aio"]) - set(
        aio_config.AIO_DEFAULT_DICT
    )
    models = {
        "offload_optimizer": offload.DeepSpeedZeroOffloadOptimizerConfig,
        "offload_param": offload.DeepSpeedZeroOffloadParamConfig,
    }
    for section, model in models.items():
        keys = set(raw["zero_optimization"].get(section, {}))
        assert keys <= set(model.model_fields), (section, keys - set(model.model_fields))


def test_param_swap_buffer_holds_the_largest_weight() -> None:
    # DeepSpeed swaps each parameter through one buffer_size buffer and asserts it fits
    # (partitioned_param_swapper.py 357): "auto" is the larger of its 1e8 default and the largest weight.
    run = resolve_run("13b-rtx4090-offload", [], world_size=1)
    assert run.ds_config["zero_optimization"]["offload_param"]["buffer_size"] == 32000 * 5120  # the embedding
    tiny = _run("/tmp")
    assert tiny.ds_config["zero_optimization"]["offload_param"]["buffer_size"] == 100_000_000
    _, raw = load_ds_config("zero3_offload_nvme")
    raw["zero_optimization"]["offload_param"]["buffer_size"] = 100_000_000
    with pytest.raises(
        UserError,
        match=r"offload_param\.buffer_size=100000000 is smaller than the model's largest weight \(163,840,000",
    ):
        resolve_ds(raw, replace(VALUES, nvme_path="/x", largest_weight=163_840_000), "x.json")


# --- llm-train doctor: the drive's sequential speed at nvme_path -------------------------------------------


def test_drive_speed_is_measured_and_the_probe_removed(tmp_path: Path) -> None:
    from llm_train.commands.drive import measure_drive

    speed = measure_drive(tmp_path, 16 * 2**20, block=2**20)
    assert speed.nbytes == 16 * 2**20 and speed.write_bytes_per_s > 0 and speed.read_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []
    assert "GB/s" in speed.describe()


def test_a_filesystem_without_o_direct_is_measured_buffered_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from llm_train.commands import drive

    real_open = os.open

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:  # what tmpfs answers
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(drive.os, "open", no_direct)
    speed = drive.measure_drive(tmp_path, 4 * 2**20, block=2**20)
    assert not speed.direct and "buffered" in speed.describe()


def test_doctor_measures_the_drive_of_an_nvme_recipe(tmp_path: Path) -> None:
    report = doctor.Report()
    doctor.check_nvme_recipe(
        report, "tiny-cpu", [*NVME, f"deepspeed.nvme_path={tmp_path}"], drive_bytes=8 * 2**20
    )
    rows = dict(report.sections["NVMe offload"])
    assert rows["drive speed"].startswith(f"{tmp_path}: sequential write ") and "read" in rows["drive speed"]
    assert "--nvme-read-gbs" in rows["plan with it"] and "--nvme-write-gbs" in rows["plan with it"]
    silent = doctor.Report()
    doctor.check_nvme_recipe(silent, "tiny-cpu", [*NVME, f"deepspeed.nvme_path={tmp_path}"], drive_bytes=0)
    assert "drive speed" not in dict(silent.sections["NVMe offload"])


# --- the step time from the drive's speeds --------------------------------------------------------------------


def test_nvme_step_time_is_the_drive_traffic_at_its_read_and_write_speeds() -> None:
    from llm_train.planning.memory.inputs import MemoryInputs
    from llm_train.planning.model.shapes import shape_of
    from llm_train.planning.speed.step_time import step_time

    psi = shape_of("meta-llama/Llama-3.1-8B").num_params
    inp = MemoryInputs.of(
        shape=shape_of("meta-llama/Llama-3.1-8B"), world_size=1, zero_stage=3, offload_optimizer="nvme",
        micro_batch=1, grad_accum=32, activation_checkpointing=True, sub_group_size=2 * 10**8,
    )  # fmt: skip
    fast = step_time(inp, 32, 165.2, nvme_read_bytes_per_s=6e9, nvme_write_bytes_per_s=3e9)
    # Master, m, v of every sub-group and the gradient of every tensor of 1 MiB or more (16 bytes a
    # parameter but the 65 norms' 4,096-element gradients, all aligned already) are read in at the step
    # and written back: 128.5 GB each way.
    swapped = 16 * psi - 4 * 65 * 4096
    assert fast.nvme_read_bytes == fast.nvme_write_bytes == swapped
    assert fast.nvme == pytest.approx(swapped / 6e9 + swapped / 3e9)  # ~64 s on a PCIe 4.0 drive
    slow = step_time(inp, 32, 165.2, nvme_read_bytes_per_s=3e9, nvme_write_bytes_per_s=1.5e9)
    assert slow.nvme == pytest.approx(2 * fast.nvme) and slow.compute == fast.compute
