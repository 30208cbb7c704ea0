"""launch/: the shipped accelerate configs say only where; the SLURM script and hostfile are well-formed.

A user's config that also says what (mixed_precision, gradient accumulation, zero_stage, ...) runs
too, reconciled with the recipe (tests/unit/test_accelerate_launch.py); the shipped ones stay examples
of the where alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
CONFIGS = sorted((LAUNCH / "accelerate").glob("*.yaml"))
# DeepSpeed fields of an accelerate config that only choose the multi-node launcher.
WHERE_ONLY = {"deepspeed_multinode_launcher", "deepspeed_hostfile"}
WHAT = {
    "mixed_precision",
    "downcast_bf16",
    "fsdp_config",
    "megatron_lm_config",
    "dynamo_config",
    "fp8_config",
}


def test_there_is_a_config_for_every_scale() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"one_gpu", "one_node", "multi_node_static", "multi_node_c10d", "multi_node_deepspeed"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_says_only_where(path: Path) -> None:
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    load_config_from_file(str(path))  # accelerate itself accepts every key
    raw = yaml.safe_load(path.read_text())
    assert not WHAT & set(raw), f"{path.name} sets {WHAT & set(raw)}"
    assert set(raw.get("deepspeed_config") or {}) <= WHERE_ONLY
    if raw["num_machines"] > 1:
        assert raw["main_process_ip"] and raw["main_process_port"]
        assert raw["num_processes"] % raw["num_machines"] == 0


def test_slurm_script() -> None:
    script = LAUNCH / "slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for needle in (
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@",
        "#SBATCH --ntasks-per-node=1",
        '--machine_rank "$SLURM_NODEID"',
        '--main_process_ip "$MAIN_ADDR"',
        "--resume auto",
        "scontrol requeue",
        "launch/accelerate/multi_node_static.yaml",
    ):
        assert needle in text, needle


def test_hostfile_example() -> None:
    lines = [
        line
        for line in (LAUNCH / "hostfile.example").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines and all(len(line.split()) == 2 and line.split()[1].startswith("slots=") for line in lines)
