"""GRPO in real 2-process DeepSpeed runs on CPU (recipe tiny-cpu-grpo: the bundled prompts, a digit reward).

Launches:
- the recipe as shipped (ZeRO-2, 30 steps), the same under ZeRO-3, and with LoRA: the mean reward of the last
  5 steps exceeds the first 5 steps' by at least 0.4, every GRPO metric reaches metrics.jsonl, the world was 2
  ranks, the export verifies;
- the same with a learning rate of 1e-12 (the schema wants lr > 0; Adam's steps are then ~1e-12, far below
  anything that moves a sampled token): the reward does not rise, so the rise above comes from training;
- 8 steps checkpointed every 4, killed with -9 after step 5 and resumed with --resume auto: the prompts, the
  sampling RNG and the weights come back, so every step's rewards and loss equal the uninterrupted ZeRO-2
  run's (the first launch above) exactly;
- ZeRO-3 + LoRA + beta 0.04 + num_iterations 2: generation with the weights gathered and the hooks off
  (compat.gathered_for_generation), the reference by the adapters switched off, the ratio of the second
  pass off 1 (clipping logged) and the KL positive once the adapters have moved;
- ZeRO-3 generating layer by layer (grpo.ds3_gather_for_generation false) against the whole-model gather
  (the first 3 steps of the ZeRO-3 launch above): the same completions, rewards and losses;
- a reward function that raises on one rank of two: one line on every rank, exit 2, no traceback.

Why a margin of 0.4: a random tiny model writes a digit in about a quarter of its 16-token completions, so
each window of 5 steps x 32 completions holds Bernoulli(~0.25) rewards: the mean's std is ~0.034, the
difference of two windows' ~0.048. Without learning a 0.4 rise is over 8 standard deviations away; the
recipe learns to write digits almost always (measured: 0.22 -> 1.0, a rise of 0.78). The lr-0 run allows
less than 0.2 (4 standard deviations) either way.
The loss itself, its gradients and the advantages are checked against TRL in tests/unit/test_grpo_loss.py.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import assert_ok, launch, read_metrics, resume_after_kill_9

pytestmark = pytest.mark.e2e

WINDOW = 5
GRPO_METRICS = (
    "rewards/has_digit/mean",
    "rewards/has_digit/std",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "entropy",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "generation_tokens_per_s",
    "time_generate_s",
    "time_score_s",
    "step_time_s",
)


def _run(run_dir: Path, *extra: str) -> list[dict]:
    result = launch(["--recipe", "tiny-cpu-grpo", "--output-dir", str(run_dir), *extra])
    assert_ok(result)
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and sorted(r["rank"] for r in world["ranks"]) == [0, 1]
    return [m for m in read_metrics(run_dir) if "reward" in m]


def _rise(rows: list[dict]) -> tuple[float, float]:
    rewards = [m["reward"] for m in sorted(rows, key=lambda m: m["step"])]
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    return sum(first) / WINDOW, sum(last) / WINDOW


# The adapters of a LoRA run include lm_head: the tiny model is randomly initialised, its output layer's weights
# are small, and adapters inside the layers alone barely move its output distribution in 30 steps (measured:
# reward 0.19 -> 0.23 with the schema's targets at lr 2e-2; 0.23 -> 1.0 with lm_head added).
LORA = (
    "lora.rank=16",
    "lora.alpha=32",
    "optim.lr=2e-2",
    "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
)


LEARNING_RUNS = {"zero2": (), "zero3": ("deepspeed.config=zero3",), "zero2-lora": LORA}


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, list[dict]]]:
    """The recipe's 30-step runs of LEARNING_RUNS, each launched once for the module: the resume and the
    layer-by-layer tests compare with their first steps. A run's first steps do not depend on its length:
    the schedule is constant after 2 warm-up steps, and prompts, sampling and weights follow the seed."""
    done: dict[str, tuple[Path, list[dict]]] = {}

    def run(name: str) -> tuple[Path, list[dict]]:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(f"grpo-{name}")
            done[name] = (run_dir, _run(run_dir, *LEARNING_RUNS[name]))
        return done[name]

    return run


@pytest.mark.parametrize("name", list(LEARNING_RUNS))
def test_tiny_cpu_grpo_learns_its_reward(
    learning_run: Callable[[str], tuple[Path, list[dict]]], name: str
) -> None:
    run_dir, rows = learning_run(name)
    overrides = LEARNING_RUNS[name]
    assert [m["step"] for m in rows] == list(range(1, 31))
    first, last = _rise(rows)
    print(
        f"tiny-cpu-grpo {overrides}: mean reward of the first {WINDOW} steps {first:.3f}, "
        f"of the last {WINDOW} {last:.3f}"
    )
    assert last - first >= 0.4, (first, last)
    for m in rows:
        assert set(GRPO_METRICS) <= set(m), set(GRPO_METRICS) - set(m)
        assert 1 <= m["completions/mean_length"] <= m["completions/max_length"] <= 16
        assert 0 <= m["frac_reward_zero_std"] <= 1 and m["generation_tokens_per_s"] > 0
        # The rest is training. Not at step 1: the times are means over ranks, and there one rank waits in the
        # first reward gather for the other's start-up (measured: 0.67 + 0.85 s against a 1.18 s step).
        assert m["step"] == 1 or m["time_generate_s"] + m["time_score_s"] < m["step_time_s"]
        assert "kl" not in m  # beta 0: no reference model, no KL
    # num_iterations 1: the ratio is exp(0), nothing is ever clipped.
    assert all(m["clip_ratio/region_mean"] == 0 for m in rows)
    assert all(
        0 < m["entropy"] < math.log(4096) for m in rows
    )  # nats, below the uniform 4096-token vocabulary's
    assert (run_dir / "final" / "model.safetensors").is_file()
    # A few completions of each logged step (log_every 1: every step) with their rewards, in the run.
    shown = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in shown}) == list(range(1, 31)) and len(shown) == 30 * 4
    assert all(r["rewards/has_digit"] == r["reward"] in (0.0, 1.0) and r["prompt"] for r in shown)


def test_without_learning_the_reward_does_not_rise(tmp_path: Path) -> None:
    rows = _run(tmp_path / "lr0", "optim.lr=1e-12", "--max-steps=12")
    first, last = _rise(rows)
    print(f"tiny-cpu-grpo at lr 1e-12: first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}")
    assert abs(last - first) < 0.2, (first, last)


def test_zero3_lora_with_a_reference_and_two_iterations(tmp_path: Path) -> None:
    rows = _run(
        tmp_path / "zero3-lora",
        "deepspeed.config=zero3",
        "lora.rank=8",
        "grpo.beta=0.04",
        "grpo.num_iterations=2",
        "--max-steps=4",
    )
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    # Steps 1 and 3 generate; steps 2 and 4 train on the same completions again.
    assert (
        rows[0]["time_generate_s"] > 0 and rows[1]["time_generate_s"] == 0 and rows[2]["time_generate_s"] > 0
    )
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6)  # the adapters start at zero: policy = reference
    assert rows[-1]["kl"] > 0
    assert rows[0]["clip_ratio/region_mean"] == 0  # first pass: ratio exp(0)
    assert all(m["reward"] == rows[0]["reward"] for m in rows[:2])  # one generation, reported twice


def test_a_killed_run_resumes_exactly(
    tmp_path: Path, learning_run: Callable[[str], tuple[Path, list[dict]]]
) -> None:
    """8 steps checkpointed every 4, killed after step 5 and resumed: its steps are the first 8 of the
    uninterrupted (and never checkpointed) 30-step run of the same recipe."""
    whole_dir, whole = learning_run("zero2")
    args = ["--recipe", "tiny-cpu-grpo", "--output-dir", str(tmp_path / "killed"), "--max-steps=8"]
    resume_after_kill_9(tmp_path / "killed", [*args, "checkpoint.every_steps=4", "--resume", "auto"], step=5)
    resumed = {m["step"]: m for m in read_metrics(tmp_path / "killed") if "reward" in m}  # last wins
    assert sorted(resumed) == list(range(1, 9))
    for step, m in resumed.items():
        for key in ("reward", "loss", "completions/mean_length"):
            assert m[key] == whole[step - 1][key], (step, key)
    # The completions themselves: each step's shown ones, the killed run's rows past the checkpoint rewound
    # with the metrics (they were duplicated before).
    assert _shown(tmp_path / "killed") == {s: r for s, r in _shown(whole_dir).items() if s <= 8}


def _shown(run_dir: Path) -> dict[int, list[dict]]:
    """completions.jsonl by step, each step written once (4 rows)."""
    by_step: dict[int, list[dict]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append(row)
    assert all(len(rows) == 4 for rows in by_step.values()), {s: len(r) for s, r in by_step.items()}
    return by_step


def test_a_reward_function_that_raises_on_one_rank_stops_every_rank_with_its_one_line(tmp_path: Path) -> None:
    """Rank 0's function raises while rank 1's scores: rank 1 must not die in the reward gather with a gloo
    traceback (it did), both stop on rank 0's line, exit code 2."""
    (tmp_path / "one_rank_rewards.py").write_text(
        "import os\n\n\n"
        "def boom(completions, **_):\n"
        "    if os.environ['RANK'] == '0':\n"
        "        raise ValueError('no answer column')\n"
        "    return [0.0] * len(completions)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    rewards = "grpo.rewards=[{kind: function, function: 'one_rank_rewards:boom'}]"
    result = launch(["--recipe", "tiny-cpu-grpo", "--output-dir", str(tmp_path / "run"), rewards], env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("llm-train: error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert errors == [
        "llm-train: error: grpo.rewards[0] (one_rank_rewards:boom) raised ValueError: no answer column; fix the "
        "function (it is called as TRL calls one: prompts, completions, completion_ids, the prompt rows' fields, "
        "trainer_state, log_metric and log_extra, as keywords)"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_zero3_generates_the_same_completions_gathering_layer_by_layer(
    tmp_path: Path, learning_run: Callable[[str], tuple[Path, list[dict]]]
) -> None:
    """grpo.ds3_gather_for_generation false: ZeRO-3's hooks gather each layer as generate reaches it, the same
    weights through the same forwards, so the same completions, rewards and losses as the whole-model gather
    (the first 3 steps of the 30-step ZeRO-3 run)."""
    whole_dir, whole = learning_run("zero3")
    layered = _run(
        tmp_path / "layered",
        "deepspeed.config=zero3",
        "--max-steps=3",
        "grpo.ds3_gather_for_generation=false",
    )
    assert [m["step"] for m in layered] == [1, 2, 3]
    for a, b in zip(whole[:3], layered, strict=True):
        assert (a["reward"], a["loss"], a["completions/mean_length"]) == (
            b["reward"],
            b["loss"],
            b["completions/mean_length"],
        )
    assert {s: r for s, r in _shown(whole_dir).items() if s <= 3} == _shown(tmp_path / "layered")
