"""The published `config.json` fields of common public checkpoints, so shapes are known offline.

Dry runs, `llm-train plan` and recipe resolution need a model's shape before any weights
exist, on machines that may not reach the Hugging Face Hub (planning/shapes.py counts its
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
}

# Keys shape_from_config cannot do without (num_key_value_heads and
# tie_word_embeddings have HF defaults and are optional).
