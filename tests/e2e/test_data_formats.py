"""Every data format trains end to end: real 2-process DeepSpeed on CPU through llm_train/train.py.

One launch trains on a mixture of all four formats at once (text, instruction, chat,
tokenized; packed); a second runs the shipped tiny-cpu-chat recipe in padded mode, a third the same
recipe on its chat examples in ShareGPT's shape (preset: sharegpt), a fourth on them as TRL's
conversational prompt-completion rows (format: completion). Each
use their own cache folder, so tokenisation runs inside the launch (both ranks racing for
the same cache entry: one builds, the other waits and reads).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, assert_ok, launch, losses

pytestmark = pytest.mark.e2e

ASSETS = REPO / "llm_train" / "assets" / "tiny"
STEPS = 4
SHORT = [
    f"--max-steps={STEPS}",
    "optim.warmup_steps=0",
    "output.log_every=1",
    "eval.every=0",
    "eval.batches=1",
    "output.sample_prompt=null",
    "checkpoint.at_end=false",
]


def _write_sources(tmp: Path) -> dict[str, Path]:
    from transformers import AutoTokenizer

    chats = [json.loads(line)["messages"] for line in (ASSETS / "chat.jsonl").read_text().splitlines()]
    instruction = tmp / "alpaca.jsonl"
    instruction.write_text(
        "".join(
            json.dumps({"instruction": m[-2]["content"], "input": "", "output": m[-1]["content"]}) + "\n"
            for m in chats
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    paragraphs = [p for p in (ASSETS / "corpus.txt").read_text().split("\n\n") if p.strip()][:300]
    tokenized = tmp / "tokenized.jsonl"
    with tokenized.open("w") as handle:
        for text in paragraphs:
            ids = tokenizer.encode(text)[:200] + [tokenizer.eos_token_id]
            handle.write(json.dumps({"input_ids": ids, "labels": [-100] * 2 + ids[2:]}) + "\n")
    return {"instruction": instruction, "tokenized": tokenized}


def _prepared_line(fmt: str, stdout: str) -> bool:
    # Rank 0 prints. The cache folder is new, so one of the two ranks tokenised in this launch:
    # rank 0 itself, or rank 1 while rank 0 waited on the lock ("tokenised by another
    # process"), or rank 1 before rank 0 even looked ("cached").
    return bool(
        re.search(
            rf"\({fmt}\): (tokenised [\d,]+ rows|[\d,]+ rows, .*\((cached|tokenised by another process)\))",
            stdout,
        )
    )


def _world_ok(run_dir: Path) -> None:
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and sorted(r["dp_rank"] for r in world["ranks"]) == [0, 1]
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in steps.values())


def test_all_formats_in_one_mixture_train(tmp_path: Path) -> None:
    files = _write_sources(tmp_path)
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu-chat.yaml").read_text())
    recipe["model"]["tokenizer"] = str(ASSETS / "tokenizer")
    recipe["data"] = {
        "train": [
            {"path": str(ASSETS / "corpus.txt"), "format": "text", "weight": 0.1},
            {"path": str(ASSETS / "chat.jsonl"), "format": "chat"},
            {"path": str(files["instruction"]), "format": "instruction"},
            {"path": str(files["tokenized"]), "format": "tokenized", "weight": 0.5},
        ],
        "eval_fraction": 0.05,
        "seq_len": 256,
        "cache_dir": str(tmp_path / "cache"),
    }
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_dir = tmp_path / "run"
    result = launch(["--recipe", str(path), "--output-dir", str(run_dir), *SHORT])
    assert_ok(result)
    _world_ok(run_dir)
    for fmt in ("text", "chat", "instruction", "tokenized"):
        assert _prepared_line(fmt, result.stdout), fmt


@pytest.fixture(scope="module")
def padded_chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The shipped tiny-cpu-chat recipe in padded mode: its run directory and output."""
    tmp = tmp_path_factory.mktemp("padded")
    run_dir = tmp / "run"
    args = ["--recipe", "tiny-cpu-chat", "--output-dir", str(run_dir), *SHORT]
    result = launch([*args, "data.packing=padded", f"data.cache_dir={tmp / 'cache'}"])
    assert_ok(result)
    return run_dir, result.stdout


def test_shipped_chat_recipe_trains_padded(padded_chat: tuple[Path, str]) -> None:
    run_dir, stdout = padded_chat
    _world_ok(run_dir)
    assert _prepared_line("chat", stdout)


def test_a_sharegpt_file_trains_through_tiny_cpu_chat_with_the_preset(
    tmp_path: Path, padded_chat: tuple[Path, str]
) -> None:
    # The bundled chat examples as ShareGPT writes them: conversations[].from/value, human/gpt/system.
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = tmp_path / "sharegpt.jsonl"
    with shared.open("w") as out:
        for line in (ASSETS / "chat.jsonl").read_text().splitlines():
            turns = [{"from": names[m["role"]], "value": m["content"]} for m in json.loads(line)["messages"]]
            out.write(json.dumps({"conversations": turns}) + "\n")
    # Mapped, the same conversations train on the same tokens with the same loss mask (the assistant
    # turns only: tests/unit/test_data_chat_mapping.py), so every step's loss is the OpenAI file's.
    _trains_like_the_chat_file(tmp_path, padded_chat, f"{{path: {shared}, format: chat, preset: sharegpt}}")


def test_the_chat_examples_as_prompt_completion_rows_train_to_the_same_losses(
    tmp_path: Path, padded_chat: tuple[Path, str]
) -> None:
    # TRL's conversational shape: each conversation's turns before its one assistant turn as the prompt,
    # that turn as the completion. The loss covers the same tokens (tests/unit/test_data_completion.py),
    # so every step's loss is the chat file's.
    rows = tmp_path / "completion.jsonl"
    with rows.open("w") as out:
        for line in (ASSETS / "chat.jsonl").read_text().splitlines():
            messages = json.loads(line)["messages"]
            out.write(json.dumps({"prompt": messages[:-1], "completion": messages[-1:]}) + "\n")
    stdout = _trains_like_the_chat_file(tmp_path, padded_chat, f"{{path: {rows}, format: completion}}")
    assert _prepared_line("completion", stdout)


def _trains_like_the_chat_file(tmp_path: Path, padded_chat: tuple[Path, str], source: str) -> str:
    """tiny-cpu-chat (padded) on `source` instead of its chat file: every step's loss is the chat file's."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-cpu-chat", "--output-dir", str(run_dir), *SHORT, f"data.train=[{source}]"]
    result = launch([*args, "data.packing=padded", f"data.cache_dir={tmp_path / 'cache'}"])
    assert_ok(result)
    _world_ok(run_dir)
    assert losses(run_dir) == losses(padded_chat[0])
    return result.stdout
