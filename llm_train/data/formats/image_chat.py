"""`format: image_chat`: conversations with images, for image-text models; loss on assistant tokens only.

How images flow, one path from the file to the model's forward:

    rows (3 shapes)  -> images.py: messages with PIL images in their parts (sized by the pixel bounds)
                     -> the model's processor (AutoProcessor from the model folder), through its
                        `apply_chat_template(..., return_assistant_tokens_mask=True)`: token ids with each
                        image's tokens expanded, pixel values (and grid sizes etc.), the assistant mask
                     -> store.py: ids and loss mask as for every format; the processor's other outputs as
                        one `.npz` blob per row (arrays.bin), cached with the tokens
                     -> model_inputs.py: a micro-batch of padded rows plus those arrays, concatenated
                        over its rows in row order (the order the processor's model reads images in)
                     -> the model's forward (`model(**batch)`): pixel_values & co. go in with input_ids.

The processor runs once, at preparation, so the cache holds exactly what the model reads (resumes and
every rank see the same pixels) and the sequence length, image tokens included, is known before the
first step. Image tokens are never trained on: the template marks assistant text only, and the mask is
cleared again on the image token ids in case a template puts an image inside an assistant turn.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llm_train.config.source_schema import ImageChatSource
from llm_train.data.formats.base import Batch, Format, TokenizeFn
from llm_train.data.formats.images import ImageSizing, conversation_with_images
from llm_train.data.formats.messages import ChatMapping, map_messages
from llm_train.errors import UserError, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

# What the processor returns that the store already holds (ids, mask) or the batch builds (attention).
_TOKEN_KEYS = ("input_ids", "attention_mask", "assistant_masks")


class ImageChat(Format[ImageChatSource]):
    source_class = ImageChatSource
    uses_chat_template = "always"
    looks_like = frozenset({"messages", "images"})
    field_keys = "messages_field / images_field"
    arrays = True
    overlong_fix = (
        "its image tokens count too, and an image row is never cut; shrink its images (data.image_max_pixels), "
        "set overlong: drop on this source, or raise data.seq_len",
    )

    def required_fields(self, source: ImageChatSource) -> list[str]:
        return [source.messages_field]

    def optional_fields(self, source: ImageChatSource) -> list[str]:
        return [source.images_field, "image"] + ([source.system_field] if source.system_field else [])

    def tokenize_fn(
        self,
        source: ImageChatSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
        memo_words: bool = True,
    ) -> TokenizeFn:
        processor = load_processor(tokenizer, key)
        return image_chat_fn(source, processor, chat_template, key)

    def cache_key(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        """The processor's settings (image size, tokens per image): a change re-processes the source."""
        import hashlib

        folder = Path(str(tokenizer.name_or_path))
        names = (
            "preprocessor_config.json",
            "processor_config.json",
            "chat_template.jinja",
            "chat_template.json",
        )
        return [
            hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names if (folder / n).is_file()
        ]

    def filler(
        self,
        source: ImageChatSource,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None,
        key: str,
    ) -> bytes | None:
        return filler_row(load_processor(tokenizer, key), chat_template)

    def mapping_lines(
        self, source: ImageChatSource, key: str, first_row: Callable[[], tuple[dict[str, Any], str]]
    ) -> list[str]:
        first, where = first_row()
        images = first.get(source.images_field, first.get("image"))
        count = len(images) if isinstance(images, list) else int(images is not None)
        return [
            f"{key} {source.path} (image_chat, preset {source.preset}): {source.messages_field}[] with "
            f"{source.image_placeholder!r} / image parts, images from '{source.images_field}' ({count} in row 1)"
        ]


IMAGE_CHAT = ImageChat()


def load_processor(tokenizer: PreTrainedTokenizerBase, key: str) -> ProcessorMixin:
    """The model's processor, from the folder its tokenizer came from (an image-text checkpoint keeps both
    there), with that same tokenizer; a text-only model has no image processor and is refused."""
    from transformers import AutoProcessor

    where = tokenizer.name_or_path
    try:
        processor = AutoProcessor.from_pretrained(where, tokenizer=tokenizer)
    except Exception as exc:
        # transformers 5.25's Qwen-VL, SmolVLM, InternVL and GLM-4V processors carry a video processor that
        # needs torchvision, which llm_train does not install.
        fix = (
            "pip install torchvision (its processor needs it)"
            if "torchvision" in str(exc).lower()
            else "point model.tokenizer at the image-text model's folder"
        )
        raise UserError(
            f"{key}: format image_chat needs the model's processor and none loads from {where} "
            f"({first_line(exc)}); {fix}"
        ) from None
    if getattr(processor, "image_processor", None) is None:
        raise UserError(
            f"{key}: format image_chat gives images to a text-only model ({where} has no image processor); "
            "use an image-text model, or format chat for text-only rows"
        )
    return processor


def _base_dir(path: str) -> Path:
    """Where relative image paths start: the data folder, or the data file's (a glob's, before its wildcard)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    parts = local.parts
    wild = [i for i, part in enumerate(parts) if any(c in part for c in "*?[")]
    return Path(*parts[: wild[0]]) if wild else local.parent


def image_token_ids(processor: ProcessorMixin) -> set[int]:
    """The ids the processor expands images into (LLaVA's `<image>`, Qwen's `<|image_pad|>`, Gemma's begin and
    end of image too): transformers' `ProcessorMixin.image_token_ids` plus the begin/end markers it leaves out."""
    tokenizer: Any = processor.tokenizer
    ids = {i for i in processor.image_token_ids if isinstance(i, int)}
    for name in ("image_token", "boi_token", "eoi_token", "image_start_token", "image_end_token"):
        # Gemma 3's processor names its begin-of-image marker `image_token`; its tokenizer has the rest.
        token = getattr(processor, name, None) or getattr(tokenizer, name, None)
        if isinstance(token, str):
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                ids.add(tid)
    return ids


def filler_row(processor: ProcessorMixin, chat_template: str | None) -> bytes:
    """A user message of one blank 64 x 64 image, as the processor encodes it (ids and arrays, one blob).

    Under ZeRO-3 every rank must run the same modules: a rank whose micro-batch has no image would skip
    the vision tower while another gathers its weights, and the collectives no longer match (seen on CPU:
    gloo's "Received data size doesn't match expected size" at the first such step). LLaMA-Factory's answer,
    taken here: such a micro-batch gets this row, labels all -100, so the tower runs and the loss (a mean
    over labelled tokens) is unchanged.
    """
    from PIL import Image

    message: Any = {
        "role": "user",
        "content": [{"type": "image", "image": Image.new("RGB", (64, 64), "white")}],
    }
    template: Any = chat_template or processor.chat_template
    out: Any = processor.apply_chat_template(
        [[message]], chat_template=template, tokenize=True, return_dict=True, return_tensors="np"
    )
    arrays: dict[str, np.ndarray] = {
        k: np.asarray(v) for k, v in out.items() if k not in ("attention_mask", "assistant_masks")
    }
    arrays["input_ids"] = arrays["input_ids"][0].astype(np.int64)
    blob = io.BytesIO()
    np.savez(blob, **arrays)  # type: ignore[arg-type]  # numpy's stub reads a key as allow_pickle
    return blob.getvalue()


def image_chat_fn(
    source: ImageChatSource, processor: ProcessorMixin, chat_template: str | None, key: str
) -> TokenizeFn:
    mapping = ChatMapping.of(source)
    sizing = ImageSizing(source.max_pixels, source.min_pixels)
    base_dir = _base_dir(source.path)
    images_ids = np.array(sorted(image_token_ids(processor)), dtype=np.int64)
    template: Any = chat_template or processor.chat_template

    def one(row: int, conversation: Any, images: Any, system: Any) -> tuple[list[int], list[int], bytes]:
        where = f"{key}: row {row + 1}"
        messages = map_messages(conversation, row, key, mapping, system)
        messages, _ = conversation_with_images(
            messages, images, source.image_placeholder, where, base_dir, sizing
        )
        try:
            out: Any = processor.apply_chat_template(
                [messages],
                chat_template=template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                return_tensors="np",
            )
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"{where}: the processor failed on this conversation ({first_line(exc)})"
            ) from None
        ids = np.asarray(out["input_ids"])[0].astype(np.int64)
        mask = np.asarray(out["assistant_masks"])[0].astype(np.uint8)
        mask[np.isin(ids, images_ids)] = 0  # never trained on, wherever a template puts an image
        arrays: dict[str, np.ndarray] = {k: np.asarray(v) for k, v in out.items() if k not in _TOKEN_KEYS}
        blob = io.BytesIO()
        np.savez(blob, **arrays)  # type: ignore[arg-type]  # numpy's stub reads a key as allow_pickle
        return ids.tolist(), mask.tolist(), blob.getvalue()

    def tokenize(batch: Batch, indices: list[int]) -> Batch:
        images = batch.get(source.images_field, batch.get("image"))
        systems = batch.get(source.system_field) if source.system_field else None
        out: Batch = {"input_ids": [], "loss_mask": [], "arrays": []}
        for n, (conversation, row) in enumerate(zip(batch[source.messages_field], indices, strict=True)):
            ids, mask, blob = one(
                row,
                conversation,
                images[n] if images is not None else None,
                systems[n] if systems is not None else None,
            )
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["arrays"].append(blob)
        return out

    return tokenize
