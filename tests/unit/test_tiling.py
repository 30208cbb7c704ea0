"""The ALST memory switches: tiled MLP and checkpoint offload give the untiled model's losses and gradients
(the tiled loss: tests/unit/test_chunked_loss.py, with the same model and tolerance).

A 2-layer fp32 Llama with hidden 32 and sequences of 256 tokens: the MLP runs in
ceil(256 / 32) = 8 tiles. The only difference from the untiled model is then the order in which fp32 sums are
taken (a weight gradient is a sum over the tokens; here it is summed per tile, then over tiles):
observed differences are ~1e-9 on gradients of magnitude ~1e-2 and ~1e-6 on a loss of ~5.5
(fp32 relative rounding, 6e-8, times a few hundred terms), so 1e-5 absolute is two orders
above the noise yet far below any real mistake (a dropped tile, a wrong mask or a wrong
scale moves them by 1e-3 or more). Offload moves tensors without changing any arithmetic:
equal within 1e-6 (observed bitwise equal).
"""

from __future__ import annotations

import copy
import gc
import math
import weakref
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from llm_train.config.recipe_sections import LoraSection, MemorySection, ModelSection
from llm_train.errors import UserError
from llm_train.runtime.model.lora import apply_lora
from llm_train.runtime.model.model import build_model
from llm_train.runtime.model.tiling import enable_checkpoint_offload, enable_tiled_mlp
from tests.helpers import tiny_llama_config
from tests.optional import require

HIDDEN, SEQ, VOCAB, LAYERS = 32, 256, 256, 2
TILES = 8
TOL = 1e-5

Grads = dict[str, torch.Tensor]


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    config = tiny_llama_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def batch(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[:, :40] = -100  # a prompt that is not trained on
    labels[0, 100:130] = -100
    return input_ids, labels


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """What the sequence-parallel path passes: label t+1 at position t, -100 past the end."""
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()


def loss_and_grads(model: Any, seed: int = 0, scale: float = 1.0, **inputs: Any) -> tuple[float, Grads]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    (loss * scale).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def assert_same(reference: tuple[float, Grads], other: tuple[float, Grads], tol: float = TOL) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    assert loss_b == pytest.approx(loss_a, abs=tol)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).abs().max().item() <= tol, name
    assert max(g.abs().max().item() for g in grads_a.values()) > 100 * tol  # the bound is not vacuous


def lora_of(model: torch.nn.Module, lora: LoraSection) -> Any:
    torch.manual_seed(0)  # the adapters' initial weights come from the global RNG
    return apply_lora(model, lora)


def calls_of(module: torch.nn.Module) -> list[int]:
    """Tokens of every call of `module` (rows x positions), recorded by a forward hook."""
    tokens: list[int] = []
    module.register_forward_hook(lambda mod, args, out: tokens.append(out.shape[:-1].numel()))
    return tokens


def readiness_of(param: torch.nn.Parameter) -> list[bool]:
    """`ds_grad_is_ready` each time a gradient is accumulated into `param` (what ZeRO's hook reads)."""
    seen: list[bool] = []
    param.register_post_accumulate_grad_hook(lambda p: seen.append(getattr(p, "ds_grad_is_ready", True)))
    return seen


# --- tiled MLP -----------------------------------------------------------------------------------


def test_tiled_mlp_runs_each_mlp_in_seq_over_hidden_tiles_with_the_same_loss_and_gradients() -> None:
    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    assert enable_tiled_mlp(tiled) == LAYERS
    input_ids, labels = batch()
    down = tiled.model.layers[0].mlp.down_proj
    tokens, ready = calls_of(down), readiness_of(down.weight)
    reference = loss_and_grads(plain, input_ids=input_ids, labels=labels)
    result = loss_and_grads(tiled, input_ids=input_ids, labels=labels)
    assert_same(reference, result)
    # 8 tiles of 2 x 256 / 8 tokens in forward, recomputed one by one in backward.
    assert tokens == [2 * SEQ // TILES] * (2 * TILES)
    # ZeRO reduces the weight's gradient once, after its last tile.
    assert ready == [False] * (TILES - 1) + [True]


def test_tiled_mlp_leaves_short_inputs_untiled_and_eval_unchanged() -> None:
    plain = tiny_llama().eval()
    tiled = copy.deepcopy(plain)
    enable_tiled_mlp(tiled)
    tokens = calls_of(tiled.model.layers[0].mlp.down_proj)
    input_ids, _ = batch()
    with torch.no_grad():
        assert torch.allclose(tiled(input_ids=input_ids).logits, plain(input_ids=input_ids).logits, atol=TOL)
        tiled(input_ids=input_ids[:, :HIDDEN])  # one tile's worth: called once, as before
    assert tokens == [2 * SEQ // TILES] * TILES + [2 * HIDDEN]


def test_tiled_mlp_refuses_a_model_without_dense_mlps_in_one_line() -> None:
    with pytest.raises(UserError, match=r"^memory\.tiled_mlp: Sequential has no dense decoder MLP") as err:
        enable_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert "\n" not in str(err.value)


def _same_tiles_without_recompute(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Reference: the tiles TiledMLP cuts (flattened tokens, ceil(seq/hidden) chunks), plain autograd."""
    flat = x.reshape(1, -1, x.shape[-1])
    pieces = flat.chunk(math.ceil(x.shape[-2] / x.shape[-1]), dim=-2)
    return torch.cat([type(self).forward(self, piece) for piece in pieces], dim=-2).reshape(x.shape)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_tiled_mlp_under_lora_applied_afterwards_differentiates_the_loss_it_computed(dropout: float) -> None:
    require("peft")
    lora = LoraSection(rank=4, alpha=8, dropout=dropout)
    base = tiny_llama()
    reference = copy.deepcopy(base)
    for name, module in reference.named_modules():
        if name.endswith(".mlp"):
            module.forward = _same_tiles_without_recompute.__get__(module)
    tiled = copy.deepcopy(base)
    enable_tiled_mlp(tiled)
    input_ids, labels = batch()
    # Backward recomputes each tile: with LoRA dropout inside the MLP it must draw the masks the
    # forward drew, or the gradient belongs to another function than the loss.
    expected = loss_and_grads(lora_of(reference, lora), input_ids=input_ids, labels=labels)
    result = loss_and_grads(lora_of(tiled, lora), input_ids=input_ids, labels=labels)
    assert_same(expected, result)
    assert any("lora_A" in name for name in result[1]) and not any("embed" in name for name in result[1])


# --- checkpoint offload --------------------------------------------------------------------------


def checkpointed(model: LlamaForCausalLM) -> LlamaForCausalLM:
    # As runtime/model/model.py configures it.
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def layer_inputs_alive_after_forward(model: Any, **inputs: Any) -> tuple[list[bool], float, Grads]:
    """(for each layer: is its input still alive once the forward has returned?, loss, grads)."""
    inputs_seen: list[weakref.ref] = []
    plain = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT
    handles = [
        layer.register_forward_pre_hook(lambda mod, args: inputs_seen.append(weakref.ref(args[0])))
        for layer in plain.model.layers
    ]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(**inputs).loss
    gc.collect()
    alive = [ref() is not None for ref in inputs_seen]
    assert len(inputs_seen) == LAYERS
    loss.backward()
    for handle in handles:
        handle.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return alive, loss.item(), grads


@pytest.mark.parametrize("lora", [False, True])
def test_checkpoint_offload_moves_every_layer_input_off_the_device_with_the_same_gradients(
    lora: bool,
) -> None:
    base = checkpointed(tiny_llama())
    offloaded = copy.deepcopy(base)
    # pin_memory=True forces a real host copy even here: save_on_cpu copies into a fresh buffer
    # (pinned only where CUDA exists). Without pinning, a CPU tensor is "moved" to itself.
    assert enable_checkpoint_offload(offloaded, pin_memory=True) == LAYERS
    if lora:  # frozen embeddings: the layer inputs do not require grad
        section = LoraSection(rank=4, alpha=8, dropout=0.1)
        base, offloaded = lora_of(base, section), lora_of(offloaded, section)
    input_ids, labels = batch()
    kept, *reference = layer_inputs_alive_after_forward(base, input_ids=input_ids, labels=labels)
    moved, *result = layer_inputs_alive_after_forward(offloaded, input_ids=input_ids, labels=labels)
    # Checkpointing keeps each layer's input until backward; offloaded, only host copies remain.
    # Under LoRA the embeddings are frozen, and transformers and PEFT make the embedding output a
    # leaf that requires grad (for reentrant checkpointing): its gradient accumulator holds it, so
    # the first layer's input stays on the device (1 of L hidden states).
    assert kept == [True] * LAYERS
    assert moved == ([True] if lora else [False]) + [False] * (LAYERS - 1)
    assert_same((reference[0], reference[1]), (result[0], result[1]), tol=1e-6)


def test_checkpoint_offload_needs_checkpointing_on() -> None:
    with pytest.raises(
        UserError, match=r"^memory\.offload_checkpoints: .*memory\.activation_checkpointing=true"
    ):
        enable_checkpoint_offload(tiny_llama(), pin_memory=False)


# --- all together, wired by build_model ----------------------------------------------------------


def model_section() -> ModelSection:
    config = tiny_llama().config.to_diff_dict()
    return ModelSection(init="random", tokenizer="unused", config={**config, "model_type": "llama"})


def test_build_model_wires_the_switches_off_by_default_and_all_on_together() -> None:
    section = model_section()
    plain = build_model(section, MemorySection(activation_checkpointing=True), "fp32", seed=0).train()
    assert "forward" not in vars(plain) and not any("forward" in vars(m) for m in plain.modules())
    memory = MemorySection(
        activation_checkpointing=True, tiled_mlp=True, tiled_loss=True, offload_checkpoints=True
    )
    alst = build_model(section, memory, "fp32", seed=0).train()
    input_ids, labels = batch()
    reference = loss_and_grads(plain, input_ids=input_ids, labels=labels)
    assert_same(reference, loss_and_grads(alst, input_ids=input_ids, labels=labels))
    assert_same(reference, loss_and_grads(alst, input_ids=input_ids, shift_labels=shifted(labels)))
