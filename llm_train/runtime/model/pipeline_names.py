"""A pipeline run's weight names: where each Hugging Face weight sits in the pipeline's layer list, and back.

The pipeline model (pipeline_model.py) is a flat list of layers (embedding, each decoder layer, the final
norm, the head or the tied embedding); DeepSpeed's checkpoint of it is one `layer_NN-model_states.pt` file
per layer, with the layer's own names. Loading a stage, exporting final/, and exporting a checkpoint
(runtime/export/from_checkpoint.py) all translate through `LayerMap`; this module holds it so the export reads a pipeline
checkpoint without importing the pipeline's model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

TIED_KEY = "embed"  # DeepSpeed's key of the tied embedding (TiedLayerSpec), in the checkpoint's names


@dataclass(frozen=True)
class LayerMap:
    """Where each HF weight lives in the pipeline's layer list (and back)."""

    num_layers: int
    tied: bool

    @property
    def norm_idx(self) -> int:
        return self.num_layers + 1

    def to_pipe(self, hf_name: str) -> str | None:
        if hf_name.startswith("model.embed_tokens."):
            owner = f"tied_modules.{TIED_KEY}" if self.tied else "0"
            return f"{owner}.{hf_name.removeprefix('model.')}"
        if hf_name.startswith("model.layers."):
            idx, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            return f"{1 + int(idx)}.layer.{rest}"
        if hf_name.startswith("model.norm."):
            return f"{self.norm_idx}.{hf_name.removeprefix('model.')}"
        if hf_name.startswith("lm_head."):
            return None if self.tied else f"{self.norm_idx + 1}.{hf_name}"
        return None

    def to_hf(self, pipe_name: str) -> str | None:
        head, _, rest = pipe_name.partition(".")
        if head == "tied_modules":
            return "model." + rest.split(".", 1)[1]
        if not head.isdigit():
            return None
        idx = int(head)
        if idx == 0:
            return f"model.{rest}"
        if idx <= self.num_layers:
            return f"model.layers.{idx - 1}.{rest.removeprefix('layer.')}"
        if idx == self.norm_idx:
            return f"model.{rest}"
        return rest  # lm_head.weight


def pipeline_checkpoint_state_dict(ds_dir: Path, hf_dir: Path) -> dict[str, torch.Tensor] | None:
    """HF-named fp32 weights from the layer files of a pipeline engine checkpoint; None for other checkpoints.

    PipelineModule.save_state_dict writes one `layer_NN-model_states.pt` per layer (a plain
    state dict of tensors, loaded with weights_only); a tied embedding is saved once, by its
    first stage. The caller verifies the checkpoint's manifest before anything is read.
    """
    files = sorted(ds_dir.glob("layer_*-model_states.pt"))
    if not files:
        return None
    config = json.loads((hf_dir / "config.json").read_text())
    names = LayerMap(int(config["num_hidden_layers"]), bool(config.get("tie_word_embeddings", False)))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        index = int(file.name.split("-", 1)[0].removeprefix("layer_"))
        for key, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
            hf_name = names.to_hf(f"{index}.{key}")
            if hf_name is not None:
                out[hf_name] = tensor.float()
    return out
