"""The data-volume guard: the epochs a run implies are printed, and more than data.max_epochs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_train.config.layout import Layout
from llm_train.data.volume import DataVolume, check_volume
from llm_train.errors import UserError


def test_epochs_are_steps_times_the_global_batch_over_the_sequences_of_an_epoch() -> None:
    layout = Layout(world_size=8, tp=2, micro_batch_size=2, grad_accum=4)  # dp 4: 32 sequences per step
    volume = DataVolume.of(layout, sequences_per_epoch=1000, max_steps=50, seq_len=4096)
    assert volume.sequences_per_step == 32
    assert volume.epochs == pytest.approx(1.6)
    assert volume.steps_within(3) == 93  # 93 x 32 = 2976 <= 3000 < 94 x 32


def test_a_run_within_the_limit_gets_one_line_with_the_numbers() -> None:
    line = check_volume(DataVolume(200, 16, 857, 128), max_epochs=8)
    assert line == (
        "data: 200 steps x 16 sequences of 128 tokens = 3.73 epochs of the 857 training sequences "
        "(data.max_epochs=8)"
    )


def test_exactly_max_epochs_is_allowed() -> None:
    check_volume(DataVolume(30, 100, 1000, 128), max_epochs=3)  # 3000 sequences = 3.0 epochs


def test_more_epochs_than_allowed_is_one_line_with_the_numbers_and_every_fix() -> None:
    # The case: 7b-zero3 (2000 steps x 128 sequences of 4096 tokens) on ~30 sequences.
    with pytest.raises(UserError) as info:
        check_volume(DataVolume(2000, 128, 1000, 4096), max_epochs=3)
    assert str(info.value) == (
        "data: optim.max_steps=2000 x 128 sequences per step is 256.0 epochs of the 1000 training sequences "
        "of 4096 tokens, more than data.max_epochs=3; lower optim.max_steps to 23 or fewer, add training "
        "data, or raise data.max_epochs to 256"
    )


def test_when_not_even_one_step_fits_lowering_max_steps_is_not_offered() -> None:
    with pytest.raises(UserError) as info:
        check_volume(DataVolume(2000, 128, 30, 4096), max_epochs=3)
    message = str(info.value)
    assert "8533.3 epochs of the 30 training sequences" in message
    assert "lower optim.max_steps" not in message and "add training data" in message


def test_requested_epochs_are_compared_not_the_rounded_up_steps() -> None:
    # optim.epochs=3 over 100 sequences at 8 per step: 38 steps (rounded up) are 3.04 epochs.
    volume = DataVolume(38, 8, 100, 256)
    assert volume.epochs > 3
    assert "3.04 epochs" in check_volume(volume, max_epochs=3, requested_epochs=3.0)
    with pytest.raises(UserError, match=r"optim.epochs=4 is more than data.max_epochs=3; lower optim.epochs"):
        check_volume(DataVolume(50, 8, 100, 256), max_epochs=3, requested_epochs=4.0)


def test_dry_run_of_a_local_recipe_prints_its_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.train import main

    # tiny-cpu-lora: 50 steps x micro 8 x dp 2 over the bundled corpus (857 sequences of 128 tokens).
    assert main(["--recipe", "tiny-cpu-lora", "--dry-run"]) == 0
    out = capsys.readouterr().out
    data = out.split("# data volume\n", 1)[1]
    assert "50 steps x 16 sequences of 128 tokens = 0.93 epochs of the 857 training sequences" in data


def test_dry_run_of_a_hub_dataset_says_the_epochs_come_with_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from llm_train.train import main

    assert main(["--recipe", "8b-lora-rtx4090", "--dry-run"]) == 0
    out = capsys.readouterr().out.split("# data volume\n", 1)[1]
    assert "epochs not computed before the run" in out and "yahma/alpaca-cleaned" in out


def test_dry_run_of_a_streamed_source_does_not_tokenise_it(capsys: pytest.CaptureFixture[str]) -> None:
    from llm_train.train import main

    corpus = Path(__file__).resolve().parents[2] / "llm_train" / "assets" / "tiny" / "corpus.txt"
    streamed = f"data.train=[{{path: {corpus}, streaming: true}}]"
    assert main(["--recipe", "tiny-cpu", "--dry-run", streamed, "data.eval_fraction=0"]) == 0
    out = capsys.readouterr().out.split("# data volume\n", 1)[1]
    assert (
        out.strip()
        == "data: epochs not counted: data.train is streamed (its length is unknown until it is read)"
    )
