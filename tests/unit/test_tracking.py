"""Trackers: one interface, JSONL always, TensorBoard and W&B when asked, secrets never leave."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm_train.config.credentials import is_secret_key
from llm_train.config.recipe_sections import TrackingSection
from llm_train.observability.tracking import (
    REDACTED,
    open_trackers,
    redact,
    redact_argv,
    secret_values,
    tensorboard_tag,
)

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key


@pytest.mark.parametrize(
    "key",
    ["hub_token", "token", "api_key", "WANDB_API_KEY", "HF_TOKEN", "apiKey", "db_password", "aws_secret"],
)
def test_secret_key_names(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["tokenizer", "pad_token_id", "max_tokens", "tokens_per_s", "key", "sort_key", "TOKENIZERS_PARALLELISM"],
)
def test_ordinary_key_names(key: str) -> None:
    assert not is_secret_key(key)


def test_redact_by_key_and_by_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert FAKE_KEY in secret_values()
    config = {
        "model": {"tokenizer": "/tok", "config": {"hub_token": "hf_abc", "pad_token_id": 0}},
        "notes": [f"key={FAKE_KEY}"],
    }
    out = redact(config)
    assert out["model"]["tokenizer"] == "/tok" and out["model"]["config"]["pad_token_id"] == 0
    assert out["model"]["config"]["hub_token"] == REDACTED
    assert out["notes"] == [f"key={REDACTED}"]
    assert config["model"]["config"]["hub_token"] == "hf_abc"  # the input is left alone
    argv = redact_argv(["--recipe", "x", "model.config.hub_token=hf_abc", f"--note={FAKE_KEY}", "optim.lr=1"])
    assert argv == ["--recipe", "x", f"model.config.hub_token={REDACTED}", f"--note={REDACTED}", "optim.lr=1"]


def test_other_ranks_log_nothing(tmp_path: Path) -> None:
    trackers = open_trackers(TrackingSection(mode="offline", tensorboard=True), tmp_path, {}, is_main=False)
    trackers.log({"loss": 1.0}, 1)
    trackers.close()
    assert list(tmp_path.iterdir()) == [] and trackers.run_id is None


def test_wandb_disabled_is_never_imported(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from llm_train.config.recipe import TrackingSection\n"
        "from llm_train.observability.tracking import open_trackers\n"
        "import llm_train.runtime.loop, llm_train.observability.metrics, llm_train.observability.console, llm_train.observability.profiling\n"
        f"t = open_trackers(TrackingSection(mode='disabled'), Path({str(tmp_path)!r}), {{}}, True)\n"
        "t.log({'loss': 1.0}, 1); t.close()\n"
        "assert t.run_id is None\n"
        "print('wandb' in sys.modules, 'tensorboard' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}


def test_tensorboard_writes_grouped_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = open_trackers(TrackingSection(tensorboard=True), tmp_path, {"ds": {"api_key": "x"}}, True)
    for step in (1, 2):
        trackers.log({"loss": 3.0 - step, "tokens_per_s": 100.0 * step, "eval_loss": 2.5}, step)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "perf/tokens_per_s", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("train/loss")] == [2.0, 1.0]
    assert tensorboard_tag("gpu_mem_peak_gib") == "memory/gpu_mem_peak_gib"
    assert events.Tags()["tensors"] == ["config/text_summary"]
    # Results added later (llm-train eval) log into the same directory without a second configuration.
    later = open_trackers(TrackingSection(tensorboard=True), tmp_path, None, True, start_step=2)
    later.log({"bench/acc": 0.5}, 2)
    later.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert (
        events.Tags()["tensors"] == ["config/text_summary"]
        and len(events.Tensors("config/text_summary")) == 1
    )


def test_wandb_offline_run_holds_metrics_config_and_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["train.py", "model.config.hub_token=hf_secret_override"])
    config = {"recipe": {"model": {"config": {"hub_token": "hf_secret_in_recipe"}}, "data": {"seq_len": 128}}}
    tracking = TrackingSection(mode="offline", project="unit", tags=["t1"], group="g")
    trackers = open_trackers(tracking, tmp_path, config, is_main=True)
    run_id = trackers.run_id
    assert run_id
    trackers.log({"loss": 1.5, "tokens_per_s_per_gpu": 123.0}, 1)
    trackers.close()

    wandb_files = list((tmp_path / "wandb").rglob("*.wandb"))
    assert len(wandb_files) == 1 and run_id in wandb_files[0].name
    data = wandb_files[0].read_bytes()
    assert b"tokens_per_s_per_gpu" in data and b"seq_len" in data
    for path in tmp_path.rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            for secret in (FAKE_KEY, "hf_secret_in_recipe", "hf_secret_override"):
                assert secret.encode() not in blob, f"{secret} in {path}"

    # Resume: the same run id continues the same W&B run.
    again = open_trackers(tracking, tmp_path, config, is_main=True, run_id=run_id, start_step=1)
    assert again.run_id == run_id
    again.log({"loss": 1.0}, 2)
    again.close()


def test_a_table_reaches_its_file_tensorboard_and_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO's sampled completions: completions.jsonl in the run, a TensorBoard text table, a W&B table."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = open_trackers(TrackingSection(mode="offline", tensorboard=True), tmp_path, {}, True)
    rows = [{"completion": "a | b\nc", "reward": 0.5}, {"completion": "d", "reward": None}]
    trackers.log_table("completions", rows, 3)
    trackers.close()
    lines = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 3, **row} for row in rows]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 3 and "a \\| b c | 0.5" in text.tensor_proto.string_val[0].decode()
    (table,) = list((tmp_path / "wandb").rglob("completions_*.table.json"))
    assert json.loads(table.read_text())["data"] == [["a | b\nc", 0.5], ["d", None]]
