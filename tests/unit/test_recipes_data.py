"""The GPU recipes train on real public datasets, named so that they load as written.

There is no network to the hub in tests, so each dataset's splits, configurations and columns
are written down here from its dataset card (HUB_DATASETS), and every GPU recipe's sources are
checked against them with the product's own rules: `sources.locate` must take the path for a hub
id (not a local file), `formats.check_fields` must accept the columns for the source's format,
and datasets' own split parser must accept the split. Local data goes in through the override
each header shows, which must load too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from datasets import ReadInstruction
from transformers import AutoTokenizer

from llm_train import RECIPES_DIR
from llm_train.config.recipe import load_recipe
from llm_train.config.source_schema import ChatSource, InstructionSource
from llm_train.data.formats import check_fields
from llm_train.data.formats.chat import CHAT
from llm_train.data.sources import locate
from llm_train.errors import UserError

ASSETS = Path(__file__).resolve().parents[2] / "llm_train" / "assets"
GPU_RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("tiny-cpu"))

# hub id -> (configurations, splits, columns), from the dataset cards. None: the default configuration.
HUB_DATASETS: dict[str, tuple[set[str | None], set[str], set[str]]] = {
    "HuggingFaceH4/ultrachat_200k": (
        {None, "default"},
        {"train_sft", "test_sft", "train_gen", "test_gen"},
        {"prompt", "prompt_id", "messages"},
    ),
    "yahma/alpaca-cleaned": ({None, "default"}, {"train"}, {"instruction", "input", "output"}),
    # UltraFeedback binarized (Zephyr's DPO data): chosen / rejected are whole conversations.
    "HuggingFaceH4/ultrafeedback_binarized": (
        {None, "default"},
        {"train_prefs", "test_prefs", "train_sft", "test_sft", "train_gen", "test_gen"},
        {"prompt", "prompt_id", "chosen", "rejected", "messages", "score_chosen", "score_rejected"},
    ),
    # PG-19 books as Parquet (the long-context recipes): 28,602 / 50 / 100 books.
    "emozilla/pg19": (
        {None, "default"},
        {"train", "validation", "test"},
        {"short_book_title", "publication_date", "url", "text"},
    ),
    # GSM8K (the GRPO recipes): the question, and the worked solution ending in "#### <answer>".
    "openai/gsm8k": ({"main", "socratic"}, {"train", "test"}, {"question", "answer"}),
    # LLaVA-Instruct-Mix in TRL's VSFT shape (the image-text recipes): {"type": "image"} parts in the messages,
    # the images in a column; 259,155 / 13,640 rows.
    "HuggingFaceH4/llava-instruct-mix-vsft": ({None, "default"}, {"train", "test"}, {"messages", "images"}),
    "HuggingFaceFW/fineweb-edu": (
        {"default", "sample-10BT", "sample-100BT", "sample-350BT"},
        {"train"},
        {
            "text",
            "id",
            "dump",
            "url",
            "file_path",
            "language",
            "language_score",
            "token_count",
            "score",
            "int_score",
        },
    ),
}


def test_the_gpu_recipes_are_the_ones_the_issue_names() -> None:
    # A rename must not quietly shrink what the tests below cover.
    assert {
        "7b-zero3",
        "7b-rtx4090",
        "13b-zero3-offload",
        "13b-rtx4090-offload",
        "70b-zero3",
        "8b-lora-rtx4090",
        "1b-zero2",
        "8b-128k-sp8",
        "8b-1m-sp8-alst",
        "8b-32k-rtx4090",
    } <= set(GPU_RECIPES)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_gpu_recipe_reads_a_known_public_dataset_with_the_right_split_and_fields(name: str) -> None:
    data = load_recipe(name).data
    sources = [("data.train", s) for s in data.sources("train")] + [
        ("data.eval", s) for s in data.sources("eval")
    ]
    assert sources
    for key, source in sources:
        assert locate(source.path, key).kind == "hub", f"{name}: {source.path} is not read as a hub id"
        assert source.path in HUB_DATASETS, f"{name}: {source.path} is not a dataset this test knows"
        configs, splits, columns = HUB_DATASETS[source.path]
        assert source.subset in configs, f"{name}: {source.path} has no configuration {source.subset!r}"
        # 'train[:25%]' reads part of 'train'; datasets' own parser refuses a malformed slice.
        ReadInstruction.from_spec(source.split)
        assert source.split.split("[", 1)[0] in splits, f"{name}: {source.path} has no split {source.split!r}"
        check_fields(sorted(columns), source, key, source.path)  # raises UserError naming the missing field
        if isinstance(source, InstructionSource) and source.input_field:
            # Optional in general, so a misspelled one would silently drop every row's input.
            assert source.input_field in columns, (
                f"{name}: {source.path} has no column {source.input_field!r}"
            )


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_no_gpu_recipe_trains_or_evaluates_on_the_bundled_corpus(name: str) -> None:
    data = load_recipe(name).data
    for source in data.sources("train") + data.sources("eval"):
        assert "llm_train/assets" not in source.path and not Path(source.path).resolve().is_relative_to(
            ASSETS
        )


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_pretraining_recipes_read_web_text_and_fine_tuning_ones_instructions_or_chats(name: str) -> None:
    recipe = load_recipe(name)
    formats = {s.format for s in recipe.data.sources("train")}
    if recipe.description.startswith("Continued pre-training"):
        assert formats == {"text"}
    elif recipe.objective == "grpo":  # online RL generates from prompts (recipe.py refuses anything else)
        assert formats == {"prompt"}
    elif recipe.objective != "lm":  # preference tuning reads pairs (recipe.py refuses anything else)
        assert formats == {"preference"}
    else:
        assert formats <= {"instruction", "chat", "image_chat"} and formats, formats


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_gpu_recipe_header_shows_a_local_data_override_that_loads(name: str) -> None:
    header = "\n".join(
        line for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines() if line[:1] == "#"
    )
    overrides = re.findall(r"(data\.train='[^']+')", header)
    assert overrides, f"{name}: the header shows no data.train='...' override"
    for override in overrides:
        recipe = load_recipe(name, [override.replace("'", "")])
        assert all(s.path.startswith("/data/") for s in recipe.data.sources("train")), override


@pytest.mark.parametrize("name", [n for n in GPU_RECIPES if load_recipe(n).data.chat_template is not None])
def test_gpu_recipe_chat_templates_train_on_exactly_the_assistant_turns(name: str) -> None:
    # Rendered with the bundled tokenizer (the recipes' own need the hub); the template only uses
    # bos_token / eos_token, so what it marks does not depend on the tokenizer.
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny" / "tokenizer")
    template = load_recipe(name).data.chat_template
    conversation = [
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "An ordered sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable one."},
    ]
    tokenize = CHAT.tokenize_fn(ChatSource(path="x.jsonl"), tokenizer, template, "data.train[0]")
    out = tokenize({"messages": [conversation]}, [0])
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    eos = tokenizer.eos_token
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        f"An ordered sequence.{eos}An immutable one.{eos}"
    )
    assert tokenizer.decode(ids).startswith(f"{tokenizer.bos_token}<|user|>\nWhat is a list?{eos}")


def test_a_gpu_recipe_on_the_bundled_corpus_is_refused_with_the_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The issue's case: 7b-zero3's 2000 steps x 128 sequences of 4096 tokens on a 466 KB corpus.
    from llm_train.train import main

    tokenizer = ASSETS / "tiny" / "tokenizer"
    corpus = ASSETS / "tiny" / "corpus.txt"
    code = main(
        ["--recipe", "7b-zero3", "--dry-run", f"data.train=[{corpus}]", f"model.tokenizer={tokenizer}"]
    )
    err = capsys.readouterr().err
    assert code == UserError.exit_code, err
    assert "optim.max_steps=2000 x 128 sequences per step" in err and "more than data.max_epochs=3" in err
    assert len(err.strip().splitlines()) == 1
