"""The parts of an image-text model (vision tower, projector, language model), and freezing them.

transformers names the parts per family (5.25): the vision tower is `vision_tower` (Gemma 3, LLaVA,
PaliGemma, Mistral 3), `vision_model` (Idefics3, SmolVLM, Llama 4, Mllama) or `visual` (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL); the projector that maps its features into the language model's embedding space is
`multi_modal_projector` or `connector` (Idefics3, SmolVLM), and in the Qwen-VL families it sits inside the
vision tower as `visual.merger` (plus Qwen3-VL's `deepstack_merger_list`), as LLaMA-Factory also treats it.
Everything else (embeddings, decoder layers, final norm, LM head) is the language model. No transformers
API names these parts for every family, hence the table; a family whose parts it misses is refused in one
line when a freeze names a part it cannot find, never trained with the wrong part frozen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from llm_train.config.recipe_sections import ModelPart
from llm_train.errors import UserError

if TYPE_CHECKING:
    import torch

VISION_TOWER_NAMES = frozenset({"vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder"})
PROJECTOR_NAMES = frozenset(
    {
        "multi_modal_projector",
        "connector",
        "mm_projector",
        "merger",
        "deepstack_merger_list",
        "vision_projection",
    }
)


# bitsandbytes leaves these unquantised (transformers' should_convert_module: a regex matched from the start of a
# module's name, ending at a module boundary): every module inside a vision tower or a projector.
QUANTIZATION_KEEP = (rf"(?:.*\.)?(?:{'|'.join(sorted(VISION_TOWER_NAMES | PROJECTOR_NAMES))})",)


def part_of(name: str) -> ModelPart:
    """The part a parameter (by its in-memory name) belongs to; the innermost named part wins (Qwen's merger)."""
    segments = name.split(".")
    for segment in reversed(segments[:-1]):
        if segment in PROJECTOR_NAMES:
            return "projector"
        if segment in VISION_TOWER_NAMES:
            return "vision_tower"
    return "language_model"


def parts(model: torch.nn.Module) -> dict[ModelPart, list[str]]:
    """{part: names of its parameters} for the parts this model has."""
    found: dict[ModelPart, list[str]] = {}
    for name, _ in model.named_parameters():
        found.setdefault(part_of(name), []).append(name)
    return found


def freeze(model: torch.nn.Module, frozen: Iterable[ModelPart], where: str = "model.freeze") -> list[str]:
    """Set requires_grad False on every parameter of the named parts (so neither the optimizer nor weight decay
    can move them); returns the frozen names. A part the model lacks is one line naming the parts it has."""
    found = parts(model)
    for part in frozen:
        if part not in found:
            raise UserError(
                f"{where}: {type(model).__name__} has no {part} that llm_train can find (its parts: "
                f"{', '.join(sorted(found))}); leave {part} out of {where}"
            )
    names = [name for part in frozen for name in found[part]]
    chosen = set(names)
    for name, param in model.named_parameters():
        if name in chosen:
            param.requires_grad_(False)
    return names


def linear_paths(model: torch.nn.Module, chosen: Iterable[ModelPart]) -> list[str]:
    """Full names of the linear layers inside the chosen parts: PEFT's `exclude_modules` keeps LoRA out of them."""
    wanted = set(chosen)
    return [
        path
        for path, module in model.named_modules()
        if path and type(module).__name__ == "Linear" and part_of(f"{path}.weight") in wanted
    ]
