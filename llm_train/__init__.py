"""llm_train: named recipes that turn DeepSpeed + Accelerate into reliable LLM training."""

from pathlib import Path

__version__ = "0.1.0"

# The repository root holds recipes/ and ds_configs/; the package is installed editable
# (see the Makefile), so they are found next to the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
DS_CONFIGS_DIR = REPO_ROOT / "ds_configs"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
