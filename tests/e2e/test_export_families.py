"""Families beside Llama train, export, pass the export check and generate through transformers.

Each run is the real entry point on one process, a world of one (ZeRO-3 from the tiny-cpu recipe, so
the export gathers partitioned weights; PLAIN_PYTHON's as `python llm_train/train.py` with no launcher,
the others given their rank as torchrun gives it, forked by the launch server) with the model
swapped through `model.config` overrides: a random tiny model of that family (hidden 64, 2 layers, the bundled
tokenizer). The run verifies its own export (keys as `from_pretrained` reports them, logits
against the training process's); the test then loads final/ the way a user would, through
`transformers.pipeline("text-generation")`. Two steps of seq_len 32 are enough: the point is
the names and shapes each family writes, not what it learns. One more run trains GPT-NeoX in
bf16 on 2 processes: under ZeRO-3 the reference forward is a collective (both ranks gather
each layer), and the check's bf16 tolerance must hold across that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_ok, launch, losses, train_py

pytestmark = pytest.mark.e2e

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # Gemma's default (256) would not fit hidden 64
}
# Family -> extra model.config fields. Gemma ties its head to the embedding (stored once).
FAMILIES = {
    "gpt_neox": {},
    "qwen2": {},
    "mistral": {},
    "gemma": {"tie_word_embeddings": "true"},
    "phi3": {},
    "olmo2": {},
}
PLAIN_PYTHON = "qwen2"  # the family whose run also stands for the plain-python case


def family_args(family: str, run_dir: Path, *extra: str) -> list[str]:
    fields = {"model_type": family, **SMALL, **FAMILIES[family]}
    return [
        "--recipe",
        "tiny-cpu",
        "--output-dir",
        str(run_dir),
        "--max-steps",
        "2",
        "data.seq_len=32",
        "optim.micro_batch_size=2",
        "optim.warmup_steps=1",
        "output.log_every=1",
        *(f"model.config.{key}={value}" for key, value in fields.items()),
        *extra,
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_trains_exports_verified_and_generates(family: str, tmp_path: Path) -> None:
    from transformers import pipeline

    run_dir = tmp_path / "run"
    args = family_args(family, run_dir)
    result = train_py(args) if family == PLAIN_PYTHON else launch(args, nproc=1)
    assert_ok(result)
    assert json.loads((run_dir / "final" / "config.json").read_text())["model_type"] == family
    assert "verified: loads with no missing, unexpected or mismatched keys; logits" in result.stdout
    check = json.loads((run_dir / "final" / "export_check.json").read_text())
    assert check["ok"] and check["max_logit_diff"] <= check["tolerance"]
    # A world of one that trains every step and prints the recipe's sample (plain `python
    # llm_train/train.py` needs no launcher for it).
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 1 and world["ranks"][0]["rank"] == 0
    assert sorted(losses(run_dir)) == [1, 2] and "sample:" in result.stdout

    generate = pipeline("text-generation", model=str(run_dir / "final"), device="cpu")
    prompt = "The import statement"
    out = generate(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out.startswith(prompt) and len(out) > len(prompt)


def test_gpt_neox_in_bf16_on_two_zero3_ranks_exports_verified_against_the_trained_logits(
    tmp_path: Path,
) -> None:
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    result = launch(family_args("gpt_neox", run_dir, "precision=bf16"), nproc=2)
    assert_ok(result)
    assert json.loads((run_dir / "world.json").read_text())["world_size"] == 2
    check = json.loads((run_dir / "final" / "export_check.json").read_text())
    with safe_open(str(run_dir / "export_reference.safetensors"), framework="pt") as reference:
        assert reference.metadata()["dtype"] == "bfloat16"  # the training forward ran in bf16
        scale = float(reference.get_tensor("logits").abs().max())
    # 4 bf16 ulps (2**-7 each) of the largest logit, as export/verify.py derives it; not a fixed 0.5.
    assert check["tolerance"] == pytest.approx(4 * 2**-7 * scale)
    assert check["max_logit_diff"] <= check["tolerance"]

    # `llm-train export` of the same run's ZeRO-3 checkpoint passes the same check (bf16 weights
    # from the fp32 master copy, compared with the checkpoint's fp32 logits).
    # In this process: the installed script is launched once, in test_resume.py's test_export_round_trip.
    from llm_train.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_neox"
    check = json.loads((out / "export_check.json").read_text())
    assert check["max_logit_diff"] <= check["tolerance"]
