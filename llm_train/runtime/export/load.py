"""Load an export as a user loads it: the Auto class its config names, transformers' load report quiet,
a greedy sample of its text. The check (verify.py) and the export from a checkpoint (from_checkpoint.py) load
through it, so they load what a user gets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from llm_train.errors import ExportError
from llm_train.runtime.model.model import model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def auto_class(config: PretrainedConfig) -> Any:
    """The transformers Auto class a user loads an export with: AutoModelForSequenceClassification for a reward
    model (its config's architectures name a *ForSequenceClassification, as save_pretrained writes them),
    else AutoModelForCausalLM. Every check (verify.py) builds and loads through it, so a reward model's export is
    verified the same way: keys, then its scores on the fixed batch against the run's."""
    names = getattr(config, "architectures", None) or []
    if any(name.endswith("ForSequenceClassification") for name in names):
        return model_class(config, "score")
    return model_class(config)  # AutoModelForImageTextToText for an image-text export (model.py says why)


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers prints a load report table for missing keys; the check says it in one line instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def sample_text(model_dir: Path, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation of `prompt` by the exported model, loaded the way a user would."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = auto_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**inputs).logits
        if not torch.isfinite(logits).all():
            raise ExportError(f"export {model_dir}: the exported model gives non-finite logits")
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    # One sequence decodes to one str (the annotation also covers a batch's list).
    return cast(str, tokenizer.decode(out[0], skip_special_tokens=True))
