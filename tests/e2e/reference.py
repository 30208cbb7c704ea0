"""The reference runs: tiny-cpu fine-tuned from one saved tiny model under every ZeRO variant.

Other e2e tests reproduce these runs with extra options (checkpoints, kills, signals) and
compare against them: options that do not change the math must not change a single bit.
"""

from __future__ import annotations

from pathlib import Path

STEPS = 6
RESUME_FROM = 3  # the reference runs commit a checkpoint at this step (and at STEPS)
TIMEOUT_MINUTES = 12
VARIANTS = ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
SHORT_RUN = [
    f"--max-steps={STEPS}",
    "optim.warmup_steps=0",
    "output.log_every=1",
    "eval.every=0",
    "eval.batches=2",
    "output.sample_prompt=null",
]


def run_args(variant: str, run_dir: Path, pretrained: Path) -> list[str]:
    return [
        "--recipe",
        "tiny-cpu",
        "--ds-config",
        variant,
        "--output-dir",
        str(run_dir),
        *SHORT_RUN,
        "model.init=pretrained",
        f"model.name_or_path={pretrained}",
        # Math-neutral (test_resume shows checkpointing changes no bit); test_resume_anywhere
        # resumes these step-3 checkpoints on other layouts.
        f"checkpoint.every_steps={RESUME_FROM}",
        # Not DeepSpeed's default 10 nor the recipe default 30: test_zero_stages reads it back from the
        # process group each rank joined (world.json), the proof that it reached Accelerate and DeepSpeed.
        f"deepspeed.timeout_minutes={TIMEOUT_MINUTES}",
    ]
