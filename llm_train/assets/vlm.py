"""Build the tiny image-text assets of `tiny-cpu-vlm`: drawn images, captioning conversations, a processor.

    tiny_vlm/images/<colour>-<shape>.png   12 small PIL drawings (a coloured shape on white), ~0.3 KB each
    tiny_vlm/captions.jsonl                conversations in TRL's shape: {"type": "image"} parts + `images`
    tiny_vlm/processor/                    a LLaVA processor: the bundled tiny tokenizer plus `<image>`, a CLIP
                                           image processor at 56 px (16 image tokens), the chat template

A caption like "a red circle." is learnable from the pixels alone, so a loss that falls shows the image
reaches the language model. The model itself is random (the recipe's `model.config`, LLaVA: a 2-layer
CLIP vision tower, a 2-layer Llama). LLaVA because it is the family whose processor builds fully
offline on this stack: transformers 5.25's Qwen-VL, SmolVLM, InternVL and GLM-4V processors carry a
video processor, and Pixtral's image processor, that need torchvision, which llm_train does not install.

Usage::

    python -m llm_train.assets.vlm [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "tiny_vlm"
TOKENIZER = Path(__file__).resolve().parent / "tiny" / "tokenizer"

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14  # (56 / 14)^2 = 16 image tokens per image
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = (
    "What is in the picture?",
    "Describe the image.",
    "What shape and colour do you see?",
    "Caption this image.",
)

# The bundled tiny template (assets/build.py) with list-of-parts content: an image part is the image token,
# which the processor expands to the image's tokens; {% generation %} marks the assistant's text for the loss.
CHAT_TEMPLATE = r"""{{- '<|bos|>' -}}
{%- for message in messages -%}
    {{- '<|' + message['role'] + '|>\n' -}}
    {%- if message['content'] is string -%}
        {%- set text = message['content'] -%}
    {%- else -%}
        {%- set ns = namespace(text='') -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' -%}
                {%- set ns.text = ns.text + '<image>' -%}
            {%- elif part['type'] == 'text' -%}
                {%- set ns.text = ns.text + part['text'] -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set text = ns.text -%}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- generation -%}{{- text + '<|eos|>' -}}{%- endgeneration -%}
    {%- else -%}
        {{- text + '<|eos|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""


def draw(colour: str, shape: str, size: int = 64) -> Any:
    """A coloured shape on white, size x size pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    lo, hi = size // 6, size - size // 6
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse((lo, lo, hi, hi), fill=fill)
    elif shape == "square":
        pen.rectangle((lo, lo, hi, hi), fill=fill)
    else:
        pen.polygon([(size // 2, lo), (hi, hi), (lo, hi)], fill=fill)
    return image


def conversations() -> list[dict[str, Any]]:
    """One row per (image, question): TRL's shape, the image path relative to the jsonl's folder."""
    rows = []
    for colour in COLOURS:
        for shape in SHAPES:
            for question in QUESTIONS:
                rows.append(
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "image"}, {"type": "text", "text": question}],
                            },
                            {
                                "role": "assistant",
                                "content": [{"type": "text", "text": f"a {colour} {shape}."}],
                            },
                        ],
                        "images": [f"images/{colour}-{shape}.png"],
                    }
                )
    return rows


def processor() -> Any:
    """The LLaVA processor of the tiny model: the bundled tokenizer + `<image>`, CLIP sizing at 56 px."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",  # CLIP's CLS token is dropped: 16 tokens, not 17
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def build(out: Path) -> None:
    (out / "images").mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        for shape in SHAPES:
            # optimize + no metadata: the PNG bytes depend on the pixels only.
            draw(colour, shape).save(out / "images" / f"{colour}-{shape}.png", optimize=True)
    with open(out / "captions.jsonl", "w", encoding="utf-8") as f:
        for row in conversations():
            f.write(json.dumps(row) + "\n")
    processor().save_pretrained(str(out / "processor"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny image-text assets of tiny-cpu-vlm.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    build(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
