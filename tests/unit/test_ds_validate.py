"""The effective DeepSpeed JSON passes DeepSpeed's own config classes in the resolving process.

Configs written for older DeepSpeed versions or for other tools carry keys DeepSpeed 0.19.8 no
longer reads, or reads under another name. Each is refused before any worker starts, in one line
that names the key, the file and what DeepSpeed reads there; `llm-train show` and `--dry-run` say
the same line. (Every shipped JSON and recipe passes: tests/unit/test_train.py dry-runs them all.)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from llm_train import DS_CONFIGS_DIR, cli, train
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError

ZERO3 = json.loads((DS_CONFIGS_DIR / "zero3.json").read_text())


def written(tmp_path: Path, edit: dict[str, Any], base: dict[str, Any] = ZERO3) -> Path:
    """zero3.json with `edit` merged in (one level deep into sections), as a file of its own."""
    config = copy.deepcopy(base)
    for key, value in edit.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


def refusal(tmp_path: Path, edit: dict[str, Any], base: dict[str, Any] = ZERO3) -> str:
    path = written(tmp_path, edit, base)
    with pytest.raises(UserError) as exc_info:
        resolve_run("tiny-cpu", [], world_size=2, ds_config_path=str(path))
    message = str(exc_info.value)
    assert message.startswith(f"DeepSpeed config {path}: ")  # names the file
    return message


def test_a_compile_block_of_an_older_deepspeed_names_the_keys_it_reads_now(tmp_path: Path) -> None:
    # DeepSpeed 0.14's torch.compile block; 0.19.8's CompileConfig reads DeepCompile's options instead.
    message = refusal(tmp_path, {"compile": {"enabled": True, "backend": "inductor"}})
    assert "compile.enabled is not a key DeepSpeed 0.19.8 reads (it would refuse it)" in message
    assert "it reads there: autoep_non_moe, debug_log, deepcompile," in message
    assert message.endswith("(and 1 more)")  # `backend` too


def test_a_mistyped_offload_key_gets_a_did_you_mean_with_its_full_path(tmp_path: Path) -> None:
    offload = {"device": "cpu", "pin_memory": True, "buffer_cnt": 4}
    message = refusal(tmp_path, {"zero_optimization": {"offload_optimizer": offload}})
    assert "zero_optimization.offload_optimizer.buffer_cnt is not a key DeepSpeed 0.19.8 reads" in message
    assert "did you mean 'buffer_count'?" in message
    assert "it reads there: buffer_count, cpuadam_cores_perc, device, fast_init, nvme_path," in message


def test_a_value_deepspeed_refuses_says_what_it_accepts(tmp_path: Path) -> None:
    # (The offload device, precision and stage are llm_train's own checks, made earlier.)
    message = refusal(tmp_path, {"zero_optimization": {"stage3_max_live_parameters": "1e9 or so"}})
    assert message.endswith(
        'zero_optimization.stage3_max_live_parameters="1e9 or so": DeepSpeed 0.19.8 refuses it (Input '
        "should be a valid integer, unable to parse string as an integer)"
    )


def test_aio_thread_count_is_read_as_intra_op_parallelism_now(tmp_path: Path) -> None:
    # DeepSpeed's old docs wrote aio.thread_count; 0.19.8 reads its aio dict key by key and would
    # silently ignore it, so the NVMe swapper would run with one thread whatever the JSON said.
    message = refusal(tmp_path, {"aio": {"block_size": 1048576, "thread_count": 4}})
    assert "aio.thread_count is not a key DeepSpeed 0.19.8 reads (it would silently ignore it)" in message
    assert "did you mean 'intra_op_parallelism'?" in message
    assert message.endswith(
        "it reads there: block_size, intra_op_parallelism, overlap_events, queue_depth, single_submit, use_gds"
    )


def test_a_block_of_a_removed_feature_is_refused_with_deepspeeds_own_reason(tmp_path: Path) -> None:
    elastic = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [1, 2]}
    message = refusal(tmp_path, {"elasticity": elastic})
    assert "DeepSpeed 0.19.8 refuses it: Elastic training has been removed" in message
    removed_zero_key = refusal(tmp_path, {"zero_optimization": {"mics_shard_size": 2}})
    assert "MiCS ZeRO-3 sharding has been removed" in removed_zero_key


def test_an_old_name_deepspeed_still_maps_is_refused_with_the_new_one(tmp_path: Path) -> None:
    # DeepSpeed 0.19.8 would map cpu_offload onto offload_optimizer and offload behind the layout's
    # back (llm_train reads the current names: no host-RAM check, no CPU Adam).
    message = refusal(tmp_path, {"zero_optimization": {"cpu_offload": True}})
    assert message.endswith(
        "zero_optimization.cpu_offload is an old name; DeepSpeed 0.19.8 reads offload_optimizer instead: rename it"
    )
    # The old export switch, next to the current one llm_train writes for ZeRO-3: DeepSpeed itself
    # refuses the pair ("Cannot provide deprecated parameter ... together"); the old name is the cause.
    message = refusal(tmp_path, {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert message.endswith(
        "zero_optimization.stage3_gather_fp16_weights_on_model_save is an old name; DeepSpeed 0.19.8 reads "
        "stage3_gather_16bit_weights_on_model_save instead: rename it"
    )


def test_top_level_keys_that_begin_with_an_underscore_are_comments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    note = "written for another tool"
    path = written(tmp_path, {"_comment": note, "_comment_zero": ["a", "list"]})
    run = resolve_run("tiny-cpu", [], world_size=2, ds_config_path=str(path))
    assert run.ds_config["_comment"] == note
    assert capsys.readouterr() == ("", "")  # not a word, and no did-you-mean
    # Inside a section it is no comment: DeepSpeed's section model refuses it.
    message = refusal(tmp_path, {"zero_optimization": {"_comment": note}})
    assert "zero_optimization._comment is not a key DeepSpeed 0.19.8 reads (it would refuse it)" in message


def test_show_and_the_dry_run_report_the_same_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, {"compile": {"enabled": True}})
    expected = refusal(tmp_path, {"compile": {"enabled": True}})
    assert cli.main(["show", "tiny-cpu", f"deepspeed.config={path}", "--world-size", "2"]) == 2
    shown = capsys.readouterr()
    assert (
        train.main(["--recipe", "tiny-cpu", "--ds-config", str(path), "--dry-run", "--world-size", "2"]) == 2
    )
    dry = capsys.readouterr()
    assert shown.out == dry.out == ""  # nothing resolved is printed
    assert shown.err == dry.err == f"llm-train: error: {expected}\n"
