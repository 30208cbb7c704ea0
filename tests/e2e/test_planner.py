"""`llm-train plan --recipe auto --train` end to end: the planner's choice, written out, trains (one CPU process).

The planner's decisions themselves are checked without training in tests/unit/test_planner.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_train.config.recipe import load_recipe
from tests.helpers import REPO
from tests.session_env import OFFLINE_ENV

pytestmark = pytest.mark.e2e


def test_auto_trains_on_cpu(tmp_path: Path) -> None:
    """`--recipe auto --train`: plan, write the recipe into the output dir, train it (one CPU process)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # The model the planner reads is built here (a fresh interpreter for it only imported torch again).
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model)
    AutoTokenizer.from_pretrained(REPO / "llm_train/assets/tiny/tokenizer").save_pretrained(model)
    env = {**os.environ, **OFFLINE_ENV}
    out = tmp_path / "auto"
    cmd = [
        sys.executable,
        "-m",
        "llm_train.cli",
        "plan",
        "--recipe",
        "auto",
        "--model",
        str(model),
        "--gpus",
        "1",
    ]
    cmd += ["--train", "--output-dir", str(out), "optim.epochs=null", "optim.max_steps=3", "data.seq_len=64"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "chosen:" in result.stdout and f"recipe written to {out / 'recipe.yaml'}" in result.stdout
    assert (out / "run" / "final" / "export_check.json").is_file()
    assert load_recipe(str(out / "recipe.yaml")).model.name_or_path == str(model)
