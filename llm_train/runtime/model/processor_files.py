"""The files beside the weights that an image-text checkpoint needs to be used: its processor's.

An export or a checkpoint's hf/ holds the config and the tokenizer llm_train trained with; an image-text
model also needs what `AutoProcessor.from_pretrained` reads (the image processor's settings, the processor's
own, the chat template with its image placeholders). They are copied as the input checkpoint has them, byte
for byte: text-only training changes none of them, and rewriting them through a processor class could change
defaults between transformers versions. A file the destination already holds (the tokenizer's chat template,
or a processor a data pipeline saved) is left as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# What transformers 5.25's processors read beside the tokenizer (processing_utils / image_processing_base /
# video_processing_utils file names).
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def processor_sources(name_or_path: str | None, revision: str | None = None) -> list[Path]:
    """The processor files of a local checkpoint directory, or of a hub checkpoint in the local cache."""
    if not name_or_path:
        return []
    local = Path(name_or_path)
    if local.is_dir():
        return [local / name for name in PROCESSOR_FILES if (local / name).is_file()]
    from huggingface_hub import try_to_load_from_cache

    found = []
    for name in PROCESSOR_FILES:
        cached = try_to_load_from_cache(name_or_path, name, revision=revision)
        if isinstance(cached, str):
            found.append(Path(cached))
    return found


def model_processor_sources(
    name_or_path: str | None, revision: str | None, tokenizer: str | None
) -> list[Path]:
    """The input checkpoint's processor files; where it has none (model.init=random, as tiny-cpu-vlm), those
    beside model.tokenizer, the folder format image_chat loads the processor from (data/formats/image_chat.py),
    so an export can be given images as training was."""
    return processor_sources(name_or_path, revision) or (
        processor_sources(tokenizer) if tokenizer and tokenizer != name_or_path else []
    )


def copy_processor_files(sources: list[Path], out_dir: Path) -> list[str]:
    """Copy each source file into out_dir unless out_dir has one of that name; returns the names copied."""
    copied = []
    for source in sources:
        target = Path(out_dir) / source.name
        if not target.exists():
            shutil.copyfile(source, target)
            copied.append(source.name)
    return copied
