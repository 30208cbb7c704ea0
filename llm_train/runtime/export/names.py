"""The tensor names an export writes: the ones save_pretrained gives a model built from its config.

transformers 5.x renames some families' weights between memory and disk (Gemma 3 holds its language
model as `model.language_model.*` and stores it as `language_model.model.*`, the hub checkpoints' layout;
GPT-NeoX's head is `embed_out` on disk) and converts others (MoE experts fused in memory, one by one on
disk). `save_pretrained` reverts the conversions the model was *loaded* with (`_weight_conversions`, set by
`from_pretrained`), which differ by how the model was built: under ZeRO-3's zero.Init load a Gemma 3 or
Qwen2.5-VL export came out with the prefix applied twice (`language_model.model.model.*`, measured with
transformers 5.25). So every writer here names tensors through one function, `checkpoint_names`, with the
mapping a model built from its config gets (the hub layout), and saves with `save_original_format=False`;
the key check (verify.py) derives the expected names the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def checkpoint_names(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (in-memory names) under the names and in the layout save_pretrained writes for a model
    built from its config. The function is save_pretrained's own (not public API; see verify._saved_form)."""
    from transformers.core_model_loading import revert_weight_conversion

    loaded_with = model.__dict__.pop("_weight_conversions", None)
    try:
        return cast("dict[str, torch.Tensor]", revert_weight_conversion(model, dict(state_dict)))
    finally:
        if loaded_with is not None:
            model.__dict__["_weight_conversions"] = loaded_with


def renamer(model: PreTrainedModel) -> Any:
    """name -> the name `checkpoint_names` gives that one tensor, for writers that see one tensor at a time.

    A tensor that the mapping converts rather than renames (a fused MoE expert block) keeps its in-memory
    name: the key check accepts a directory that holds such a tensor whole in its in-memory form.
    """
    import torch

    def rename(name: str) -> str:
        probe = torch.empty(0)
        out = checkpoint_names(model, {name: probe})
        if len(out) == 1:
            ((new, tensor),) = out.items()
            if tensor is probe:
                return new
        return name

    return rename
