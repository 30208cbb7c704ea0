"""The user's accelerate config: each kind `accelerate config` writes for this machine runs the recipe.

Launched for real through `accelerate launch --config_file` (its simple launcher for single-process and
multi-CPU configs, its DeepSpeed/torchrun launcher for a DeepSpeed plugin): the run trains, the world
is the one the config asks for, no traceback, and the one start-up notice says which value won, which
the effective DeepSpeed JSON the run wrote (config/ds_config.json) must agree with. The kinds that
cannot run (FSDP, mpirun, ...) are refused before any worker starts: tests/unit/test_train_command.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import ACCELERATE, REPO, TRAIN, assert_ok, free_port, losses, run_cmd, wizard_config

pytestmark = pytest.mark.e2e

# One step, no eval, no sample: what is under test is the start, the world and the DS JSON.
CHEAP = ["--max-steps", "1", "eval.every=0", "eval.batches=1", "output.sample_prompt=null"]
CHEAP += ["checkpoint.at_end=false", "optim.warmup_steps=0"]


def _launch(config: Path, run_dir: Path, *extra: str):
    cmd = [str(ACCELERATE), "launch", "--config_file", str(config), "--main_process_port", str(free_port())]
    return run_cmd([*cmd, str(TRAIN), "--recipe", "tiny-cpu", "--output-dir", str(run_dir), *CHEAP, *extra])


def _notice(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("notice: accelerate settings")]
    assert len(lines) == 1, stdout[-3000:]
    return lines[0]


def _world(run_dir: Path) -> list[int]:
    return [r["rank"] for r in json.loads((run_dir / "world.json").read_text())["ranks"]]


def _effective(run_dir: Path) -> dict:
    return json.loads((run_dir / "config" / "ds_config.json").read_text())


def test_a_single_process_cpu_config_trains_one_process(tmp_path: Path) -> None:
    config = wizard_config(tmp_path / "single.yaml", "NO", use_cpu=True)
    result = _launch(config, tmp_path / "run")
    assert_ok(result)
    assert "Traceback" not in result.stderr
    assert _world(tmp_path / "run") == [0]
    # tiny-cpu trains fp32, which is what accelerate's mixed_precision "no" means: they agree.
    assert f"accelerate config {config}: mixed_precision no = fp32 (precision)" in _notice(result.stdout)


def test_the_multi_cpu_config_trains_two_ranks_under_deepspeed(tmp_path: Path) -> None:
    # The config: distributed_type MULTI_CPU, num_processes 2, use_cpu true. Its
    # ACCELERATE_USE_CPU used to make Accelerate skip DeepSpeed's process group ("16 != 8 * 1 * 1").
    config = wizard_config(tmp_path / "multi_cpu.yaml", "MULTI_CPU", num_processes=2, mixed_precision="bf16")
    run_dir = tmp_path / "run"
    result = _launch(config, run_dir)
    assert_ok(result)
    assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr
    assert _world(run_dir) == [0, 1]
    assert sorted(losses(run_dir)) == [1]
    # The recipe's precision wins over the config's bf16, and the JSON trains that.
    assert "mixed_precision bf16 -> fp32 (precision)" in _notice(result.stdout)
    effective = _effective(run_dir)
    assert not effective.get("bf16", {}).get("enabled") and not effective.get("fp16", {}).get("enabled")


def test_a_deepspeed_plugin_config_is_reconciled_with_the_recipe(tmp_path: Path) -> None:
    plugin = {
        "zero_stage": 2,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "zero3_init_flag": False,
    }
    config = wizard_config(
        tmp_path / "ds.yaml", "DEEPSPEED", num_processes=2, use_cpu=False, deepspeed_config=plugin
    )
    run_dir = tmp_path / "run"
    result = _launch(config, run_dir)
    assert_ok(result)
    assert "Traceback" not in result.stderr
    notice = _notice(result.stdout)
    # Every field of the plugin is named, with accelerate's value, the value that trains and its place.
    found = dict(re.findall(r"(\w+) \S+ (?:->|=) (\S+) \(", notice))
    assert set(plugin) <= set(found), notice
    effective = _effective(run_dir)
    zero = effective["zero_optimization"]
    assert str(zero["stage"]) == found["zero_stage"] == "3"  # tiny-cpu's zero3.json wins over 2
    assert zero.get("offload_optimizer", {}).get("device", "none") == found["offload_optimizer_device"]
    assert str(effective["gradient_accumulation_steps"]) == found["gradient_accumulation_steps"] == "1"
    assert float(effective["gradient_clipping"]) == float(found["gradient_clipping"])
    assert _world(run_dir) == [0, 1]


def test_a_deepspeed_config_file_stands_for_ds_config(tmp_path: Path) -> None:
    zero2 = REPO / "ds_configs" / "zero2.json"
    plugin = {"deepspeed_config_file": str(zero2), "zero3_init_flag": False}
    # The wizard writes mixed_precision null beside a config file (it does not ask).
    config = wizard_config(
        tmp_path / "ds_file.yaml",
        "DEEPSPEED",
        2,
        use_cpu=False,
        mixed_precision=None,
        deepspeed_config=plugin,
    )
    run_dir = tmp_path / "run"
    result = _launch(config, run_dir)
    assert_ok(result)
    notice = _notice(result.stdout)
    assert f"deepspeed_config_file {zero2} = the run's DeepSpeed JSON" in notice
    assert "mixed_precision" not in notice
    assert _effective(run_dir)["zero_optimization"]["stage"] == 2  # zero2.json's, not tiny-cpu's zero3
