"""Images in conversations: the three shapes users bring, brought to the one the processor reads.

    TRL / the_cauldron    content parts `{"type": "image"}` (the image itself in the part, or the next
                          one of the row's `images` column) and `{"type": "text", "text": ...}`
    LLaMA-Factory / LLaVA text content with `<image>` (the source's image_placeholder) for each image,
                          in order, from the `images` (or `image`) column; ShareGPT rows too
    OpenAI chat           parts `{"type": "image_url", "image_url": {"url": path | data URI}}`

`conversation_with_images` turns a row (already mapped onto roles by messages.py `map_messages`) into
messages whose content is a list of parts, each image part holding its PIL image: the shape
`ProcessorMixin.apply_chat_template` reads (transformers' own multimodal chat path). An image is a
file path (relative to the data file's folder), bytes, the hub's Image feature (`{"bytes", "path"}`,
or the PIL image `datasets` decodes it to), or a `data:image/...;base64,` URI; http(s) URLs are refused
while the hubs are off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), since fetching them would wait on a
network that is not there. Every refusal is one line naming the row and the image.
"""

from __future__ import annotations

import base64
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.errors import UserError, first_line

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True)
class ImageSizing:
    """Pixel bounds applied to every image before the processor sees it (data.image_max_pixels / min_pixels).

    Applied by us rather than through the processor's own keys because those differ per family (Qwen-VL's
    `max_pixels`, Pixtral's `longest_edge`, CLIP's fixed crop): a bound on width x height, aspect kept, is
    LLaMA-Factory's `image_max_pixels` and means the same for all of them.
    """

    max_pixels: int | None = None
    min_pixels: int | None = None

    def apply(self, image: Image) -> Image:
        w, h = image.size
        factor = 1.0
        if self.max_pixels is not None and w * h > self.max_pixels:
            factor = math.sqrt(self.max_pixels / (w * h))
        elif self.min_pixels is not None and w * h < self.min_pixels:
            factor = math.sqrt(self.min_pixels / (w * h))
        if factor == 1.0:
            return image
        return image.resize((max(1, int(w * factor)), max(1, int(h * factor))))


def offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def read_image(value: Any, where: str, base_dir: Path | None) -> Image:
    """One image, RGB, from any of the forms above; `where` names the row (and image) in errors."""
    from PIL import Image as PILImage

    if isinstance(value, PILImage.Image):
        return value.convert("RGB")
    name, data = _image_bytes(value, where, base_dir)
    try:
        image = PILImage.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # PIL raises several types for unreadable files
        raise UserError(
            f"{where}: {name} is not a readable image ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    return image.convert("RGB")


def _image_bytes(value: Any, where: str, base_dir: Path | None) -> tuple[str, bytes]:
    """(a name for errors, the encoded image)."""
    if isinstance(value, dict):  # the hub's Image feature, undecoded: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return f"image bytes ({value.get('path') or 'no path'})", bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return "image bytes", bytes(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: expected an image path, bytes or data URI (got {type(value).__name__})")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise UserError(f"{where}: data URI '{head[:40]}' is not base64; write data:image/png;base64,...")
        try:
            return "the data URI", base64.b64decode(payload, validate=True)
        except ValueError:
            raise UserError(f"{where}: the data URI's base64 payload is corrupt") from None
    if value.startswith(("http://", "https://")):
        if offline():
            raise UserError(
                f"{where}: image URL {value[:80]} cannot be fetched offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE "
                "is set); download the images and give their paths"
            )
        import urllib.request

        try:
            with urllib.request.urlopen(value, timeout=30) as response:  # noqa: S310 (http(s) only, checked above)
                return value, response.read()
        except OSError as exc:
            raise UserError(
                f"{where}: image URL {value[:80]} could not be fetched ({first_line(exc)})"
            ) from None
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise UserError(f"{where}: image file not found: {path}")
    return str(path), path.read_bytes()


def conversation_with_images(
    messages: list[dict[str, Any]],
    column: Any,
    placeholder: str,
    where: str,
    base_dir: Path | None,
    sizing: ImageSizing,
) -> tuple[list[dict[str, Any]], int]:
    """(messages with list-of-parts content and PIL images in the image parts, number of images).

    Images named without their data (a placeholder, a bare `{"type": "image"}` part) take the next one of
    `column`, in order; a row whose column has more or fewer images than that is refused.
    """
    images = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    next_image = 0

    def from_column(what: str) -> Image:
        nonlocal next_image
        if next_image >= len(images):
            raise UserError(
                f"{where}: the conversation has more images ({what}) than the row's images column holds "
                f'({len(images)}); give one image per {placeholder!r} or {{"type": "image"}} part'
            )
        n = next_image
        next_image += 1
        return sizing.apply(read_image(images[n], f"{where}: image {n + 1}", base_dir))

    count = 0
    out = []
    for m, message in enumerate(messages):
        parts: list[dict[str, Any]] = []
        content = message.get("content")
        if isinstance(content, str) or content is None:
            pieces = (content or "").split(placeholder)
            for k, piece in enumerate(pieces):
                if k:
                    parts.append({"type": "image", "image": from_column(f"{placeholder!r} in message {m}")})
                    count += 1
                if piece:
                    parts.append({"type": "text", "text": piece})
        elif isinstance(content, list):
            for part in content:
                # Arrow gives every part every key seen in the file (None where absent).
                part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                    continue
                if kind == "image":
                    inline = part.get("image", part.get("path", part.get("url")))
                    image = (
                        sizing.apply(read_image(inline, f"{where}: message {m}'s image", base_dir))
                        if inline is not None
                        else from_column(f"an image part in message {m}")
                    )
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    image = sizing.apply(read_image(url, f"{where}: message {m}'s image_url", base_dir))
                else:
                    raise UserError(
                        f"{where}: message {m} has a content part of type {kind!r}; image_chat reads text, image "
                        "and image_url parts"
                    )
                parts.append({"type": "image", "image": image})
                count += 1
        else:
            raise UserError(
                f"{where}: message {m}'s content is {type(content).__name__}; write text or a list of parts"
            )
        out.append({**message, "content": parts})
    if next_image < len(images):
        raise UserError(
            f"{where}: the row's images column holds {len(images)} images and the conversation names "
            f'{next_image}; give one {placeholder!r} or {{"type": "image"}} part per image'
        )
    return out, count
