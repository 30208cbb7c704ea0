"""The optimizer llm_train builds: fused AdamW on CUDA and CPU, with the update of the unfused one."""

from __future__ import annotations

import copy

import torch

from llm_train.config.recipe_sections import OptimSection
from llm_train.runtime.model.optim import build_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5) -> None:
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(3, 8, generator=data)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_fused_adamw_on_every_device_with_the_update_of_the_unfused_one() -> None:
    """The fused kernel (CUDA's and the CPU's: the HF Trainer's default too) gets the recipe's betas and
    eps, decay on matrices only, and moves the weights as torch's per-tensor AdamW loop does."""
    optim = OptimSection(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, max_steps=5)
    fused_model, plain_model = _model(), _model()
    fused = build_optimizer(fused_model, optim, offload_optimizer="none")
    assert fused.defaults["fused"] is True
    matrices = [p for p in plain_model.parameters() if p.dim() >= 2]
    vectors = [p for p in plain_model.parameters() if p.dim() < 2]  # biases, norm weights: no decay
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    plain = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)
    before = copy.deepcopy(plain_model.state_dict())
    _train(fused_model, fused)
    _train(plain_model, plain)
    for name, value in plain_model.state_dict().items():
        assert not torch.equal(value, before[name])  # the weights moved
        # fp32 kernels that order their arithmetic differently: agreement to a few ulps after 5 steps
        torch.testing.assert_close(fused_model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_release_moments_frees_adam_state_inside_a_deepspeed_style_wrapper() -> None:
    from types import SimpleNamespace

    from llm_train.runtime.model.optim import release_moments

    weights = torch.nn.Parameter(torch.ones(64, 32))
    adam = torch.optim.AdamW([weights], lr=1e-3)
    weights.grad = torch.ones_like(weights)
    adam.step()
    moments = sum(v.numel() * v.element_size() for v in adam.state[weights].values() if v.dim() > 0)
    assert moments == 2 * 64 * 32 * 4  # m and v, fp32
    wrapper = SimpleNamespace(optimizer=adam)  # ZeRO / bf16 optimizers keep the stepping one here
    assert release_moments(wrapper) >= moments
    assert len(adam.state) == 0
    assert release_moments(SimpleNamespace()) == 0  # nothing to free: no error


def test_zero3_placeholders_are_grouped_by_their_real_shape() -> None:
    """Under ZeRO-3 zero.Init leaves each parameter an empty 1-D tensor with its shape in `ds_shape`:
    the matrices must still be decayed (they all fell into the no-decay group before)."""
    from llm_train.runtime.model.optim import _param_groups

    model = _model()
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    decay, no_decay = _param_groups(model, 0.1)
    assert [tuple(p.ds_shape) for p in decay["params"]] == [(16, 8), (4, 16)]
    assert [tuple(p.ds_shape) for p in no_decay["params"]] == [(16,), (16,), (16,), (4,)]
