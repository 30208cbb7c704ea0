"""The decoder families with quirks are one table, config/model_families.py `MODEL_FAMILIES`, that every place
reads: no other module spells a family's model_type, each row's pipeline classes exist in transformers (and
test_pipeline_model.py runs each pipeline family), and the planner's count of each row equals the model
transformers builds with every bias switched on. These checks fail while a family is listed somewhere but not in
the table, or the table claims a quirk the library does not have (docs/development.md, "Adding a model family's
quirk").
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import llm_train
from llm_train.config.known_models import KNOWN_CONFIGS
from llm_train.config.model_families import MODEL_FAMILIES, PIPELINE_MODEL_TYPES, TEXT_ALIASES
from llm_train.config.model_kind import is_image_text
from llm_train.planning.model.shapes import SUPPORTED_MODEL_TYPES, shape_from_config
from tests.helpers import TINY_DECODER_FIELDS

PACKAGE = Path(llm_train.__file__).resolve().parent
TABLE = PACKAGE / "config" / "model_families.py"
# Published config.json values of public checkpoints: data naming a family, not a quirk of one.
DATA = PACKAGE / "config" / "known_models.py"
# head_dim and tying stated: Gemma 3's row would otherwise fill in its hub defaults (head_dim 256, tied).
TINY = {**TINY_DECODER_FIELDS, "head_dim": 16, "tie_word_embeddings": False}


def _family_names(tree: ast.AST) -> list[int]:
    """Lines holding a family's model_type as a string constant (a comparison, a tuple, a dict key ...)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODEL_FAMILIES
    ]


def test_the_scan_finds_a_copy() -> None:
    for source in (
        'ARCHITECTURES = {"llama": "Llama"}',
        'if model_type == "mistral": pass',
        'x = ("qwen2",)',
    ):
        assert _family_names(ast.parse(source)) == [1], source
    assert not _family_names(ast.parse("MODEL_FAMILIES[config.model_type].pipeline"))


def test_no_family_is_spelled_outside_the_table() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in (TABLE, DATA)
        for line in _family_names(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, f"ask config/model_families.py MODEL_FAMILIES instead of naming a family: {found}"


def test_every_place_reads_the_table() -> None:
    from llm_train.config import parallel

    assert tuple(MODEL_FAMILIES) == SUPPORTED_MODEL_TYPES
    assert parallel.PIPELINE_MODEL_TYPES is PIPELINE_MODEL_TYPES == ("llama", "mistral", "qwen2")
    known = {cfg["model_type"] for cfg in KNOWN_CONFIGS.values() if not is_image_text(cfg)}
    assert known <= set(MODEL_FAMILIES), (
        f"known checkpoints of families without a row: {known - set(MODEL_FAMILIES)}"
    )
    assert not set(TEXT_ALIASES) & set(MODEL_FAMILIES)


@pytest.mark.parametrize("model_type", PIPELINE_MODEL_TYPES)
def test_each_pipeline_family_has_its_classes_and_a_parity_case(model_type: str) -> None:
    from llm_train.runtime.engines.pipeline_model import _hf_classes

    decoder, rotary, norm = _hf_classes(model_type)
    prefix = MODEL_FAMILIES[model_type].pipeline
    assert (decoder.__name__, rotary.__name__, norm.__name__) == (
        f"{prefix}DecoderLayer",
        f"{prefix}RotaryEmbedding",
        f"{prefix}RMSNorm",
    )
    parity = ast.parse((Path(__file__).parent / "test_pipeline_model.py").read_text())
    assert model_type in {n.value for n in ast.walk(parity) if isinstance(n, ast.Constant)}


@pytest.mark.parametrize("model_type", sorted(MODEL_FAMILIES))
def test_the_planner_counts_each_row_as_transformers_builds_it(model_type: str) -> None:
    """Every bias switch on: a row whose attention_bias / mlp_bias / norms lie counts a different size."""
    import transformers

    cfg = {"model_type": model_type, **TINY, "attention_bias": True, "mlp_bias": True}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert shape_from_config(cfg).num_params == sum(p.numel() for p in model.parameters())


def test_the_table_imports_no_torch() -> None:
    code = "import sys, llm_train.config.model_families; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
