"""`format: image_chat`: the three shapes users bring give the same model inputs, the loss is on assistant text
only (never on image tokens), and every bad input is one line naming the row and the file.

The processor is the bundled tiny LLaVA one (llm_train/assets/tiny_vlm/processor: 16 image tokens per image).
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_train.assets import vlm
from llm_train.config.recipe_sections import DataSection
from llm_train.config.source_schema import ImageChatSource
from llm_train.data import prepare_data
from llm_train.data.formats.image_chat import image_chat_fn, load_processor
from llm_train.data.formats.images import ImageSizing
from llm_train.data.model_inputs import IGNORE, build_rows
from llm_train.errors import UserError
from tests.unit.data_fixtures import get_tokenizer, write_jsonl

ASSETS = Path(vlm.__file__).resolve().parent / "tiny_vlm"
PROCESSOR = ASSETS / "processor"
IMAGE_TOKENS = (vlm.IMAGE_SIZE // vlm.PATCH_SIZE) ** 2


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoTokenizer

    return load_processor(AutoTokenizer.from_pretrained(str(PROCESSOR)), "data.train[0]")


@pytest.fixture
def images(tmp_path: Path) -> Path:
    shutil.copytree(ASSETS / "images", tmp_path / "images")
    return tmp_path


def _encode(processor: Any, rows: list[dict[str, Any]], base: Path, **keys: Any) -> dict[str, list[Any]]:
    source = ImageChatSource.model_validate({"path": str(base / "rows.jsonl"), **keys})
    fn = image_chat_fn(source, processor, None, "data.train[0]")
    batch: dict[str, list[Any]] = {}
    for row in rows:
        for name, value in row.items():
            batch.setdefault(name, []).append(value)
    return fn(batch, list(range(len(rows))))


def _arrays(blob: bytes) -> dict[str, np.ndarray]:
    import io

    with np.load(io.BytesIO(blob)) as data:
        return {k: data[k] for k in data.files}


def test_the_three_shapes_give_the_same_ids_pixels_and_mask(processor: Any, images: Path) -> None:
    question, answer = "What is in the picture?", "a red circle."
    path = "images/red-circle.png"
    uri = "data:image/png;base64," + base64.b64encode((images / path).read_bytes()).decode()
    trl = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [path],
    }
    llama_factory = {
        "conversations": [{"from": "human", "value": "<image>" + question}, {"from": "gpt", "value": answer}],
        "image": path,  # LLaVA's single-image column
    }
    openai = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uri}},
                    {"type": "text", "text": question},
                ],
            },
            {"role": "assistant", "content": answer},
        ]
    }
    hub_feature = {**trl, "images": [{"bytes": (images / path).read_bytes(), "path": None}]}
    outs = [
        _encode(processor, [trl], images),
        _encode(processor, [llama_factory], images, preset="sharegpt"),
        _encode(processor, [openai], images),
        _encode(processor, [hub_feature], images),
    ]
    first = outs[0]
    ids = np.asarray(first["input_ids"][0])
    assert int((ids == processor.image_token_id).sum()) == IMAGE_TOKENS
    pixels = _arrays(first["arrays"][0])["pixel_values"]
    assert pixels.shape == (1, 3, vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)
    for other in outs[1:]:
        assert other["input_ids"] == first["input_ids"]
        assert other["loss_mask"] == first["loss_mask"]
        np.testing.assert_array_equal(_arrays(other["arrays"][0])["pixel_values"], pixels)


def test_labels_are_on_assistant_text_only_never_on_image_tokens(processor: Any, tmp_path: Path) -> None:
    data = DataSection.model_validate(
        {
            "train": [{"path": str(ASSETS / "captions.jsonl"), "format": "image_chat"}],
            "seq_len": 64,
            "packing": "padded",
            "eval_fraction": 0,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    split = prepare_data(data, processor.tokenizer, seed=0).train
    batch = build_rows(split, [(0, 0), (0, 5)])
    ids, labels = batch["input_ids"], batch["labels"]
    assert isinstance(ids, np.ndarray) and isinstance(labels, np.ndarray)
    assert batch["pixel_values"].shape == (2, 3, vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)  # type: ignore[union-attr]
    tokenizer = processor.tokenizer
    for r in range(2):
        image = ids[r] == processor.image_token_id
        assert image.sum() == IMAGE_TOKENS and (labels[r][image] == IGNORE).all()
        trained = tokenizer.decode(ids[r][labels[r] != IGNORE])
        # Row 0 is red-circle's first question, row 5 red-square's second: captions only, then the eos.
        assert trained == ["a red circle.<|eos|>", "a red square.<|eos|>"][r]
    # Sizing applies before the processor: a bound below the image's 64 x 64 pixels shrinks it first.
    small = ImageSizing(max_pixels=32 * 32).apply(vlm.draw("red", "circle"))
    assert small.size == (32, 32)


def _bad(tmp_path: Path, rows: list[dict[str, Any]], match: str, tokenizer: Any = None, **data: Any) -> str:
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    section = DataSection.model_validate(
        {
            "train": [{"path": str(path), "format": "image_chat"}],
            "seq_len": 64,
            "packing": "padded",
            "cache_dir": str(tmp_path / "cache"),
            **data,
        }
    )
    from transformers import AutoTokenizer

    with pytest.raises(UserError, match=match) as info:
        prepare_data(section, tokenizer or AutoTokenizer.from_pretrained(str(PROCESSOR)), seed=0)
    assert "\n" not in str(info.value)
    return str(info.value)


def _row(*images: Any, placeholders: int = 1) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "<image>" * placeholders + "What is it?"},
            {"role": "assistant", "content": "a red circle."},
        ],
        "images": list(images),
    }


def test_bad_images_are_one_line_naming_row_and_file(images: Path) -> None:
    good = _row("images/red-circle.png")
    _bad(
        images,
        [good, _row("images/none.png")],
        r"data.train: .*: row 2: image 1: image file not found: .*none.png",
    )
    (images / "images" / "broken.png").write_bytes(b"\x89PNG not really")
    _bad(
        images,
        [good, good, _row("images/broken.png")],
        r"row 3: image 1: .*broken.png is not a readable image",
    )
    _bad(images, [_row("images/red-circle.png", placeholders=2)], r"row 1: the conversation has more images")
    _bad(
        images,
        [_row("images/red-circle.png", "images/blue-square.png")],
        r"row 1: the row's images column holds 2",
    )
    _bad(
        images,
        [_row("https://example.com/cat.png")],
        r"row 1: image 1: image URL .* cannot be fetched offline",
    )


def test_an_image_row_longer_than_seq_len_is_refused_not_cut(images: Path) -> None:
    message = _bad(
        images,
        [_row("images/red-circle.png")],
        r"row 1 has \d+ tokens, more than data.seq_len=16",
        seq_len=16,
    )
    assert "image tokens count too" in message and "overlong: drop" in message


def test_images_for_a_text_only_model_are_refused(images: Path) -> None:
    _bad(
        images,
        [_row("images/red-circle.png")],
        r"gives images to a text-only model",
        tokenizer=get_tokenizer(),
    )


def test_image_rows_are_not_packed_or_streamed() -> None:
    source = {"path": "rows.jsonl", "format": "image_chat"}
    with pytest.raises(ValueError, match=r"data.train\[0\] is format image_chat.*set data.packing=padded"):
        DataSection.model_validate({"train": [source], "packing": "packed"})
    with pytest.raises(ValueError, match=r"data.train\[0\].streaming=true: image_chat rows"):
        DataSection.model_validate(
            {"train": [{**source, "streaming": True}], "packing": "padded", "eval_fraction": 0}
        )


def test_image_rows_for_a_text_only_recipe_are_refused_before_any_worker() -> None:
    from llm_train.config.recipe import load_recipe
    from llm_train.config.resolution import model_fields

    rows = f"data.train=[{{path: {ASSETS / 'captions.jsonl'}, format: image_chat}}]"
    recipe = load_recipe("tiny-cpu-chat", [rows, "data.packing=padded"])
    with pytest.raises(
        UserError, match=r"data.train\[0\] is format image_chat, whose images model llama cannot read"
    ):
        model_fields(recipe)
    assert model_fields(load_recipe("tiny-cpu-vlm"))["model_type"] == "llava"


def test_a_micro_batch_without_images_gets_a_blank_image_row_that_leaves_the_loss_unchanged(
    processor: Any, images: Path
) -> None:
    """Under ZeRO-3 every rank must run the vision tower (a rank without images desynchronised gloo's
    collectives in a 2-rank run): an image split's image-less micro-batch gets one blank-image row, labels
    -100, and the model's loss on the batch stays what it is without it."""
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForImageTextToText

    text_only = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "hello."}]},
        ],
        "images": [],
    }
    path = write_jsonl(images / "rows.jsonl", [text_only, _row("images/red-circle.png")])
    data = DataSection.model_validate(
        {
            "train": [{"path": str(path), "format": "image_chat"}],
            "seq_len": 64,
            "packing": "padded",
            "eval_fraction": 0,
            "cache_dir": str(images / "cache"),
        }
    )
    split = prepare_data(data, processor.tokenizer, seed=0).train
    with_image = build_rows(split, [(0, 1)])
    assert with_image["input_ids"].shape == (1, 64)  # type: ignore[union-attr]  # a row with its own image: as is
    batch = build_rows(split, [(0, 0)])
    ids, labels = batch["input_ids"], batch["labels"]
    assert isinstance(ids, np.ndarray) and isinstance(labels, np.ndarray)
    assert ids.shape == (2, 64) and (labels[1] == IGNORE).all()
    assert int((ids[1] == processor.image_token_id).sum()) == IMAGE_TOKENS
    assert batch["pixel_values"].shape == (1, 3, vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)  # type: ignore[union-attr]

    recipe = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu-vlm.yaml").read_text()
    )
    fields = dict(recipe["model"]["config"])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields)
    ).eval()
    plain = {k: torch.from_numpy(v[:1]) for k, v in batch.items() if k != "pixel_values"}  # type: ignore[index]
    padded = {k: torch.from_numpy(v) for k, v in batch.items()}  # type: ignore[arg-type]
    with torch.no_grad():
        torch.testing.assert_close(model(**padded).loss, model(**plain).loss, rtol=1e-5, atol=1e-6)


def test_the_processor_settings_are_part_of_the_cache_key(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from llm_train.data.formats import FORMATS

    folder = shutil.copytree(PROCESSOR, tmp_path / "processor")
    fmt = FORMATS["image_chat"]
    before = fmt.cache_key(AutoTokenizer.from_pretrained(str(folder)))
    config = folder / "processor_config.json"
    config.write_text(config.read_text().replace('"shortest_edge": 56', '"shortest_edge": 112'))
    assert fmt.cache_key(AutoTokenizer.from_pretrained(str(folder))) != before


def test_gemma3_style_per_token_arrays_are_padded_with_their_row(tmp_path: Path) -> None:
    """Gemma 3's processor also returns token_type_ids (1 on image tokens), one per token: they are laid out
    with the row (zero on padding), and its begin/end-of-image markers are never trained on either."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    special = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(vlm.TOKENIZER), extra_special_tokens=special)
    template = vlm.CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=template,
    )
    processor.save_pretrained(tmp_path / "gemma3")
    shutil.copytree(ASSETS / "images", tmp_path / "images")
    rows = [_row("images/red-circle.png")]
    rows[0]["messages"][0]["content"] = "<start_of_image>What is it?"
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = DataSection.model_validate(
        {
            "train": [{"path": str(path), "format": "image_chat", "image_placeholder": "<start_of_image>"}],
            "seq_len": 40,
            "packing": "padded",
            "eval_fraction": 0,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "gemma3"))
    batch = build_rows(prepare_data(data, loaded, seed=0).train, [(0, 0)])
    ids, labels, types = batch["input_ids"], batch["labels"], batch["token_type_ids"]
    assert isinstance(ids, np.ndarray) and isinstance(labels, np.ndarray) and isinstance(types, np.ndarray)
    assert types.shape == ids.shape == (1, 40)
    boi, eoi, soft = (
        loaded.convert_tokens_to_ids(special[k]) for k in ("boi_token", "eoi_token", "image_token")
    )
    np.testing.assert_array_equal(
        types[0], (ids[0] == soft).astype(types.dtype)
    )  # 4 image tokens, zero padding
    assert int(types.sum()) == 4
    markers = np.isin(ids[0], [boi, eoi, soft])
    assert markers.sum() == 6 and (labels[0][markers] == IGNORE).all()
    assert loaded.decode(ids[0][labels[0] != IGNORE]) == "a red circle.<|eos|>"


def test_the_bundled_assets_are_what_the_builder_writes(tmp_path: Path) -> None:
    vlm.build(tmp_path / "tiny_vlm")
    built = sorted(
        p.relative_to(tmp_path / "tiny_vlm") for p in (tmp_path / "tiny_vlm").rglob("*") if p.is_file()
    )
    assert built == sorted(p.relative_to(ASSETS) for p in ASSETS.rglob("*") if p.is_file())
    for name in built:
        assert (tmp_path / "tiny_vlm" / name).read_bytes() == (ASSETS / name).read_bytes(), name
    assert len(vlm.conversations()) == 48 and len(list((ASSETS / "images").glob("*.png"))) == 12


def test_a_missing_image_through_the_command_is_one_line_and_exit_2(
    images: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train.cli import main

    path = write_jsonl(images / "rows.jsonl", [_row("images/red-circle.png"), _row("images/gone.png")])
    train = f"data.train=[{{path: {path}, format: image_chat}}]"
    assert (
        main(["data", "prepare", "--recipe", "tiny-cpu-vlm", train, f"data.cache_dir={images / 'cache'}"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        f"row 2: image 1: image file not found: {images}/images/gone.png"
    )


def test_a_processor_that_needs_torchvision_says_so_in_one_line(tmp_path: Path) -> None:
    """Qwen2-VL's processor has a video processor that needs torchvision (absent here): named, with the fix."""
    import json

    from transformers import AutoTokenizer

    folder = shutil.copytree(vlm.TOKENIZER, tmp_path / "qwen2_vl")
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed: the processor loads")
    with pytest.raises(
        UserError, match=r"none loads from .*qwen2_vl \(.*[Tt]orchvision.*\); pip install torchvision"
    ) as info:
        load_processor(AutoTokenizer.from_pretrained(str(folder)), "data.train[0]")
    assert "\n" not in str(info.value)
