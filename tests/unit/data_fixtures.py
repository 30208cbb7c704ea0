"""Shared fixtures for the data-pipeline tests (no tests here): tokenizer, row builders, decoders."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from llm_train.assets import build

TOKENIZER_DIR = build.DEFAULT_OUT / "tokenizer"
CHAT_JSONL = build.DEFAULT_OUT / "chat.jsonl"


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> Any:
    """The bundled tiny tokenizer, shared: tests must not modify it (see fresh_tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def fresh_tokenizer() -> Any:
    """A tokenizer the test may modify (the shared one must stay as shipped)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def text_rows(n: int, seed: int = 0, max_words: int = 30) -> list[dict[str, str]]:
    """Distinct documents of varied length (each names its own index, so no two tokenise alike)."""
    import random

    rng = random.Random(seed)
    words = ["list", "tuple", "yield", "class", "import", "lambda", "scope", "frame", "value", "name"]
    return [
        {"text": f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, max_words)))}
        for i in range(n)
    ]


def data_section(tmp_path: Path, **fields: Any) -> Any:
    from llm_train.config.recipe_sections import DataSection

    return DataSection.model_validate({"cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0, **fields})


def samples_of(batch: dict[str, Any]) -> list[tuple[int, ...]]:
    """The samples of a packed micro-batch (token tuples), split where position ids restart; padding left out."""
    out = []
    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    for row in range(ids.shape[0]):
        starts = [i for i in range(ids.shape[1]) if int(positions[row, i]) == 0] + [ids.shape[1]]
        for lo, hi in zip(starts, starts[1:], strict=False):
            if bool((labels[row, lo:hi] == -100).all()):
                continue  # the padding tail (a sample always has a trained-on token)
            out.append(tuple(int(t) for t in ids[row, lo:hi]))
    return out
