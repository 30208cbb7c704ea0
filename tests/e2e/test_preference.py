"""DPO in real 2-process DeepSpeed runs on CPU (recipe tiny-cpu-dpo: the bundled preference pairs).

Five launches for the whole feature, each covering several things:
- the baseline: ZeRO-3, cached reference, W&B offline and TensorBoard, a checkpoint every 4 steps:
  held-out reward accuracy rises above 0.5 and the margin grows, every metric reaches every tracker;
- the same run killed with -9 after a checkpoint, its reference cache deleted, and resumed with
  `--resume auto`: the reference is scored again on the freshly built model (never on trained
  weights; the stream checks its digest), and losses and final weights equal the baseline's bit for bit;
- QLoRA (LoRA on a 4-bit base) under ZeRO-3 with the live, adapter-disabled reference: it learns too;
- a live frozen reference (a second DeepSpeed engine, sharded under ZeRO-3): the same losses as the
  cached reference.
The losses and gradients themselves are checked against TRL in tests/unit/test_objectives.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_train.runtime.loss.preference_tuning import PREFERENCE_METRICS
from tests.helpers import (
    assert_ok,
    assert_resumed,
    launch,
    launch_popen,
    losses,
    make_tiny_pretrained,
    read_metrics,
    wait_for_step,
)
from tests.optional import require

pytestmark = pytest.mark.e2e

STEPS = 8
PAIRS = 185  # llm_train/assets/tiny/preferences.jsonl: 167 train + 18 held-out pairs (eval_fraction 0.1)


def _args(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "--recipe",
        "tiny-cpu-dpo",
        "--output-dir",
        str(run_dir),
        f"--max-steps={STEPS}",
        f"data.cache_dir={cache}",
        "output.log_every=1",
        "eval.every=4",
        *extra,
    ]


CHECKPOINTED = ("checkpoint.every_steps=4", "--resume", "auto")
# Trackers only in the baseline (they do not touch training, and the recipe hash leaves them out).
TRACKED = ("tracking.mode=offline", "tracking.tensorboard=true")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preference-cache")


@pytest.fixture(scope="module")
def baseline(
    tmp_path_factory: pytest.TempPathFactory, cache: Path
) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("dpo") / "zero3"
    result = launch(_args(run_dir, cache, *CHECKPOINTED, *TRACKED), env={"WANDB_MODE": "offline"})
    assert_ok(result)
    return run_dir, result


def _train_and_eval(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = read_metrics(run_dir)
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def _assert_learns(run_dir: Path, label: str) -> None:
    train, evals = _train_and_eval(run_dir)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(set(PREFERENCE_METRICS) <= set(r) for r in train)
    # Step 1 runs the initial policy, which is the reference: every reward is 0, the loss is log 2.
    first = train[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6) and first["reward_accuracy"] == 0.0
    assert [r["step"] for r in evals] == [4, 8]
    assert all({f"eval_{k}" for k in PREFERENCE_METRICS} <= set(r) for r in evals)
    last = evals[-1]
    assert last["eval_reward_accuracy"] > 0.5  # held-out pairs: 18, never trained on
    assert last["eval_reward_margin"] > 0 and train[-1]["reward_margin"] > first["reward_margin"]
    assert last["eval_reward_chosen"] > last["eval_reward_rejected"]
    print(
        f"{label}: train reward accuracy {first['reward_accuracy']:.3f} at step 1 (policy = reference) -> "
        f"held-out reward accuracy {evals[0]['eval_reward_accuracy']:.3f} at step 4, "
        f"{last['eval_reward_accuracy']:.3f} at step {STEPS}; held-out margin {evals[0]['eval_reward_margin']:+.4f} "
        f"-> {last['eval_reward_margin']:+.4f}"
    )


def test_zero3_dpo_learns_held_out_preferences_and_logs_them_everywhere(
    baseline: tuple[Path, subprocess.CompletedProcess],
) -> None:
    run_dir, result = baseline
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and [r["rank"] for r in world["ranks"]] == [0, 1]
    assert f"reference: log-probs of {PAIRS} pairs scored by the initial model" in result.stdout
    assert "reward accuracy" in result.stdout and "acc " in result.stdout  # console lines
    _assert_learns(run_dir, "ZeRO-3, cached reference")
    evals = _train_and_eval(run_dir)[1]
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"]  # still growing from step 4 to 8
    assert "exported " in result.stdout and "(verified: " in result.stdout
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    names = [f"{split}{name}" for split in ("", "eval_") for name in PREFERENCE_METRICS]
    for name in names:
        assert name.encode() in wandb_file.read_bytes(), name
        # TensorBoard files eval_* metrics in its eval/ section (observability/tracking.py).
        assert name.replace("eval_", "eval/").encode() in events.read_bytes(), name


def test_kill_9_then_resume_rescoring_a_lost_reference_is_bit_identical(
    baseline: tuple[Path, subprocess.CompletedProcess], cache: Path, tmp_path: Path
) -> None:
    reference_dir, _ = baseline
    run_dir = tmp_path / "killed"
    args = _args(run_dir, cache, *CHECKPOINTED)
    proc = launch_popen(args)
    assert wait_for_step(run_dir, 6, proc), proc.communicate()[0][
        -4000:
    ]  # the step-4 checkpoint is committed
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before the kill: nothing was tested"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    lost = sorted(p for p in cache.glob("reference-*") if p.is_dir())
    assert len(lost) == 2  # train and held-out pairs
    for entry in lost:
        shutil.rmtree(entry)

    result = launch(args)
    assert_ok(result)
    assert f"reference: log-probs of {PAIRS} pairs scored by the initial model" in result.stdout
    assert_resumed(result.stdout, run_dir, 4)
    assert losses(run_dir) == losses(reference_dir)  # exact float equality, steps 1-8
    evals = [(r["step"], r["eval_reward_accuracy"]) for r in read_metrics(run_dir) if "eval_loss" in r]
    assert evals == [
        (r["step"], r["eval_reward_accuracy"]) for r in read_metrics(reference_dir) if "eval_loss" in r
    ]
    mine = load_file(run_dir / "final" / "model.safetensors")
    theirs = load_file(reference_dir / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_qlora_dpo_with_the_adapter_disabled_reference(cache: Path, tmp_path: Path) -> None:
    """LoRA on a 4-bit base (QLoRA: the adapter-disabled reference is the quantised base, the same code
    path a 16-bit LoRA takes), loaded from a saved checkpoint as a user's base is."""
    require("bitsandbytes")
    run_dir = tmp_path / "lora"
    base = make_tiny_pretrained(tmp_path / "base", seed=2)
    result = launch(
        _args(
            run_dir,
            cache,
            "preference.reference=live",
            "model.init=pretrained",
            f"model.name_or_path={base}",
            "lora.quantize=nf4",
            "lora.rank=8",
            "lora.alpha=16",
            "lora.dropout=0.0",
            "optim.lr=1e-2",
            "checkpoint.at_end=false",
            "memory.tiled_loss=true",  # the chunked loss through PEFT, and with the adapters disabled
        )
    )
    assert_ok(result)
    assert "reference: log-probs" not in result.stdout  # live: the base scores each batch, nothing cached
    assert "base model: 28 linear layers in nf4" in result.stdout
    _assert_learns(run_dir, "ZeRO-3 + QLoRA, adapter-disabled reference")
    assert "exported " in result.stdout and "(verified: " in result.stdout  # the merged model


def test_a_live_frozen_reference_trains_as_the_cached_one(
    baseline: tuple[Path, subprocess.CompletedProcess], cache: Path, tmp_path: Path
) -> None:
    reference_dir, _ = baseline
    run_dir = tmp_path / "live"
    # Three steps, all inside the 4-step warmup, so the LR is the baseline's at each of them. The chunked
    # loss (memory.tiled_loss) scores policy and frozen copy here: the log-probs of the baseline's dense path.
    args = _args(
        run_dir, cache, "preference.reference=live", "checkpoint.at_end=false", "memory.tiled_loss=true"
    )
    args[args.index(f"--max-steps={STEPS}")] = "--max-steps=3"
    result = launch(args)
    assert_ok(result)
    assert "reference: log-probs" not in result.stdout  # nothing cached: the copy scores every batch
    ours, theirs = losses(run_dir), losses(reference_dir)
    assert list(ours) == [1, 2, 3]
    # The same model scores the same pairs either way; the cached pass batches them differently
    # (other rows, other padding), so the log-probs may differ in their last fp32 bits.
    assert all(abs(ours[s] - theirs[s]) < 1e-5 for s in ours), (ours, theirs)
