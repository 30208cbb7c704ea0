"""A data format is one registered object: its schema half (config/source_schema.py) and its behaviour half
(data/formats/) exist together, under one name, and the data docs name it.

Adding a format is a class in SOURCE_CLASSES, a module registered in FORMATS and a test module; these
checks fail while one of the halves is missing or registered under another name.
"""

from __future__ import annotations

import re
from pathlib import Path

from llm_train.config.source_schema import SOURCE_CLASSES
from llm_train.data.formats import FORMATS, of
from llm_train.data.formats.base import Format

DATA_DOCS = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def test_every_schema_class_has_its_behaviour_under_the_same_name() -> None:
    assert sorted(FORMATS) == sorted(SOURCE_CLASSES)
    for name, fmt in FORMATS.items():
        assert fmt.source_class is SOURCE_CLASSES[name], name
        assert fmt.name == name


def test_every_format_answers_what_the_pipeline_asks() -> None:
    for name, fmt in FORMATS.items():
        # The two questions without a default: which columns, and how rows become tokens.
        assert type(fmt).required_fields is not Format.required_fields, name
        assert type(fmt).tokenize_fn is not Format.tokenize_fn, name
        assert fmt.field_keys, name
        source = fmt.source_class.model_validate({"path": "x.jsonl"})
        assert of(source) is fmt
        assert fmt.required_fields(source), name


def test_the_data_docs_list_every_format() -> None:
    listed = re.search(r"format: text +# (.+)", DATA_DOCS.read_text())
    assert listed, "docs/data.md lists the formats after `format: text  #`"
    assert sorted(name.strip() for name in listed[1].split("|")) == sorted(FORMATS)
