"""Tiny random image-text checkpoints of every family the tests train: hidden 32-64, 1-2 layers, a tiny vision tower.

Each is saved with `save_pretrained` as a hub checkpoint is laid out, with the bundled tokenizer (vocabulary
4096): the text vocabulary is 4104 so the image and special tokens the configs name (4096-4103) are never
produced from the training text, where a stray image token would ask for image features the row has not got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 4104
IMAGE, BOI, EOI, VIDEO, VISION_START, VISION_END = 4096, 4097, 4098, 4099, 4100, 4101

_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def _llama_text(**extra: Any) -> dict[str, Any]:
    return {"model_type": "llama", **_TEXT, **extra}


def family_configs() -> dict[str, dict[str, Any]]:
    """model_type -> the keyword arguments of its config class (AutoConfig.for_model)."""
    siglip = {"model_type": "siglip_vision_model", **_VISION, "image_size": 28, "patch_size": 14}
    return {
        "gemma3": {
            "text_config": {**_TEXT, "sliding_window": 16},
            "vision_config": siglip,
            "mm_tokens_per_image": 4,
            "image_token_index": IMAGE,
            "boi_token_index": BOI,
            "eoi_token_index": EOI,
        },
        "qwen2_5_vl": {
            "text_config": {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            "vision_config": {
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 32,
                "fullatt_block_indexes": [0],
            },
            "image_token_id": IMAGE,
            "video_token_id": VIDEO,
            "vision_start_token_id": VISION_START,
            "vision_end_token_id": VISION_END,
        },
        "qwen3_vl": {
            "text_config": {**_TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
            "vision_config": {
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 32,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0],
            },
            "image_token_id": IMAGE,
            "video_token_id": VIDEO,
            "vision_start_token_id": VISION_START,
            "vision_end_token_id": VISION_END,
        },
        "mistral3": {
            "text_config": {"model_type": "mistral", **_TEXT},
            "vision_config": {
                "model_type": "pixtral",
                **_VISION,
                "head_dim": 16,
                "image_size": 28,
                "patch_size": 14,
            },
            "image_token_index": IMAGE,
            "spatial_merge_size": 1,
        },
        "idefics3": {
            "text_config": _llama_text(),
            "vision_config": {**_VISION, "image_size": 28, "patch_size": 14},
            "image_token_id": IMAGE,
            "scale_factor": 1,
        },
        "smolvlm": {
            "text_config": _llama_text(),
            "vision_config": {**_VISION, "image_size": 28, "patch_size": 14},
            "image_token_id": IMAGE,
            "scale_factor": 1,
        },
        "llava": {
            "text_config": _llama_text(),
            "vision_config": {
                "model_type": "clip_vision_model",
                **_VISION,
                "image_size": 28,
                "patch_size": 14,
                "projection_dim": 32,
            },
            "image_token_index": IMAGE,
        },
        "paligemma": {
            "text_config": {"model_type": "gemma", **_TEXT},
            "vision_config": {**siglip, "projection_dim": 32},
            "image_token_index": IMAGE,
            "projection_dim": 32,
        },
        "qwen2_vl": {
            "text_config": {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2},
            "image_token_id": IMAGE,
            "video_token_id": VIDEO,
            "vision_start_token_id": VISION_START,
            "vision_end_token_id": VISION_END,
        },
        # Mllama's language model attends to the image through cross-attention layers (layer 1 of 2 here).
        "mllama": {
            "text_config": {**_TEXT, "num_hidden_layers": 2, "cross_attention_layers": [1]},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_global_layers": 1,
                "attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
                "vision_output_dim": 64,
                "intermediate_layers_indices": [0],
            },
            "image_token_index": IMAGE,
        },
        "internvl": {
            "text_config": {"model_type": "qwen2", **_TEXT},
            "vision_config": {**_VISION, "image_size": 28, "patch_size": 14},
            "image_token_id": IMAGE,
            "downsample_ratio": 0.5,
        },
        "aya_vision": {
            "text_config": {"model_type": "cohere2", **_TEXT},
            "vision_config": {
                "model_type": "siglip_vision_model",
                **_VISION,
                "image_size": 28,
                "patch_size": 14,
            },
            "image_token_index": IMAGE,
            "downsample_factor": 1,
        },
        "llama4": {
            "text_config": {
                **_TEXT,
                "intermediate_size_mlp": 64,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 1,
                "no_rope_layers": [1],
                "attention_chunk_size": 64,
            },
            "vision_config": {
                **_VISION,
                "image_size": 28,
                "patch_size": 14,
                "vision_output_dim": 32,
                "projector_input_dim": 32,
                "projector_output_dim": 32,
                "intermediate_layers_indices": [0],
            },
            "image_token_index": IMAGE,
            "boi_token_index": BOI,
            "eoi_token_index": EOI,
        },
    }


def build_checkpoint(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random tiny `model_type` image-text model saved to `out` with the tokenizer, as a hub checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.for_model(model_type, **family_configs()[model_type])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
