"""config/accelerate_launch.py + runtime/base/launch_env.py: the user's accelerate config, read as accelerate reads it.

Configs are written as `accelerate config` writes them (tests/helpers.py `wizard_config`). What runs is
launched in tests/e2e/test_accelerate_configs.py; here: what each kind is read as, where each value
came from, the one-line refusals before any launcher, and the notice against the resolved run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_train import cli
from llm_train.commands import train as train_command
from llm_train.config import accelerate_launch
from llm_train.config.accelerate_launch import AccelerateLaunch
from llm_train.errors import UserError
from llm_train.runtime.base import launch_env
from tests.devices import resolve
from tests.helpers import TRAIN, wizard_config


def _read(config: Path, *flags: str) -> AccelerateLaunch:
    return launch_env.read_accelerate_launch(["--config_file", str(config), *flags, str(TRAIN)])[1]


@pytest.mark.parametrize(
    "distributed_type, processes, kind",
    [
        ("NO", 1, "NO"),
        ("MULTI_CPU", 2, "MULTI_CPU"),
        ("MULTI_GPU", 2, "MULTI_GPU"),
        ("DEEPSPEED", 2, "DEEPSPEED"),
    ],
)
def test_each_kind_is_read_as_the_launcher_accelerate_picks(
    tmp_path: Path, distributed_type: str, processes: int, kind: str
) -> None:
    launch = _read(wizard_config(tmp_path / "c.yaml", distributed_type, processes))
    assert launch.kind == kind
    accelerate_launch.refuse(launch)  # each of these runs


def test_values_name_the_file_or_the_flag_they_came_from(tmp_path: Path) -> None:
    config = wizard_config(
        tmp_path / "ds.yaml",
        "DEEPSPEED",
        2,
        mixed_precision="bf16",
        deepspeed_config={"zero_stage": 2, "gradient_accumulation_steps": 4, "offload_param_device": "none"},
    )
    launch = _read(config, "--zero_stage", "1")
    assert launch.values == {
        "zero_stage": "1",
        "offload_param_device": "none",
        "gradient_accumulation_steps": "4",
        "mixed_precision": "bf16",
    }
    assert launch.origins["zero_stage"] == "accelerate launch --zero_stage"  # the flag beats the file
    assert launch.origins["gradient_accumulation_steps"] == f"accelerate config {config}"
    assert AccelerateLaunch.from_json(launch.to_json()) == launch  # as the first process hands it on


@pytest.mark.parametrize(
    "distributed_type, extra, fragment",
    [
        ("FSDP", {}, "accelerate distributed_type FSDP: llm_train shards with DeepSpeed ZeRO"),
        ("MEGATRON_LM", {}, "accelerate distributed_type MEGATRON_LM"),
        ("MULTI_CPU", {"mpirun_config": {"mpirun_hostfile": "/h"}}, "mpirun_config.mpirun_hostfile"),
    ],
)
def test_kinds_llm_train_cannot_train_under_are_one_line_before_any_launcher(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    distributed_type: str,
    extra: dict,
    fragment: str,
) -> None:
    config = wizard_config(tmp_path / "c.yaml", distributed_type, 2, **extra)
    with pytest.raises(UserError, match=fragment.replace(".", r"\.")):
        accelerate_launch.refuse(_read(config))

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a launcher was started")

    monkeypatch.setattr(train_command.subprocess, "Popen", no_launch)
    assert cli.main(["train", "--config-file", str(config), "--recipe", "tiny-cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_a_config_accelerate_cannot_load_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = wizard_config(tmp_path / "c.yaml", "MULTI_CPU", 2)
    config.write_text(config.read_text() + "ipex_config:\n  ipex: false\n")  # written by older accelerates
    assert cli.main(["train", "--config-file", str(config), "--recipe", "tiny-cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"accelerate config {config}:" in err and "ipex_config" in err, err


def test_llm_train_train_launches_the_configs_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = wizard_config(tmp_path / "c.yaml", "MULTI_CPU", 3)
    seen: list[list[str]] = []
    monkeypatch.setattr(train_command, "run_launcher", lambda cmd, accelerate, write: seen.append(cmd) or 0)
    argv = [
        "train",
        "--config-file",
        str(config),
        "--recipe",
        "tiny-cpu",
        "--output-dir",
        str(tmp_path / "r"),
    ]
    assert cli.main(argv) == 0
    cmd = seen[0]
    assert cmd[cmd.index("--config_file") + 1] == str(config)
    assert cmd[cmd.index("--num_processes") + 1] == "3"  # the config's, not tiny-cpu's hardware (2)
    assert "--mixed_precision" not in cmd  # the config's own value stands


@pytest.mark.parametrize(
    ("compile_", "says"),
    [
        ("off", "dynamo_backend INDUCTOR -> NO (memory.torch_compile=off)"),
        ("layers", "dynamo_backend INDUCTOR = INDUCTOR (memory.torch_compile=layers)"),
    ],
)
def test_a_configs_torch_compile_is_named_in_the_notice_against_the_recipes_switch(
    tmp_path: Path, compile_: str, says: str
) -> None:
    # The wizard's answer to "Do you wish to optimize your script with torch dynamo?": a dynamo_config.
    config = wizard_config(
        tmp_path / "c.yaml",
        "MULTI_CPU",
        2,
        dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_mode": "default"},
    )
    launch = _read(config)
    assert launch.values == {"dynamo_backend": "INDUCTOR", "mixed_precision": "no"}
    notice = accelerate_launch.reconcile(
        launch, resolve(overrides=[f"memory.torch_compile={compile_}"]), None
    )
    assert (
        notice is not None
        and f"accelerate config {config}: mixed_precision no = fp32 (precision), {says}" in notice
    )
    plain = _read(wizard_config(tmp_path / "plain.yaml", "MULTI_CPU", 2))
    assert "dynamo_backend" not in plain.values  # no dynamo_config: nothing said


def test_deepspeed_config_file_stands_for_ds_config_unless_one_is_given() -> None:
    launch = AccelerateLaunch(
        "DEEPSPEED", {"deepspeed_config_file": "zero2"}, {"deepspeed_config_file": "accelerate config c.yaml"}
    )
    assert accelerate_launch.ds_config(launch, None) == "zero2"
    assert accelerate_launch.ds_config(launch, "zero1") == "zero1"
    assert accelerate_launch.ds_config(None, None) is None
    notice = accelerate_launch.reconcile(launch, resolve(device=None, ds="zero1"), "zero1")
    assert (
        notice is not None
        and "accelerate config c.yaml: deepspeed_config_file zero2 -> --ds-config zero1" in notice
    )
    notice = accelerate_launch.reconcile(launch, resolve(device=None, ds="zero2"), None)
    assert notice is not None and "deepspeed_config_file zero2 = the run's DeepSpeed JSON" in notice


def test_the_notice_says_what_won_for_every_field_in_the_recipes_terms() -> None:
    values = {
        "zero_stage": "3",
        "offload_optimizer_device": "cpu",
        "gradient_accumulation_steps": "2",
        "gradient_clipping": "1.0",
        "mixed_precision": "no",
    }
    launch = AccelerateLaunch("DEEPSPEED", values, dict.fromkeys(values, "accelerate config c.yaml"))
    notice = accelerate_launch.reconcile(launch, resolve(device=None), None)
    assert notice is not None
    # tiny-cpu: zero3.json without offload, grad_accum 1, grad_clip 1.0, fp32.
    for part in (
        "zero_stage 3 = 3 (zero3.json zero_optimization.stage)",
        "offload_optimizer_device cpu -> none (zero3.json offload_optimizer)",
        "gradient_accumulation_steps 2 -> 1 (optim.grad_accum)",
        "gradient_clipping 1.0 = 1 (optim.grad_clip)",
        "mixed_precision no = fp32 (precision)",
    ):
        assert part in notice, notice
    assert notice.count("accelerate config c.yaml") == 1  # grouped by origin: one line, said once
    assert accelerate_launch.reconcile(None, resolve(device=None), None) is None


def test_workers_never_see_accelerates_copy_of_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (
        "ACCELERATE_USE_CPU",
        "ACCELERATE_CONFIG_DS_FIELDS",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "ACCELERATE_MIXED_PRECISION",
        "ACCELERATE_DYNAMO_BACKEND",
        "ACCELERATE_DYNAMO_MODE",
    ):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # restored after the test
    launch_env.use_deepspeed_in_accelerate()
    left = [key for key in os.environ if key.startswith("ACCELERATE_")]
    assert left == ["ACCELERATE_USE_DEEPSPEED"], left
