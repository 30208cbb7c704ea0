"""Ulysses sequence parallelism: the degree in the layout, its refusals, the DS JSON it needs, the shard.

The math itself (sp=2 against sp=1, with dp=1 and dp=2) is checked in
tests/e2e/test_sequence_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_train.config.layout import Layout, LayoutError
from llm_train.config.resolution import largest_weight, resolve_run
from llm_train.errors import UserError
from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.engines.sequence_parallel import IGNORE, SequenceShard
from tests.devices import CPU


def _one_line_error(overrides: list[str], world_size: int = 2) -> str:
    with pytest.raises(UserError) as caught:
        resolve_run("tiny-cpu-sp2", overrides, world_size=world_size, device=CPU)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_sp_is_a_degree_of_the_world() -> None:
    layout = Layout(world_size=8, sp=2, zero_stage=3, micro_batch_size=2)
    assert layout.dp == 4 and layout.global_batch_size == 8
    # One group = consecutive ranks, which train on the same samples.
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.sp_rank(r) for r in range(8)] == [0, 1] * 4
    assert dict(layout.rows())["world size"] == "8 = dp 4 x tp 1 x pp 1 x sp 2"
    assert dict(Layout(world_size=2).rows())["world size"] == "2 = dp 2 x tp 1 x pp 1"  # unchanged without sp


def test_sp_with_tp_or_pp_is_a_layout_error() -> None:
    for degrees in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(LayoutError) as caught:
            Layout(world_size=4, sp=2, **degrees)
        assert caught.value.rule == "sp_combination"


def test_the_run_resolves_with_the_json_ulysses_needs() -> None:
    run = resolve_run("tiny-cpu-sp2", [], world_size=4, device=CPU)
    assert (run.layout.sp, run.layout.dp) == (2, 2)
    config = run.ds_config
    assert config["train_batch_size"] == 8 * 1 * 2  # micro x accum x dp: sequence ranks do not count
    assert config["sequence_parallel_size"] == 2  # how zero.Init's config divides the world
    zero = config["zero_optimization"]
    # ZeRO-3 must reduce every bucket on its all-reduce path (see resolution.py).
    assert zero["reduce_scatter"] is False and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] >= 4096 * 128  # the embedding of the tiny model
    plain = resolve_run("tiny-cpu", [], world_size=2, device=CPU).ds_config
    assert "sequence_parallel_size" not in plain and "reduce_scatter" not in plain["zero_optimization"]


def test_largest_weight_is_the_biggest_matrix() -> None:
    fields = {"vocab_size": 128256, "intermediate_size": 14336, "num_attention_heads": 32}
    assert largest_weight(fields, 4096) == 128256 * 4096


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (
            [
                "model.config.num_attention_heads=3",
                "model.config.num_key_value_heads=3",
                "model.config.hidden_size=129",
            ],
            2,
            "the model has 3 attention heads",
        ),
        (["model.config.num_key_value_heads=1"], 2, "the model has 1; use a sequence-parallel degree"),
        (["data.seq_len=255"], 2, "data.seq_len=255 is not divisible by 2"),
        (["deepspeed.sequence_parallel=3"], 4, "world size 4 is not divisible by"),
        (
            ["deepspeed.pipeline_stages=2", "deepspeed.config=zero1"],
            4,
            "deepspeed.sequence_parallel=2 cannot be combined with tensor parallel",
        ),
        (["memory.attention=eager"], 2, "does not run with memory.attention=eager"),
        (["data.packing=packed"], 2, "use data.packing=padded, or memory.attention=flash_attention_2"),
        (["memory.torch_compile=layers"], 2, "memory.torch_compile=layers is not supported with"),
    ],
)
def test_bad_layouts_get_one_line(overrides: list[str], world: int, expected: str) -> None:
    assert expected in _one_line_error(overrides, world)


def test_a_bad_layout_is_one_line_and_exit_2_from_the_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    # train.main in this process; the script's own exit code and one line: test_parallel.py's entry-point test.
    from llm_train import train

    assert train.main(["--recipe", "tiny-cpu-sp2", "--dry-run", "data.seq_len=255"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.seq_len=255 is not divisible by 2" in lines[0], err


def _batch() -> dict[str, torch.Tensor]:
    input_ids = torch.arange(2 * 8).reshape(2, 8)
    labels = input_ids.clone()
    labels[0, 5:] = IGNORE  # row 0: a short sample, padded
    labels[1, 0] = IGNORE
    return {"input_ids": input_ids, "labels": labels, "attention_mask": (labels != IGNORE).long()}


def test_each_rank_gets_its_slice_with_labels_shifted_over_the_whole_row() -> None:
    batch = _batch()
    shards = [SequenceShard(2, r, Collectives()).shard(batch) for r in range(2)]
    first, second = shards
    assert torch.equal(first["input_ids"], batch["input_ids"][:, :4])
    assert torch.equal(second["input_ids"], batch["input_ids"][:, 4:])
    assert torch.equal(second["position_ids"], torch.tensor([[4, 5, 6, 7]] * 2))  # global positions
    # The last token of the first half predicts the first token of the second half.
    assert first["shift_labels"][1, 3] == batch["input_ids"][1, 4]
    assert second["shift_labels"][:, 3].tolist() == [IGNORE, IGNORE]  # nothing after the row
    assert "attention_mask" not in first  # padding is at the end: causal attention never sees it
    assert torch.equal(first["labels"], first["shift_labels"])


def test_the_shares_of_a_group_add_up_to_the_whole_rows_loss() -> None:
    """Each rank's loss is its token-loss sum over the group's token count; without a process group
    the count is this rank's own, so the sum over ranks is rebuilt here by hand."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    batch = _batch()
    logits = torch.randn(2, 8, 32)
    whole = ForCausalLMLoss(logits, batch["labels"], vocab_size=32)
    total_tokens = sum(
        int((s["shift_labels"] != IGNORE).sum())
        for s in (SequenceShard(2, r, Collectives()).shard(batch) for r in range(2))
    )
    shares = []
    for rank in range(2):
        shard = SequenceShard(2, rank, Collectives()).shard(batch)
        part = logits[:, rank * 4 : (rank + 1) * 4].contiguous()
        shares.append(
            ForCausalLMLoss(
                part,
                shard["labels"],
                vocab_size=32,
                shift_labels=shard["shift_labels"],
                num_items_in_batch=torch.tensor(total_tokens),
            )
        )
    assert abs(float(sum(shares)) - float(whole)) < 1e-6


def test_a_rewritten_deepspeed_key_is_said_in_one_notice(tmp_path: Path) -> None:
    # Ulysses under ZeRO-3 needs the contiguous all-reduce path: a DS JSON that asks for reduce_scatter (and a
    # small bucket) gets them changed, and the run says so, with the values, instead of changing them silently.
    import json

    from llm_train.config.ds_json import load_ds_config

    _, raw = load_ds_config("zero3")
    raw["zero_optimization"].update({"reduce_scatter": True, "reduce_bucket_size": 1000})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    run = resolve_run("tiny-cpu-sp2", [f"deepspeed.config={path}"], world_size=2)
    assert run.ds_config["zero_optimization"]["reduce_scatter"] is False
    notice = run.notice or ""
    assert "zero_optimization reduce_scatter true -> false, reduce_bucket_size 1000 -> " in notice
    assert "mine.json" in notice and "Ulysses" in notice
    assert "reduce_scatter" not in (resolve_run("tiny-cpu-sp2", [], world_size=2).notice or "")
