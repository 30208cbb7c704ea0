"""The published `config.json` fields of common public checkpoints, so shapes are known offline.

Dry runs, `llm-train plan` and recipe resolution need a model's shape before any weights
exist, on machines that may not reach the Hugging Face Hub (planning/model/shapes.py counts its
parameters from these fields).
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE_SCALING_8X = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA32_ROPE_SCALING_32X = {**_LLAMA3_ROPE_SCALING_8X, "factor": 32.0}


def _llama(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    max_pos: int,
    rope_theta: float,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    return cfg


def _qwen25(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    max_pos: int,
    rms_eps: float,
    tie: bool,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": rms_eps,
        "rope_theta": 1000000.0,
        # Informational: HF's Qwen2 always puts biases on q/k/v (not on o), whatever this says.
        "attention_bias": True,
        "use_sliding_window": False,
    }


def _gemma3(
    hidden: int, layers: int, heads: int, kv_heads: int, inter: int, head_dim: int, query_scalar: int
) -> dict[str, Any]:
    """A Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration): the hub's config.json, nested as
    transformers writes it, with the text fields the hub file leaves to Gemma3TextConfig's defaults spelled
    out (vocab 262208, tied embeddings). Every size shares the SigLIP tower at 896 x 896 and 256 image tokens."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": inter,
            "head_dim": head_dim,
            "vocab_size": 262208,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "query_pre_attn_scalar": query_scalar,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 896,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }


# Qwen/Qwen2.5-VL-7B-Instruct's config.json (hub, flat: the text fields at the top, vision_config nested):
# Qwen2.5-7B's decoder (152064 tokens, untied) and a 32-block 1280-wide vision transformer whose merger maps
# 2 x 2 patches of 14 pixels to one 3584-wide token. 8,292,166,656 parameters (the hub's safetensors total).
_QWEN25_VL_7B: dict[str, Any] = {
    **_qwen25(3584, 28, 28, 4, 18944, 152064, 128000, 1e-6, tie=False),
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
}
del _QWEN25_VL_7B["attention_bias"], _QWEN25_VL_7B["use_sliding_window"]


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _llama(4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    "meta-llama/Llama-2-13b-hf": _llama(5120, 40, 40, 40, 13824, 32000, 4096, 10000.0),
    "meta-llama/Llama-2-70b-hf": _llama(8192, 80, 64, 8, 28672, 32000, 4096, 10000.0),
    "meta-llama/Meta-Llama-3-8B": _llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
    "meta-llama/Meta-Llama-3-70B": _llama(8192, 80, 64, 8, 28672, 128256, 8192, 500000.0),
    "meta-llama/Llama-3.1-8B": _llama(
        4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, rope_scaling=_LLAMA3_ROPE_SCALING_8X
    ),
    # Tulu 3's SFT stage of Llama-3.1-8B (the checkpoint its DPO starts from): 8 added tokens, chat template.
    "allenai/Llama-3.1-Tulu-3-8B-SFT": _llama(
        4096, 32, 32, 8, 14336, 128264, 131072, 500000.0, rope_scaling=_LLAMA3_ROPE_SCALING_8X
    ),
    "meta-llama/Llama-3.1-70B": _llama(
        8192, 80, 64, 8, 28672, 128256, 131072, 500000.0, rope_scaling=_LLAMA3_ROPE_SCALING_8X
    ),
    "meta-llama/Llama-3.2-1B": _llama(
        2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, tie=True, rope_scaling=_LLAMA32_ROPE_SCALING_32X
    ),
    "meta-llama/Llama-3.2-3B": _llama(
        3072, 28, 24, 8, 8192, 128256, 131072, 500000.0, tie=True, rope_scaling=_LLAMA32_ROPE_SCALING_32X
    ),
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
    "Qwen/Qwen2.5-0.5B": _qwen25(896, 24, 14, 2, 4864, 151936, 32768, 1e-6, tie=True),
    "Qwen/Qwen2.5-1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, 131072, 1e-6, tie=True),
    "Qwen/Qwen2.5-3B": _qwen25(2048, 36, 16, 2, 11008, 151936, 32768, 1e-6, tie=True),
    "Qwen/Qwen2.5-7B": _qwen25(3584, 28, 28, 4, 18944, 152064, 131072, 1e-6, tie=False),
    "Qwen/Qwen2.5-14B": _qwen25(5120, 48, 40, 8, 13824, 152064, 131072, 1e-5, tie=False),
    "Qwen/Qwen2.5-32B": _qwen25(5120, 64, 40, 8, 27648, 152064, 131072, 1e-5, tie=False),
    "Qwen/Qwen2.5-72B": _qwen25(8192, 80, 64, 8, 29568, 152064, 131072, 1e-5, tie=False),
    # Image-text checkpoints (issue 50's GPU recipes). Their config.json values as published on the hub
    # (huggingface.co/<id>/blob/main/config.json); the Gemma 3 text fields the hub file omits are
    # Gemma3TextConfig's defaults. Parameter totals (tests/unit/test_shapes.py): the hub's safetensors metadata.
    "Qwen/Qwen2.5-VL-7B-Instruct": _QWEN25_VL_7B,
    "google/gemma-3-12b-it": _gemma3(3840, 48, 16, 8, 15360, 256, 256),
    "google/gemma-3-27b-it": _gemma3(5376, 62, 32, 16, 21504, 128, 168),
}

# The image processors' published pixel limits of the known image-text ids (preprocessor_config.json on the
# hub), where they differ from the processor class's own: what data.image_min_pixels / image_max_pixels
# default to for those ids. Qwen2.5-VL-7B-Instruct lets an image through at up to 12.8M pixels (16384 tokens).
KNOWN_PROCESSOR_PIXELS: dict[str, tuple[int, int]] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": (3136, 12845056),
}

# Keys shape_from_config cannot do without (num_key_value_heads and
# tie_word_embeddings have HF defaults and are optional).
