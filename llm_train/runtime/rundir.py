"""The run directory contract.

config/recipe.yaml      the fully resolved recipe
config/ds_config.json   the DeepSpeed config DeepSpeed received (no "auto")
metrics.jsonl           one JSON object per logged step
final/                  a plain Hugging Face model directory
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.observability.tracking import redact


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse a directory that holds another run, unless told to overwrite. Writes nothing."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(
            f"--output-dir {path} already holds a run; pass --overwrite to replace it or choose another directory"
        )


def create_run_dir(path: Path, run: Resolved, overwrite: bool) -> None:
    if overwrite and path.is_dir():
        shutil.rmtree(path)
    (path / "config").mkdir(parents=True, exist_ok=True)
    import yaml

    # Belt and braces: the schema refuses credential-like keys, and nothing secret is written anyway.
    recipe = redact(run.recipe.model_dump(mode="json"))
    (path / "config" / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    import json

    (path / "config" / "ds_config.json").write_text(json.dumps(redact(run.ds_config), indent=2) + "\n")
