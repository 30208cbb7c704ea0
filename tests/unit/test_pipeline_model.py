"""The pipeline layers (llm_train/runtime/engines/pipeline_model.py) compute exactly what the HF model computes.

No DeepSpeed world is needed: the layer list is run in order in one process and compared
with the plain HF model on packed rows (restarting position ids), for each supported
architecture, tied and untied embeddings, SDPA and eager attention, and a sliding window.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llm_train.runtime.engines.pipeline_engine import as_pipeline_batch
from llm_train.runtime.engines.pipeline_model import attention_mask, layer_specs, tied_head
from llm_train.runtime.loss.language_modeling import causal_lm_loss
from llm_train.runtime.model.pipeline_names import LayerMap

SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _hf_model(model_type: str, attn: str, **extra: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL, **extra)
    config._attn_implementation = attn
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _run_layers(model: Any, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Build every pipeline layer from its spec, load the HF weights by name, run them in order."""
    config = model.config
    names = LayerMap(config.num_hidden_layers, bool(config.tie_word_embeddings))
    specs = layer_specs(config)
    layers = [spec.build() for spec in specs]
    if names.tied:
        layers[-1] = layers[0]  # one module, two uses: what TiedLayerSpec does across stages
    for hf_name, tensor in model.state_dict().items():
        pipe_name = names.to_pipe(hf_name)
        if pipe_name is None:
            continue
        assert names.to_hf(pipe_name) == hf_name
        owner, _, local = pipe_name.partition(".")
        index = 0 if owner == "tied_modules" else int(owner)
        if owner == "tied_modules":
            local = local.split(".", 1)[1]
        layers[index].state_dict()[local].copy_(tensor)
    x: Any = inputs
    with torch.no_grad():
        for i, layer in enumerate(layers):
            x = tied_head(layer, x) if names.tied and i == len(layers) - 1 else layer(x)
    return x


def _packed_batch(seq: int = 24) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, SMALL["vocab_size"], (2, seq))
    # Row 0: three samples packed (positions restart); row 1: one sample filling the row.
    positions = torch.cat([torch.arange(10), torch.arange(9), torch.arange(5)]).unsqueeze(0)
    positions = torch.cat([positions, torch.arange(seq).unsqueeze(0)])
    labels = ids.clone()
    labels[0, [0, 10, 19]] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


@pytest.mark.parametrize(
    ("model_type", "attn", "extra"),
    [
        ("llama", "sdpa", {}),
        ("llama", "eager", {"tie_word_embeddings": True}),
        ("mistral", "sdpa", {"sliding_window": 6}),
        ("qwen2", "sdpa", {"tie_word_embeddings": True}),
        ("qwen2", "eager", {}),
    ],
)
def test_layers_equal_the_hf_model(model_type: str, attn: str, extra: dict[str, Any]) -> None:
    model = _hf_model(model_type, attn, **extra)
    batch = _packed_batch()
    with torch.no_grad():
        expected = model(**batch)
    inputs, labels = as_pipeline_batch(batch)
    logits = _run_layers(model, inputs)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert causal_lm_loss(logits, labels).item() == pytest.approx(expected.loss.item(), abs=1e-5)


def test_plain_positions_need_no_mask() -> None:
    positions = torch.arange(8).repeat(2, 1)
    assert attention_mask(positions, None, torch.float32, eager=False) is None
    assert attention_mask(positions, 16, torch.float32, eager=False) is None
    mask = attention_mask(positions, 4, torch.float32, eager=False)  # window shorter than the row
    assert mask is not None and mask.shape == (2, 1, 8, 8)
    allowed = mask[0, 0] == 0
    assert allowed[7].nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_batches_without_position_ids_get_contiguous_ones() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    (inputs, positions), labels = as_pipeline_batch({"input_ids": ids, "labels": ids})
    assert positions.tolist() == [list(range(5))] * 2 and positions.is_contiguous()


def test_layer_map_round_trips_every_name() -> None:
    untied, tied = LayerMap(4, tied=False), LayerMap(4, tied=True)
    assert untied.to_pipe("model.embed_tokens.weight") == "0.embed_tokens.weight"
    assert tied.to_pipe("model.embed_tokens.weight") == "tied_modules.embed.embed_tokens.weight"
    assert untied.to_pipe("model.layers.3.mlp.up_proj.weight") == "4.layer.mlp.up_proj.weight"
    assert untied.to_pipe("model.norm.weight") == "5.norm.weight"
    assert untied.to_pipe("lm_head.weight") == "6.lm_head.weight"
    assert tied.to_pipe("lm_head.weight") is None
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        assert untied.to_hf(untied.to_pipe(name) or "") == name
        assert tied.to_hf(tied.to_pipe(name) or "") == name
    assert untied.to_hf("6.lm_head.weight") == "lm_head.weight"
